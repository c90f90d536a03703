"""`tritium.kernels.gemm.fp8_gemm_tn` == `tritium.ref.gemm.fp8_gemm_tn` under the interpreter (and
`tritium.kernels.small_gemm`'s one-launch forms == their twins).

Bit for bit where the sum's order cannot matter: integer-valued fp8 operands with |v| <= 8 (exact
in e4m3 and e5m2) give integer products and partial sums far below 2^24, exact in fp32 in any
order, so the scale, bias and final rounding (same operations in the same order) must agree in
every bit. With wide random values the two sum in different orders and agree to fp32 rounding.
Tiles are 16x16x32 under the interpreter, so the odd shapes cross tile edges in M, N and K.
"""
from __future__ import annotations

import math

import pytest
import torch

from tritium.kernels import gemm as kgemm
from tritium.kernels import small_gemm as ksmall
from tritium.ref import gemm as rgemm

from ._helpers import assert_same_bits, wide_randn

pytestmark = [pytest.mark.interp,  # tl.range with a runtime step: numpy deprecation noise
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
SHAPES = [(16, 16, 16), (48, 32, 96), (32, 80, 48), (64, 16, 112)]


def _integer_fp8(rows, cols, dtype, gen):
    return torch.randint(-8, 9, (rows, cols), generator=gen).to(torch.float32).to(dtype)


def _scales(gen):
    # arbitrary fp32 scale_invs (not powers of two): the product is rounded the same way
    return (torch.rand(1, generator=gen) + 0.1), (torch.rand(1, generator=gen) * 3 + 0.01)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_kernel_equals_ref_bits_on_exact_sums(m, n, k, a_dtype, b_dtype, out_dtype, bias,
                                                   fast_accum):
    gen = torch.Generator().manual_seed(hash((m, n, k, str(a_dtype), str(b_dtype),
                                              str(out_dtype), bias, fast_accum)) % 2**31)
    a, b = _integer_fp8(m, k, a_dtype, gen), _integer_fp8(n, k, b_dtype, gen)
    sa, sb = _scales(gen)
    bias_t = torch.randn(n, generator=gen).to(out_dtype) if bias else None
    got = kgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, bias_t, fast_accum)
    want = rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, bias_t, fast_accum)
    assert got.abs().max() > 0
    assert_same_bits(got, want, f"{m}x{n}x{k} {a_dtype}x{b_dtype} -> {out_dtype}")


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
def test_gemm_kernel_writes_a_row_block_in_place(a_dtype, b_dtype):
    gen = torch.Generator().manual_seed(7)
    a, b = _integer_fp8(32, 64, a_dtype, gen), _integer_fp8(48, 64, b_dtype, gen)
    sa, sb = _scales(gen)
    full = torch.full((80, 48), 123.0)
    block = full[16:48]
    got = kgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32, out=block)
    assert got.data_ptr() == block.data_ptr()
    assert_same_bits(full[16:48], rgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32), "block")
    assert torch.all(full[:16] == 123.0) and torch.all(full[48:] == 123.0), \
        "rows outside the block were written"


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
def test_gemm_kernel_matches_ref_to_fp32_rounding_on_wide_values(a_dtype, b_dtype):
    gen = torch.Generator().manual_seed(11)
    a = wide_randn((48, 96), torch.float32, gen, decades=2.0).clamp(-400, 400).to(a_dtype)
    b = wide_randn((32, 96), torch.float32, gen, decades=2.0).clamp(-400, 400).to(b_dtype)
    sa, sb = _scales(gen)
    got = kgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32)
    want = rgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32)
    # each sum's rounding error is bounded by K * eps * sum|a_i b_i|, whatever the order
    bound = 96 * 2**-24 * (a.float().abs() @ b.float().abs().t()) * (sa * sb) + 1e-30
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("m,n,k", SHAPES[1:])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_kernel_accumulates_into_out_as_the_twin(m, n, k, out_dtype, fast_accum):
    """accumulate=True: out += the product, the old value added in fp32 before the one
    rounding; into a row block of a larger tensor (row stride != N), rows outside untouched."""
    gen = torch.Generator().manual_seed(hash((m, n, k, str(out_dtype), fast_accum)) % 2**31)
    a, b = _integer_fp8(m, k, E4M3, gen), _integer_fp8(n, k, E5M2, gen)
    sa, sb = _scales(gen)
    full = torch.randn(m + 32, n + 16, generator=gen).to(out_dtype)
    want_full = full.clone()
    got = kgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, None, fast_accum, full[16:16 + m, :n],
                            accumulate=True)
    want = rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, None, fast_accum,
                             want_full[16:16 + m, :n], accumulate=True)
    assert got.data_ptr() == full[16:16 + m].data_ptr()
    assert not torch.equal(want_full, full.new_zeros(full.shape))
    assert not torch.equal(want_full[16:16 + m, :n], rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype))
    assert_same_bits(full, want_full, f"{m}x{n}x{k} -> {out_dtype}")


@pytest.mark.parametrize("out_dtypes", [(torch.bfloat16, torch.float32),
                                        (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_pair_kernel_equals_its_twin_bits(out_dtypes, fast_accum):
    """Two GEMMs of different shapes and dtypes in one launch (a Linear's dgrad and wgrad):
    each result as the twin's, bit for bit on exact sums, across tile edges of both."""
    gen = torch.Generator().manual_seed(hash((str(out_dtypes), fast_accum)) % 2**31)
    first = (_integer_fp8(48, 80, E5M2, gen), _integer_fp8(32, 80, E4M3, gen),
             *_scales(gen), out_dtypes[0])
    second = (_integer_fp8(80, 48, E5M2, gen), _integer_fp8(64, 48, E4M3, gen),
              *_scales(gen), out_dtypes[1])
    got = ksmall.fp8_gemm_tn_pair(first, second, fast_accum)
    want = rgemm.fp8_gemm_tn_pair(first, second, fast_accum)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype and g.abs().max() > 0
        assert_same_bits(g, w, f"GEMM {i}")


@pytest.mark.parametrize("t,n,k_in", [(40, 48, 32), (16, 80, 48)])
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_fp8", [E5M2, E4M3])
def test_dgrad_wgrad_kernel_equals_its_twin_bits(t, n, k_in, dy_dtype, grad_fp8):
    """dy cast in the GEMMs' loads (delayed scaling), both backward GEMMs and dbias, one
    launch: dx, dw, dbias and the recorded amax as the twin's (cast, two GEMMs, a sum), bit for
    bit on exact sums; T not a multiple of the tiles (x^T's zero-padded columns), a
    column-sliced dy (row stride > N), values past e4m3's range saturating."""
    gen = torch.Generator().manual_seed(hash((t, n, k_in, str(dy_dtype), str(grad_fp8))) % 2**31)
    t_padded = -(-t // 16) * 16
    wide = torch.randint(-8, 9, (t, n + 8), generator=gen).to(dy_dtype)
    wide[0, 4] = 4096  # * scale 0.25: past e4m3's 448, saturates
    dy = wide[:, 4:4 + n]
    scale = torch.tensor([0.25])
    w_t = _integer_fp8(k_in, n, E4M3, gen)
    x_t = torch.cat([_integer_fp8(k_in, t, E4M3, gen),
                     torch.zeros(k_in, t_padded - t).to(E4M3)], 1)
    w_si, x_si = _scales(gen)
    for dbias_dtype in (dy_dtype, None):
        amax_got, amax_want = torch.tensor([3.0]), torch.tensor([3.0])
        got = ksmall.fp8_dgrad_wgrad(dy, scale, amax_got, grad_fp8, w_t, w_si, x_t, x_si,
                                    torch.bfloat16, torch.float32, dbias_dtype)
        want = rgemm.fp8_dgrad_wgrad(dy, scale, amax_want, grad_fp8, w_t, w_si, x_t, x_si,
                                     torch.bfloat16, torch.float32, dbias_dtype)
        assert amax_want.item() == dy.abs().max().item() > 3.0
        assert_same_bits(amax_got, amax_want, "amax")
        for name, g, w in zip(("dx", "dw"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and g.abs().max() > 0
            assert_same_bits(g, w, name)
        if dbias_dtype is None:
            assert got[2] is None and want[2] is None
        else:
            assert got[2].dtype == dbias_dtype and got[2].abs().max() > 0
            assert_same_bits(got[2], want[2], "dbias")


@pytest.mark.parametrize("m,n,k", [(48, 32, 80), (16, 80, 48)])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_cast_b_kernel_equals_its_twin_bits(m, n, k, w_dtype, bias):
    """The forward GEMM casting its high-precision weight in the loads (delayed scaling): out,
    the weight's fp8 transpose, scale_inv and amax as the twin's (cast, then the GEMM), bit for
    bit on exact sums; a column-sliced weight (row stride > K), a value saturating e4m3."""
    gen = torch.Generator().manual_seed(hash((m, n, k, str(w_dtype), bias)) % 2**31)
    a = _integer_fp8(m, k, E4M3, gen)
    wide = torch.randint(-8, 9, (n, k + 8), generator=gen).to(w_dtype)
    wide[1, 3] = 4096  # * 0.25 = 1024 > 448
    w = wide[:, 3:3 + k]
    scale, sa = torch.tensor([0.25]), _scales(gen)[0]
    bias_t = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    for write_b_t in (True, False):
        amax_got, amax_want = torch.tensor([1.0]), torch.tensor([1.0])
        got = ksmall.fp8_gemm_tn_cast_b(a, sa, w, scale, amax_got, E4M3, torch.bfloat16, bias_t,
                                       write_b_t)
        want = rgemm.fp8_gemm_tn_cast_b(a, sa, w, scale, amax_want, E4M3, torch.bfloat16,
                                        bias_t, write_b_t)
        assert amax_want.item() == 4096.0
        assert_same_bits(amax_got, amax_want, "amax")
        assert got[0].abs().max() > 0
        assert_same_bits(got[0], want[0], "out")
        assert_same_bits(got[2], want[2], "scale_inv")
        if write_b_t:
            assert got[1].shape == (k, n)
            assert_same_bits(got[1].view(torch.uint8), want[1].view(torch.uint8), "b_t")
        else:
            assert got[1] is None and want[1] is None


@pytest.mark.parametrize("m,n,k", [(40, 32, 80), (16, 48, 48)])
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32])
def test_gemm_cast_ab_kernel_equals_its_twin_bits(m, n, k, hp_dtype):
    """Both operands in high precision, both cast in the GEMM's loads: out, both fp8
    transposes (a's zero-padded past M to 16 rows), scale_invs and amaxes as the twin's, bit
    for bit on exact sums; row-sliced operands (row strides > K)."""
    gen = torch.Generator().manual_seed(hash((m, n, k, str(hp_dtype))) % 2**31)
    a = torch.randint(-8, 9, (m, k + 4), generator=gen).to(hp_dtype)[:, 2:2 + k]
    b = torch.randint(-8, 9, (n, k + 8), generator=gen).to(hp_dtype)[:, 8:]
    a_scale, b_scale = torch.tensor([0.5]), torch.tensor([2.0])
    bias_t = torch.randn(n, generator=gen).to(torch.bfloat16)
    for write_t in (True, False):
        amaxes = [torch.tensor([0.5]) for _ in range(4)]
        got = ksmall.fp8_gemm_tn_cast_ab(a, a_scale, amaxes[0], b, b_scale, amaxes[1], E4M3,
                                         torch.bfloat16, bias_t, write_t, write_t)
        want = rgemm.fp8_gemm_tn_cast_ab(a, a_scale, amaxes[2], b, b_scale, amaxes[3], E4M3,
                                         torch.bfloat16, bias_t, write_t, write_t)
        assert amaxes[2].item() == a.abs().max().item() and amaxes[3].item() > 0.5
        assert_same_bits(amaxes[0], amaxes[2], "a amax")
        assert_same_bits(amaxes[1], amaxes[3], "b amax")
        assert got[0].shape == (m, n) and got[0].abs().max() > 0
        for i, name in ((0, "out"), (2, "a scale_inv"), (4, "b scale_inv")):
            assert_same_bits(got[i], want[i], name)
        for i, name in ((1, "a8^T"), (3, "b8^T")):
            if write_t:
                assert_same_bits(got[i].view(torch.uint8), want[i].view(torch.uint8), name)
            else:
                assert got[i] is None and want[i] is None


@pytest.mark.parametrize("top,pow2", [(224.0, False), (300.0, True)])
@pytest.mark.parametrize("grad_fp8", [E5M2, E4M3])
def test_one_launch_forms_under_current_scaling_equal_their_twins(top, pow2, grad_fp8):
    """Float8CurrentScaling (`current=(amax_epsilon, power_2_scale)`, no scale given): each
    one-launch form measures its high-precision operands' amaxes first (a and b in one launch),
    derives the scales as the cast kernel does and records nothing; outputs, fp8 transposes,
    scale_invs and dbias as the twins', bit for bit (the largest |value| `top` makes every
    scale a power of two: the fp8 values stay integers and the sums exact)."""
    gen = torch.Generator().manual_seed(int(top) + pow2 + (grad_fp8 == E4M3))
    current = (0.0, pow2)

    def hp(rows, cols, dtype=torch.bfloat16):
        x = torch.randint(-8, 9, (rows, cols), generator=gen).to(dtype)
        x[rows // 2, cols // 3] = -top
        return x

    t, n, k_in = 40, 48, 32
    dy = hp(t, n + 4)[:, 2:2 + n]  # a column slice: row stride > N
    w_t = _integer_fp8(k_in, n, E4M3, gen)
    x_t = torch.cat([_integer_fp8(k_in, t, E4M3, gen),
                     torch.zeros(k_in, -(-t // 16) * 16 - t).to(E4M3)], 1)
    w_si, x_si = _scales(gen)
    got = ksmall.fp8_dgrad_wgrad(dy, None, None, grad_fp8, w_t, w_si, x_t, x_si,
                                torch.bfloat16, torch.float32, torch.bfloat16, current=current)
    want = rgemm.fp8_dgrad_wgrad(dy, None, None, grad_fp8, w_t, w_si, x_t, x_si,
                                 torch.bfloat16, torch.float32, torch.bfloat16, current=current)
    for name, g, w in zip(("dx", "dw", "dbias"), got, want):
        assert g.abs().max() > 0
        assert_same_bits(g, w, name)

    m, n, k = 40, 32, 80
    a, b = hp(m, k), hp(n, k + 8, torch.float32)[:, 8:]
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = ksmall.fp8_gemm_tn_cast_ab(a, None, None, b, None, None, E4M3, torch.bfloat16, bias,
                                     current=current)
    want = rgemm.fp8_gemm_tn_cast_ab(a, None, None, b, None, None, E4M3, torch.bfloat16, bias,
                                     current=current)
    scale = 448.0 / top if not pow2 else 2.0 ** math.floor(math.log2(448.0 / top))
    assert got[0].abs().max() > 0 and got[2].item() == 1.0 / scale  # the scale from a's amax
    for i, name in ((0, "out"), (2, "a scale_inv"), (4, "b scale_inv")):
        assert_same_bits(got[i], want[i], name)
    for i, name in ((1, "a8^T"), (3, "b8^T")):
        assert_same_bits(got[i].view(torch.uint8), want[i].view(torch.uint8), name)

    a8 = _integer_fp8(m, k, E4M3, gen)
    got = ksmall.fp8_gemm_tn_cast_b(a8, w_si, b, None, None, E4M3, torch.bfloat16,
                                   current=current)
    want = rgemm.fp8_gemm_tn_cast_b(a8, w_si, b, None, None, E4M3, torch.bfloat16,
                                    current=current)
    for i, name in ((0, "out"), (2, "b scale_inv")):
        assert_same_bits(got[i], want[i], name)
    assert_same_bits(got[1].view(torch.uint8), want[1].view(torch.uint8), "b8^T")
