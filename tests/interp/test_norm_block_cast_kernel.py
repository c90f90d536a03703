"""`kernels.norm_block_cast` (LayerNorm / RMSNorm + Float8BlockScaling 1x128 casts) under the
Triton interpreter, bit for bit.

Exact, checked as integer bits (y, mean, rstd, data, scale_inv, data_t, scale_inv_t):
  * fused kernel == the unfused kernel chain it replaces (`kernels.norm` forward, zero rows to a
    multiple of 16, `kernels.block_cast.quantize_blocks` rowwise + columnwise): what
    LayerNormLinear / LayerNormMLP rely on (fused == unfused);
  * the cast half == the twin's `ref.block_cast.quantize_blocks` of the same normalized values,
    and the whole call == the twin (`ref.norm.*_fwd_blocks`) given the kernel's y (the norms
    themselves agree with the twin to fp32 ulps only, test_norm_kernels.py).
Shapes cross the 128 edges in tokens (130, 257 -> padded 144, 272) and hidden (136, 200, 264),
plus tiny ones; zero rows (amax 0 -> scale 1, y = beta); both norms, zero_centered_gamma, bias.
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import block_cast as kbc
from tritium.kernels import norm as knorm
from tritium.kernels import norm_block_cast as knbc
from tritium.ref import block_cast as rbc

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (norm, tokens, H, dtype, fp8 dtype, columnwise, write_hp, power_2_scale, zero_centered, bias)
CASES = [("LayerNorm", 130, 200, BF16, E4M3, True, True, True, False, True),
         ("RMSNorm", 257, 136, BF16, E4M3, True, False, True, True, False),
         ("LayerNorm", 17, 264, F32, E4M3, True, False, False, True, False),
         ("RMSNorm", 5, 24, F16, E5M2, True, True, True, False, False),
         ("LayerNorm", 1, 8, F32, E4M3, False, False, True, False, True),
         ("RMSNorm", 130, 96, F32, E4M3, True, False, False, False, False)]


def _blocks_equal(got, want, what):
    for name, g, w in zip(rbc.BlockQuantized._fields, got, want):
        assert_same_bits(g, w, f"{what}: {name}")


@pytest.mark.parametrize("norm,rows,h,dtype,fp8_dtype,columnwise,write_hp,pow2,zc,has_bias",
                         CASES, ids=str)
def test_norm_block_cast_equals_unfused(norm, rows, h, dtype, fp8_dtype, columnwise, write_hp,
                                        pow2, zc, has_bias, gen):
    x = torch.randn(rows, h, generator=gen) * 3 + 0.5
    x[rows // 2] *= 100                  # one token with a much larger range
    x[rows // 3] = 0                     # a zero row: y = beta (or 0), rstd = 1/sqrt(eps)
    x = x.to(dtype)
    w = (torch.randn(h, generator=gen) * 0.5 + (0.0 if zc else 1.0)).to(dtype)
    w[: h // 3] *= 20                    # some columns with a larger range
    b = (torch.randn(h, generator=gen) * 0.1).to(dtype) if has_bias else None
    eps, amax_eps = 1e-5, (0.0 if pow2 else 1e-3)
    kw = dict(columnwise=columnwise, write_hp=write_hp, power_2_scale=pow2,
              amax_epsilon=amax_eps)
    if norm == "LayerNorm":
        y_hp, got, mean, rstd = knbc.layernorm_fwd_blocks(x, w, b, eps, zc, fp8_dtype, **kw)
        y, want_mean, want_rstd = knorm.layernorm_fwd(x, w, b, eps, zc)
        assert_same_bits(mean, want_mean, "mean")
    else:
        y_hp, got, rstd = knbc.rmsnorm_fwd_blocks(x, w, eps, zc, fp8_dtype, **kw)
        y, want_rstd = knorm.rmsnorm_fwd(x, w, eps, zc)
    assert_same_bits(rstd, want_rstd, "rstd")
    assert_same_bits(y_hp, y if write_hp else None, "high-precision y")
    rows_p = -(-rows // 16) * 16
    yp = torch.cat([y, y.new_zeros(rows_p - rows, h)])
    qkw = dict(rowwise=True, columnwise=columnwise, power_2_scale=pow2, amax_epsilon=amax_eps)
    _blocks_equal(got, kbc.quantize_blocks(yp, fp8_dtype, **qkw), "fused vs unfused kernels")
    _blocks_equal(got, rbc.quantize_blocks(yp, fp8_dtype, **qkw), "cast half vs ref")
    assert bool((got.data[rows:].float() == 0).all())
    if amax_eps == 0:  # padding rows: amax 0 -> scale 1
        assert bool((got.scale_inv[:, rows:] == 1).all())
