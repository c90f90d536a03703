"""`tritium.kernels.cast` == `tritium.ref.cast`, bit for bit, under the Triton interpreter.

Every case runs the kernel launcher and its twin on clones of the same fresh random input and
compares every output as integer bits: fp8 data and its transpose, scale_inv, and the amax
that both max-accumulate into (pre-filled below or above the data's own amax). Shapes are tiny
and odd (tiles are 16x16 under the interpreter, so 17 and 33 rows cross tile edges and padding).
Values span six decades and the scales push part of them past fp8 max (saturation) and part
into fp8 subnormals; special-value cases put inf and NaN into the input (NaN must win the amax).
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.formats import FP32_MAX, fp8_max
from tritium.kernels import cast as kcast
from tritium.ref import cast as rcast

from ._helpers import assert_same_bits, wide_randn

pytestmark = [pytest.mark.interp,  # numpy warns on the inf/NaN arithmetic these tests are about
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
HIGH = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 16), (17, 48), (33, 80), (5, 7)]
WRITES = [(True, False), (False, True), (True, True)]


def run_both(fn_name, x, *args, **kw):
    """Run kernel and twin on separate clones of every tensor argument; return both results
    and the (possibly updated) tensor arguments."""
    outs, argss = [], []
    for mod in (kcast, rcast):
        xa = x.clone() if isinstance(x, torch.Tensor) else x
        a = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        outs.append(getattr(mod, fn_name)(xa, *a, **kw))
        argss.append(a)
    return outs, argss


def check_cast(x, scale, amax, dtype, **kw):
    (kout, rout), (kargs, rargs) = run_both("cast_transpose", x, scale, amax, dtype, **kw)
    for name, g, w in zip(("data", "data_t", "scale_inv"), kout, rout):
        assert_same_bits(g, w, name)
    if amax is not None:
        assert_same_bits(kargs[1], rargs[1], "amax")
    return kout, kargs


def delayed_scale(x: torch.Tensor, dtype, gen) -> torch.Tensor:
    """A non-power-of-two scale that sends ~10% of |x| past fp8 max."""
    q = x.float().abs().quantile(0.9) if x.numel() > 1 else x.float().abs().max()
    jitter = torch.empty(1).uniform_(0.7, 1.3, generator=gen)
    return (fp8_max(dtype) / q * jitter).float().reshape(1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("in_dtype", HIGH, ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("pad", [1, 16])
@pytest.mark.parametrize("write", WRITES, ids=lambda w: f"data{int(w[0])}_t{int(w[1])}")
def test_cast_transpose_delayed(shape, in_dtype, dtype, pad, write, gen):
    x = wide_randn(shape, in_dtype, gen)
    scale = delayed_scale(x, dtype, gen)
    own = x.float().abs().max()
    # pre-filled amax: half the data's (gets raised) for most cases, twice (kept) for some
    amax = (own * (2.0 if shape[0] % 2 == 1 and pad == 16 else 0.5)).reshape(1).float()
    (data, data_t, _), (_, amax_k, _) = check_cast(
        x, scale, amax, dtype, pad_rows_to=pad, write_data=write[0], write_transpose=write[1])
    assert amax_k.item() == max(own.item(), amax.item())
    fp8 = (data if data is not None else data_t.t()).float()
    assert (fp8[shape[0]:] == 0).all(), "padding rows must be zero"
    assert (fp8.abs() == fp8_max(dtype)).any(), "no value saturated"
    assert (fp8[:shape[0]] != 0).float().mean() > 0.5


@pytest.mark.parametrize("shape", [(17, 48), (5, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cast_transpose_without_amax(shape, dtype, gen):
    x = wide_randn(shape, torch.float32, gen)
    check_cast(x, delayed_scale(x, dtype, gen), None, dtype, pad_rows_to=16, write_transpose=True)


@pytest.mark.parametrize("in_dtype", HIGH, ids=str)
def test_cast_transpose_amax_only(in_dtype, gen):
    """Neither layout written: only scale_inv and the amax update."""
    x = wide_randn((33, 80), in_dtype, gen)
    (data, data_t, _), (_, amax, _) = check_cast(
        x, torch.tensor([0.75]), torch.tensor([1e-3]), E4M3, write_data=False, write_transpose=False)
    assert data is None and data_t is None
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cast_transpose_strided_input(dtype, gen):
    """A row slice of a wider tensor (row stride != N) and a transposed view (column stride 1
    is missing) give the same bits as the contiguous copy."""
    base = wide_randn((33, 96), torch.bfloat16, gen)
    for x in (base[:, 5:85], base[:, 3:50].t()):
        scale = delayed_scale(x, dtype, gen)
        amax = torch.full((1,), 0.25, dtype=torch.float32)
        (kout, _), _ = run_both("cast_transpose", x.contiguous(), scale, amax, dtype,
                                pad_rows_to=16, write_transpose=True)
        strided, _ = check_cast(x, scale, amax, dtype, pad_rows_to=16, write_transpose=True)
        for a, b in zip(strided, kout):
            assert_same_bits(a, b, "strided vs contiguous")


SPECIALS = {"inf": ((3, 5), float("inf")), "-inf": ((16, 0), -float("inf")),
            "nan": ((9, 47), float("nan"))}


@pytest.mark.parametrize("specials", [("inf",), ("-inf",), ("nan",), ("inf", "nan"), ("nan", "-inf")],
                         ids="+".join)
@pytest.mark.parametrize("in_dtype", HIGH, ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("prefill", ["finite", "inf", "nan"])
def test_cast_transpose_inf_nan(specials, in_dtype, dtype, prefill, gen):
    """inf saturates to +-max, NaN stays NaN; amax: NaN > inf > finite, whichever side has it."""
    x = wide_randn((17, 48), in_dtype, gen)
    for s in specials:
        pos, value = SPECIALS[s]
        x[pos] = value
    amax = torch.tensor([{"finite": 1.5, "inf": float("inf"), "nan": float("nan")}[prefill]])
    (data, data_t, _), (_, amax_k, _) = check_cast(
        x, torch.tensor([3.0]), amax, dtype, pad_rows_to=16, write_transpose=True)
    assert torch.equal(data_t, data.t().contiguous()) or data.float().isnan().any()
    if "nan" in specials or prefill == "nan":
        assert amax_k.isnan().all()
    else:
        assert amax_k.item() == float("inf")
    if "inf" in specials:
        assert data[3, 5].float().item() == fp8_max(dtype)
    if "-inf" in specials:
        assert data[16, 0].float().item() == -fp8_max(dtype)
    if "nan" in specials:
        assert data[9, 47].float().isnan()


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, FP32_MAX], ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cast_transpose_odd_scale_keeps_zero_padding(scale, dtype, gen):
    """Padding rows are zeros whatever the scale (0 * inf would be NaN); the real rows follow
    the scale (inf/FP32_MAX saturate, NaN gives NaN, 0 gives signed zeros)."""
    x = wide_randn((5, 7), torch.float32, gen)
    (data, data_t, scale_inv), _ = check_cast(x, torch.tensor([scale]), torch.tensor([0.5]), dtype,
                                              pad_rows_to=16, write_transpose=True)
    assert (data[5:].view(torch.uint8) == 0).all() and (data_t[:, 5:].view(torch.uint8) == 0).all()
    if scale != scale:
        assert data[:5].float().isnan().all()
    elif scale == 0.0:
        assert (data[:5].float() == 0).all()
    else:
        assert (data[:5].float().abs() == fp8_max(dtype)).all()


@pytest.mark.parametrize("shape", [(1, 16), (33, 80), (5, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("in_dtype", HIGH, ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("eps,pow2", [(0.0, False), (0.0, True), (1e-3, False), (1e-3, True)])
def test_cast_transpose_current(shape, in_dtype, dtype, eps, pow2, gen):
    """Float8CurrentScaling: amax_into first (kernel and twin must agree), then the cast derives
    the scale from that amax; amax itself is left alone. eps=1e-3 with data below it exercises
    the epsilon floor."""
    small = shape == (5, 7) and eps > 0
    x = wide_randn(shape, in_dtype, gen, decades=1.0) * (1e-5 if small else 1.0)
    amax0 = torch.zeros(1)
    (_, _), (ka, ra) = run_both("amax_into", x, amax0)
    assert_same_bits(ka[0], ra[0], "amax_into")
    amax = ka[0]
    assert amax.item() == x.float().abs().max().item() and (amax.item() < eps) == small
    (data, data_t, scale_inv), (_, amax_after, _) = check_cast(
        x, None, amax, dtype, pad_rows_to=16, write_transpose=True, current=(eps, pow2))
    assert_same_bits(amax_after, amax, "amax must not change")
    scale = 1.0 / scale_inv.item()
    if pow2:
        assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    elif small:  # the eps floor: scale = fp8_max / eps, so nothing reaches fp8_max
        want = 1.0 / (torch.tensor([fp8_max(dtype)]) / torch.tensor([eps]))  # fp32 all the way
        assert_same_bits(scale_inv, want, "eps-floored scale_inv")
        assert data.float().abs().max().item() < fp8_max(dtype)
    else:
        assert data.float().abs().max().item() == fp8_max(dtype)


@pytest.mark.parametrize("amax_value", [0.0, float("inf"), float("nan"), 1e-38, 3e-39],
                         ids=["zero", "inf", "nan", "tiny", "subnormal"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scale_edge_amax(amax_value, dtype, pow2, gen):
    """amax 0/inf/NaN -> scale 1; an amax so small that fp8_max/amax overflows -> fp32 max."""
    x = wide_randn((17, 48), torch.float32, gen, decades=0.5)
    (data, _, scale_inv), _ = check_cast(x, None, torch.tensor([amax_value]), dtype,
                                         pad_rows_to=16, write_transpose=True, current=(0.0, pow2))
    if amax_value in (0.0, float("inf")) or amax_value != amax_value:
        assert scale_inv.item() == 1.0
    else:
        want = 1.0 / torch.tensor([FP32_MAX if not pow2 else 2.0 ** 127])  # fp32 division
        assert_same_bits(scale_inv, want, "scale_inv of the overflowed scale")
        assert data.float().abs().max().item() == fp8_max(dtype)


@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (17, 48), (3, 5, 37), (80, 33)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_dtype", HIGH, ids=str)
@pytest.mark.parametrize("prefill", ["below", "above"])
def test_amax_into(shape, in_dtype, prefill, gen):
    x = wide_randn(shape, in_dtype, gen)
    if len(shape) == 2 and shape[0] == 80:
        x = x.t()  # non-contiguous
    own = x.float().abs().max()
    amax = (own * (0.5 if prefill == "below" else 3.0)).reshape(1)
    (_, _), (ka, ra) = run_both("amax_into", x, amax)
    assert_same_bits(ka[0], ra[0], "amax")
    assert ka[0].item() == max(own.item(), amax.item())


@pytest.mark.parametrize("shapes", [((17, 48), (1000,)), ((7,), (80, 33)), ((0, 4), (300,))],
                         ids=["2d+1d", "small+wide", "empty+1d"])
def test_amax_pair_into(shapes, gen):
    """Two tensors' amaxes in one launch == amax_into of each (prefilled below one, above the
    other; NaN in the second's last block): the first programs walk x, the rest y."""
    x, y = (wide_randn(s, torch.bfloat16, gen) for s in shapes)
    if y.numel() > 4:
        y.view(-1)[-1] = float("nan")
    own_x = x.float().abs().max().item() if x.numel() else 0.0
    amax = torch.tensor([own_x * 0.5, 1e30])
    (_, _), (ka, ra) = run_both("amax_pair_into", x, y, amax)
    assert_same_bits(ka[1], ra[1], "amaxes")
    assert ka[1][0].item() == max(own_x, amax[0].item())
    assert ka[1][1].isnan().item() == (y.numel() > 4)


@pytest.mark.parametrize("special", ["inf", "nan", "nan+inf", "-inf", "late nan"])
def test_amax_into_inf_nan(special, gen):
    """Under the interpreter 1000 elements are 4 blocks for 3 programs: program 0 walks blocks 0
    and 3, so a NaN in its first block meets larger values later, and a late one (index 900)
    meets a running max."""
    x = wide_randn((1000,), torch.float32, gen)
    if "inf" in special:
        x[700] = -float("inf") if special.startswith("-") else float("inf")
    if "nan" in special:
        x[900 if special.startswith("late") else 3] = float("nan")
    for prefill in (0.5, float("inf"), float("nan")):
        (_, _), (ka, ra) = run_both("amax_into", x, torch.tensor([prefill]))
        assert_same_bits(ka[0], ra[0], f"amax {special} prefill {prefill}")
        assert ka[0].isnan().item() == ("nan" in special or prefill != prefill)


@pytest.mark.parametrize("shape", [(17, 48), (5, 7), (300,)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("out_dtype", HIGH, ids=str)
def test_dequantize(shape, dtype, out_dtype, gen):
    """Random fp8 bit patterns (all classes: subnormal, max, NaN, and inf for e5m2) times a
    random scale_inv, including one that pushes values past bf16/fp16 range and into subnormals."""
    pats = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    fmax = torch.finfo(dtype).max
    pats.view(-1)[:2] = torch.tensor([fmax, -fmax]).to(dtype).view(torch.uint8)
    pats.view(-1)[2:4] = torch.tensor([0x01, 0x7F], dtype=torch.uint8)  # min subnormal, NaN
    data = pats.view(dtype)
    for scale_inv in (torch.empty(1).uniform_(1e-3, 2.0, generator=gen), torch.tensor([3e4]),
                      torch.tensor([1e-7])):
        (got, want), _ = run_both("dequantize", data, scale_inv, out_dtype)
        assert got.shape == data.shape
        assert_same_bits(got, want, f"dequantize scale_inv={scale_inv.item()}")


def test_cast_transpose_empty(gen):
    x = torch.empty(0, 16)
    amax = torch.tensor([0.75])
    for pad in (1, 16):
        (data, data_t, _), _ = check_cast(x, torch.tensor([2.0]), amax, E4M3, pad_rows_to=pad,
                                          write_transpose=True)
        assert data.shape == (0, 16) and data_t.shape == (16, 0)



@pytest.mark.parametrize("shapes", [((17, 48), (33, 48)), ((33, 80), (16, 80)), ((5, 7), (1, 7))],
                         ids=lambda s: f"{s[0][0]}x{s[0][1]}+{s[1][0]}x{s[1][1]}")
@pytest.mark.parametrize("in_dtypes", [(torch.bfloat16, torch.bfloat16),
                                       (torch.float16, torch.float32)], ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("mode", ["delayed", "delayed_b_unrecorded", "current"])
def test_cast_transpose_pair(shapes, in_dtypes, dtype, mode, gen):
    """The two-operand cast (a GEMM's input with its transpose, the weight with or without)
    == its twin, bit for bit, and == two single kernel casts: data, transposes, scale_invs and
    both amaxes. Under current scaling each job's amax holds the finished amax."""
    xs = [wide_randn(s, d, gen) for s, d in zip(shapes, in_dtypes)]
    writes = [(True, True), (True, mode != "current")]
    pads = (16, 1)
    if mode == "current":
        amaxes = [x.float().abs().max().reshape(1) for x in xs]
        scales, current = [None, None], (0.0, False)
    else:
        amaxes = [(x.float().abs().max() * 0.5).reshape(1) for x in xs]
        if mode == "delayed_b_unrecorded":
            amaxes[1] = None
        scales, current = [delayed_scale(x, dtype, gen) for x in xs], None

    def jobs():  # fresh clones of the amaxes for each implementation
        return [(x, s, None if a is None else a.clone(), p, w[0], w[1])
                for x, s, a, p, w in zip(xs, scales, amaxes, pads, writes)]

    results = {}
    for name, mod in (("kernel", kcast), ("twin", rcast)):
        js = jobs()
        results[name] = (mod.cast_transpose_pair(js[0], js[1], dtype, current), js)
    js = jobs()
    singles = tuple(kcast.cast_transpose(x, s, a, dtype, pad_rows_to=p, write_data=d,
                                         write_transpose=t, current=current)
                    for x, s, a, p, d, t in js)
    results["two kernel casts"] = (singles, js)
    (got, got_jobs) = results.pop("kernel")
    for other, (want, want_jobs) in results.items():
        for i in range(2):
            for part, g, w in zip(("data", "data_t", "scale_inv"), got[i], want[i]):
                assert_same_bits(g, w, f"{other}: operand {i} {part}")
            if got_jobs[i][2] is not None:
                assert_same_bits(got_jobs[i][2], want_jobs[i][2], f"{other}: operand {i} amax")
    for i, x in enumerate(xs):
        if got_jobs[i][2] is not None and mode != "current":
            assert got_jobs[i][2].item() == x.float().abs().max().item()  # raised from half
    assert got[0][0].shape == (-(-shapes[0][0] // 16) * 16, shapes[0][1])
    assert (got[0][0].float().abs() == fp8_max(dtype)).any()


@pytest.mark.parametrize("shape", SHAPES + [(48, 33)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_transpose_fp8(shape, dtype, gen):
    """The transpose of fp8 data (fresh and into a given buffer) moves the same bytes as the
    twin, across tile edges (16x16 tiles here), and is the transpose."""
    x8 = (wide_randn(shape, torch.float32, gen) * 10).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    got, want = kcast.transpose_fp8(x8), rcast.transpose_fp8(x8)
    assert_same_bits(got, want, "transpose")
    assert torch.equal(got.view(torch.uint8), x8.view(torch.uint8).t())
    buf = torch.full(shape[::-1], 7, dtype=torch.uint8).view(dtype)
    assert kcast.transpose_fp8(x8, out=buf) is buf
    assert_same_bits(buf, want, "transpose into out")


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_transpose_into_a_column_block(in_dtype, gen):
    """out's data_t may be a column block of a wider buffer (the FP8 lm_head gathers several
    chunks' transposes for one weight-gradient GEMM): the block gets the fresh cast's bits, the
    columns around it keep theirs; the twin likewise."""
    x = wide_randn((33, 48), in_dtype, gen)
    scale = delayed_scale(x, E5M2, gen)
    want = rcast.cast_transpose(x, scale, None, E5M2, pad_rows_to=16, write_transpose=True)
    for mod in (kcast, rcast):
        wide = torch.full((48, 16 + 48 + 32), 7, dtype=torch.uint8).view(E5M2)
        block = wide[:, 16:64]
        out = (torch.empty(48, 48, dtype=E5M2), block, torch.empty(1))
        got = mod.cast_transpose(x, scale, None, E5M2, pad_rows_to=16, write_transpose=True,
                                 out=out)
        assert got[1] is block
        for name, g, w in zip(("data", "data_t", "scale_inv"), got, want):
            assert_same_bits(g, w, f"{mod.__name__} {name}")
        rest = torch.cat([wide[:, :16], wide[:, 64:]], 1).view(torch.uint8)
        assert (rest == 7).all(), mod.__name__
