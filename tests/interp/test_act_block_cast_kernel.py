"""`kernels.act_block_cast` (activation + Float8BlockScaling 1x128 casts) under the Triton
interpreter, bit for bit.

Exact, checked as integer bits (data, scale_inv, data_t, scale_inv_t):
  * fused kernel == the unfused kernel chain it replaces (`kernels.activation.activation_fwd`,
    zero rows to a multiple of 16, `kernels.block_cast.quantize_blocks` rowwise + columnwise):
    what LayerNormMLP relies on (fused == unfused);
  * the cast half == the twin's `ref.block_cast.quantize_blocks` of the same activation values;
  * end to end == the twin (`ref.activation.activation_fwd_blocks`) for the kinds without exp
    (relu, srelu, reglu, sreglu), where the high-precision values are exact too (the exp kinds
    differ from the twin at fp32 ulp level, test_activation_kernels.py).
Shapes cross the 128 edges in tokens (130, 257 -> padded 144, 272) and features (F 136, 200),
plus tiny ones (1, 5 tokens); one case zeroes a whole 128x128 tile (amax 0 -> scale 1).
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import act_block_cast as kabc
from tritium.kernels import activation as kact
from tritium.kernels import block_cast as kbc
from tritium.ref import activation as ract
from tritium.ref import block_cast as rbc

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (kind, tokens, F, dtype, fp8 dtype, columnwise, power_2_scale, zero tile)
CASES = [("swiglu", 130, 200, BF16, E4M3, True, True, False),
         ("gelu", 257, 136, BF16, E4M3, True, True, True),
         ("reglu", 130, 136, F32, E4M3, True, False, False),
         ("srelu", 5, 24, F16, E5M2, True, True, False),
         ("geglu", 1, 8, F32, E4M3, False, True, False),
         ("relu", 257, 24, BF16, E4M3, True, True, True),
         ("sreglu", 17, 136, BF16, E4M3, True, True, False),
         ("qgelu", 33, 40, F16, E4M3, False, False, False)]
EXACT_KINDS = {"relu", "srelu", "reglu", "sreglu"}


def _blocks_equal(got, want, what):
    for name, g, w in zip(rbc.BlockQuantized._fields, got, want):
        assert_same_bits(g, w, f"{what}: {name}")


@pytest.mark.parametrize("kind,rows,f,dtype,fp8_dtype,columnwise,pow2,zero_tile", CASES, ids=str)
def test_activation_block_cast_equals_unfused(kind, rows, f, dtype, fp8_dtype, columnwise, pow2,
                                              zero_tile, gen):
    gated = kind in kact.GATED
    x = torch.randn(rows, 2 * f if gated else f, generator=gen) * 3
    x[rows // 2] *= 100  # one token with a much larger range: its row scales differ
    if zero_tile:        # a whole 128x128 tile of zeros (act(0) = 0): amax 0 -> scale 1
        x[:128, :128] = 0
    x = x.to(dtype)
    eps = 0.0 if pow2 else 1e-3
    got = kabc.activation_fwd_blocks(x, kind, fp8_dtype, columnwise=columnwise,
                                     power_2_scale=pow2, amax_epsilon=eps)
    y = kact.activation_fwd(x, kind)
    rows_p = -(-rows // 16) * 16
    yp = torch.cat([y, y.new_zeros(rows_p - rows, f)])
    want = kbc.quantize_blocks(yp, fp8_dtype, rowwise=True, columnwise=columnwise,
                               power_2_scale=pow2, amax_epsilon=eps)
    _blocks_equal(got, want, "fused vs unfused kernels")
    _blocks_equal(got, rbc.quantize_blocks(yp, fp8_dtype, rowwise=True, columnwise=columnwise,
                                           power_2_scale=pow2, amax_epsilon=eps),
                  "cast half vs ref quantize_blocks")
    if zero_tile:
        assert bool((got.scale_inv[0, :128] == 1).all())
        assert bool((got.data[:128, :128].float() == 0).all())
    if kind in EXACT_KINDS:
        _blocks_equal(got, ract.activation_fwd_blocks(x, kind, fp8_dtype, columnwise=columnwise,
                                                      power_2_scale=pow2, amax_epsilon=eps),
                      "kernel vs twin")


def test_nan_and_inf_propagate_per_block(gen):
    x = torch.randn(20, 2 * 136, generator=gen).to(BF16)
    x[3, 5] = float("nan")
    x[7, 140] = float("inf")
    got = kabc.activation_fwd_blocks(x, "reglu", E4M3)
    want = ract.activation_fwd_blocks(x, "reglu", E4M3)
    for name, g, w in zip(rbc.BlockQuantized._fields, got, want):
        assert_same_bits(g, w, name, nan_as_nan=True)


# (kind, tokens, F, dtype, fp8 dtype, columnwise, write_hp): gated F 72 / 100 make 128-wide
# blocks of d(h) straddle the d_a | d_b halves
BWD_CASES = [("swiglu", 130, 72, BF16, E5M2, True, True),
             ("geglu", 17, 100, F32, E4M3, True, False),
             ("reglu", 257, 72, BF16, E5M2, True, True),
             ("gelu", 5, 136, F16, E5M2, False, True),
             ("srelu", 130, 24, F32, E4M3, True, False),
             ("glu", 1, 8, BF16, E5M2, True, True)]


@pytest.mark.parametrize("kind,rows,f,dtype,fp8_dtype,columnwise,write_hp", BWD_CASES, ids=str)
def test_activation_bwd_block_cast_equals_unfused(kind, rows, f, dtype, fp8_dtype, columnwise,
                                                  write_hp, gen):
    gated = kind in kact.GATED
    x = (torch.randn(rows, 2 * f if gated else f, generator=gen) * 2).to(dtype)
    dy = torch.randn(rows, f, generator=gen)
    dy[rows // 2] *= 1000
    dy = dy.to(dtype)
    hp, got = kabc.activation_bwd_blocks(dy, x, kind, fp8_dtype, columnwise=columnwise,
                                         write_hp=write_hp)
    dx = kact.activation_bwd(dy, x, kind)
    rows_p = -(-rows // 16) * 16
    dxp = torch.cat([dx, dx.new_zeros(rows_p - rows, dx.shape[1])])
    want = kbc.quantize_blocks(dxp, fp8_dtype, rowwise=True, columnwise=columnwise)
    assert_same_bits(hp, dx if write_hp else None, "hp")
    _blocks_equal(got, want, "fused vs unfused kernels")
    _blocks_equal(got, rbc.quantize_blocks(dxp, fp8_dtype, rowwise=True, columnwise=columnwise),
                  "cast half vs ref quantize_blocks")
    if kind in EXACT_KINDS:
        rhp, rbq = ract.activation_bwd_blocks(dy, x, kind, fp8_dtype, columnwise=columnwise,
                                              write_hp=write_hp)
        assert_same_bits(hp, rhp, "hp vs twin")
        _blocks_equal(got, rbq, "kernel vs twin")
