"""gpu tier: Triton kernels == ref twins bit for bit on CUDA, and the FP8 Linear on real
FP8 tensor cores (torch._scaled_mm) against its emulation and a high-precision reference.

Skipped without CUDA; the FP8 GEMM tests also need compute capability >= 8.9 (Hopper: 9.0).
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from testlib import fp8_linear_steps
from tritium import recipe
from tritium.kernels import cast as kcast
from tritium.kernels import scaling as kscaling
from tritium.ref import cast as rcast
from tritium.ref import scaling as rscaling

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _bits_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype in (E4M3, E5M2):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _input(m, n, dtype, seed, specials=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", generator=g) * 3
    if specials:
        x.view(-1)[:: max(1, x.numel() // 7)] = 1e6  # beyond fp8 max: clamped
        x.view(-1)[1] = -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(1, 16), (33, 80), (1000, 4096), (8192, 1040)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("mode", ["delayed", "current", "current_pow2"])
def test_cast_transpose_kernel_equals_ref(shape, dtype, fp8, mode):
    x = _input(*shape, dtype, seed=hash((shape, str(dtype), str(fp8), mode)) % 2**31,
               specials=mode == "delayed")
    outs = []
    for impl in (kcast, rcast):
        amax = torch.full((1,), 0.5, device="cuda")
        if mode == "delayed":
            scale = torch.full((1,), 37.3, device="cuda")
            res = impl.cast_transpose(x, scale, amax, fp8, pad_rows_to=16, write_transpose=True)
        else:
            amax.zero_()
            impl.amax_into(x, amax)
            res = impl.cast_transpose(x, None, amax, fp8, pad_rows_to=16, write_transpose=True,
                                      current=(1e-12, mode == "current_pow2"))
        outs.append((*res, amax))
    for got, want in zip(*outs):
        assert _bits_equal(got, want)


@pytest.mark.parametrize("special", ["max", "nan"])
@pytest.mark.parametrize("where", [0, 7_000_001, -1])
def test_amax_into_walks_every_block(special, where):
    """The grid-stride amax kernel (a few programs per SM, each walking many 4096-element
    blocks) at 16384 x 4096 bf16: the largest |x| or a NaN put at the first, a middle or the
    last element is found: the twin's bits for a max; for a NaN, a NaN (its payload is the
    hardware's: PTX max.NaN gives the canonical 0x7fffffff, torch.amax the input's)."""
    g = torch.Generator(device="cuda").manual_seed(where % 1000 + len(special))
    x = (torch.randn(16384, 4096, device="cuda", generator=g)).to(torch.bfloat16)
    x.view(-1)[where] = -1e4 if special == "max" else float("nan")
    got, want = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    kcast.amax_into(x, got)
    rcast.amax_into(x, want)
    if special == "nan":
        assert got.isnan().item() and want.isnan().item()
    else:
        assert _bits_equal(got, want)
        assert got.item() == x.view(-1)[where].float().abs().item()


@pytest.mark.parametrize("shapes", [((8192, 4096), (4096, 4096)), ((1000, 1040), (48, 1040))])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_cast_pair_kernel_equals_ref(shapes, dtypes, mode):
    """The forward's one-launch cast of input and weight == the twin, bit for bit."""
    seed = hash((shapes, str(dtypes), mode)) % 2**31
    xs = [_input(*s, d, seed=seed + i, specials=mode == "delayed")
          for i, (s, d) in enumerate(zip(shapes, dtypes))]
    current = (1e-12, False) if mode == "current" else None
    outs = []
    for impl in (kcast, rcast):
        jobs = []
        for i, (x, pad, t) in enumerate(zip(xs, (16, 1), (True, False))):
            amax = torch.full((1,), 0.5, device="cuda")
            if current is not None:
                amax.zero_()
                impl.amax_into(x, amax)
            scale = None if current else torch.full((1,), 37.3 - 20 * i, device="cuda")
            jobs.append((x, scale, amax, pad, True, t))
        res = impl.cast_transpose_pair(jobs[0], jobs[1], E4M3, current)
        outs.append([*res[0], *res[1], jobs[0][2], jobs[1][2]])
    for got, want in zip(*outs):
        assert _bits_equal(got, want)


def test_nan_input_gives_nan_amax_on_both():
    x = _input(64, 64, torch.bfloat16, 3)
    x[5, 7] = float("nan")
    for impl in (kcast, rcast):
        amax = torch.zeros(1, device="cuda")
        data, _, _ = impl.cast_transpose(x, torch.ones(1, device="cuda"), amax, E4M3)
        assert torch.isnan(amax).all()
        assert torch.isnan(data[5, 7].float())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_kernel_equals_ref(out_dtype):
    x = _input(257, 96, torch.float32, 11)
    data, _, scale_inv = rcast.cast_transpose(x, torch.full((1,), 3.0, device="cuda"), None, E4M3)
    assert _bits_equal(kcast.dequantize(data, scale_inv, out_dtype),
                       rcast.dequantize(data, scale_inv, out_dtype))


@pytest.mark.parametrize("shape", [(4096, 14336), (6144, 4096), (1000, 4100), (33, 16)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_transpose_fp8_kernel_equals_ref(shape):
    """The fp8 transpose kernel (FSDP2's gathered weights, TP's gathered inputs) moves the same
    bytes as torch's transpose, at full tiles and at ragged edges."""
    x8 = (torch.randn(shape, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = kcast.transpose_fp8(x8)
    assert torch.equal(got.view(torch.uint8), rcast.transpose_fp8(x8).view(torch.uint8))
    out = torch.empty_like(got)
    kcast.transpose_fp8(x8, out=out)
    assert torch.equal(out.view(torch.uint8), got.view(torch.uint8))


@pytest.mark.parametrize("length", [1, 3, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_update_kernel_equals_ref(length, algo, margin):
    g = torch.Generator(device="cuda").manual_seed(length * 7 + margin)
    hist = torch.rand(length, 5, device="cuda", generator=g) * 10
    hist[0, 1] = 0.0                 # unused slot: not rolled
    hist[0, 2] = float("inf")        # keeps its scale
    hist[0, 3] = 1e-38               # scale overflows -> fp32 max
    scale = torch.rand(5, device="cuda", generator=g) + 0.5
    h_k, s_k, h_r, s_r = hist.clone(), scale.clone(), hist.clone(), scale.clone()
    kscaling.delayed_scaling_update(h_k, s_k, 448.0, margin, algo)
    rscaling.delayed_scaling_update(h_r, s_r, 448.0, margin, algo)
    assert _bits_equal(h_k, h_r) and _bits_equal(s_k, s_r)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_update_many_kernel_equals_ref(algo):
    """One launch over states of 5, 1 and 3 slots (a region's update) == the twin, state by
    state, twice (the prepared launch replayed on its fixed table)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    hists = [torch.rand(16, n, device="cuda", generator=g) * 10 for n in (5, 1, 3)]
    hists[0][0, 1] = 0.0
    hists[2][0, 0] = float("nan")
    scales = [torch.rand(h.shape[1], device="cuda", generator=g) + 0.5 for h in hists]
    hk, sk = [h.clone() for h in hists], [s.clone() for s in scales]
    hr, sr = [h.clone() for h in hists], [s.clone() for s in scales]
    launch = kscaling.prepared_update_many(hk, sk, 57344.0, 1, algo)
    for _ in range(2):
        launch()
        rscaling.delayed_scaling_update_many(hr, sr, 57344.0, 1, algo)
        for a, b, c, d in zip(hk, hr, sk, sr):
            assert _bits_equal(a, b) and _bits_equal(c, d)
        for a, b in zip(hk, hr):
            a[0] = b[0] = torch.rand(a.shape[1], device="cuda", generator=g)


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores")
@pytest.mark.parametrize("rec", [recipe.DelayedScaling(amax_history_len=8),
                                 recipe.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("tokens", [4096, 1000])
def test_fp8_linear_on_tensor_cores_matches_emulation(setenv, rec, tokens):
    torch.manual_seed(0)
    layer = te.Linear(1024, 768, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 768, device="cuda", dtype=torch.bfloat16)

    def run():  # 3 steps let delayed scales settle; identical on both paths
        return fp8_linear_steps(layer, x, dy, rec, steps=3)

    real = run()
    real_scales = [s.scale.clone() for s in (layer.fp8_meta.fwd, layer.fp8_meta.bwd) if s]
    setenv("TRITIUM_EMULATE_FP8", "1")
    layer.fp8_meta = type(layer.fp8_meta)(2, 1)  # fresh state: the same scale sequence again
    emulated = run()
    emu_scales = [s.scale for s in (layer.fp8_meta.fwd, layer.fp8_meta.bwd) if s]
    for a, b in zip(real_scales, emu_scales):
        assert torch.equal(a, b), "identical amaxes must give identical scales"
    hp = x.float() @ layer.weight.float().t() + layer.bias.float()
    for r, e in zip(real, emulated):
        assert _rel_err(r, e) < 1e-2, "tensor cores and emulation disagree"
    assert _rel_err(real[0], hp) < 0.05


@pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores")
def test_fp8_linear_makes_no_host_sync():
    layer = te.Linear(512, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rec = recipe.DelayedScaling(amax_history_len=4)
    for i in range(3):
        if i == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with te.fp8_autocast(fp8_recipe=rec):
                out = layer(x)
            out.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores")
@pytest.mark.parametrize("t,k,n", [(8192, 4096, 4096), (8192, 4096, 14336)])
def test_fp8_linear_peak_memory_in_network_not_above_bf16(t, k, n):
    """The input comes from a previous op (as in a network), so what each layer keeps for
    backward counts: bf16 keeps its bf16 input, FP8 keeps the fp8 transpose."""
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    rec = recipe.DelayedScaling(amax_history_len=16)

    def peak(fn):
        for _ in range(2):
            x.grad = None
            for p in list(base.parameters()) + list(fp8.parameters()):
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    def run_fp8():
        with te.fp8_autocast(fp8_recipe=rec):
            out = fp8(x * 1.0)
        out.backward(dy)

    bf16_peak = peak(lambda: base(x * 1.0).backward(dy))
    fp8_peak = peak(run_fp8)
    # Slack: a few fp32 scale_inv tensors (one 512-byte allocator block each); the tensors
    # that matter are tens to hundreds of MiB.
    assert fp8_peak <= bf16_peak + 16 * 512, (fp8_peak / 2**20, bf16_peak / 2**20)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores")
def test_blocked_fp8_backward_on_tensor_cores_matches_one_pass(monkeypatch):
    import importlib
    fl = importlib.import_module("tritium.functional.linear")
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    grads = []
    for parts in (1, 4):
        monkeypatch.setattr(fl, "backward_blocks", lambda t, k, n, parts=parts: parts)
        torch.manual_seed(0)
        layer = te.Linear(256, 1024, params_dtype=torch.bfloat16, device="cuda")
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            out = layer(xi)
        out.backward(dy)
        grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*grads):
        assert _rel_err(b, a) < 1e-2
