"""Pure-PyTorch twins of `tritium.kernels.norm`: LayerNorm and RMSNorm forward and backward.

Same names and signatures as the Triton launchers; the CPU path and the test oracle. The two
agree to a few fp32 ulps, not bit for bit: the row sums and the column sums of dgamma are
reductions whose order differs (torch's vectorized sums vs Triton's tree reductions and
per-program partial sums), so 16-bit results may differ by one unit in the last place.

Contract (both implementations):
  * x, dy: 2D [rows, hidden], last dim contiguous; bf16, fp16 or fp32. weight, bias: [hidden],
    any of those dtypes, need not match x.
  * All math in fp32; y and dx are rounded once, at the end, to x.dtype.
  * gamma = weight, or (1 + weight) with zero_centered_gamma (computed in fp32).
  * LayerNorm: mean = sum(x)/H, var = sum((x - mean)^2)/H (biased, as torch.nn.LayerNorm),
    rstd = 1/sqrt(var + eps), y = ((x - mean) * rstd) * gamma + beta.
  * RMSNorm: rstd = 1/sqrt(sum(x^2)/H + eps), y = (x * rstd) * gamma.
  * mean and rstd are saved fp32 [rows] (forward outputs, backward inputs: nothing is recomputed).
  * Backward, with xhat = (x - mean) * rstd (RMSNorm: x * rstd) and g = dy * gamma:
      LayerNorm dx = rstd * (g - (xhat * mean(g * xhat) + mean(g)))
      RMSNorm   dx = rstd * (g - xhat * mean(g * xhat))
      dweight = sum over rows of dy * xhat, dbias = sum over rows of dy (fp32 sums), returned in
      the weight's dtype (zero_centered_gamma does not change them: d(1 + w)/dw = 1).

Norm + FP8 cast (`layernorm_fwd_fp8`, `rmsnorm_fwd_fp8`, twins of `tritium.kernels.norm_cast`):
the forward above, its output y rounded to x.dtype, then `tritium.ref.cast.cast_transpose` of
that rounded y with the following GEMM's delayed-scaling `scale` (amax of the rounded y
max-accumulated into `amax` unless it is None; scale_inv = 1/scale exactly; rows zero-padded to
a multiple of 16). So the fused path is, by construction, the unfused norm followed by the
unfused cast. Returns (y or None, data [Tp, H], data_t [H, Tp] or None, scale_inv, mean, rstd).

Norm + Float8BlockScaling casts (`layernorm_fwd_blocks`, `rmsnorm_fwd_blocks`, twins of
`tritium.kernels.norm_block_cast`): the forward above, y rounded to x.dtype, rows zero-padded to
a multiple of 16, then `tritium.ref.block_cast.quantize_blocks(rowwise=True, columnwise=...)`.
Returns (y or None, BlockQuantized, mean, rstd) (RMSNorm: no mean).
"""
from __future__ import annotations

from typing import Optional

import torch

from .block_cast import quantize_blocks
from .cast import cast_transpose


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    w = weight.float()
    return w + 1.0 if zero_centered_gamma else w


def layernorm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  eps: float, zero_centered_gamma: bool):
    """-> (y [rows, hidden] in x.dtype, mean fp32 [rows], rstd fp32 [rows])."""
    xf = x.float()
    mean = xf.mean(dim=1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = (xc * rstd[:, None]) * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                  rstd: torch.Tensor, zero_centered_gamma: bool, need_bias_grad: bool = True):
    """-> (dx in x.dtype, dweight in weight.dtype, dbias in weight.dtype or None)."""
    dyf = dy.float()
    r = rstd[:, None]
    xhat = (x.float() - mean[:, None]) * r
    g = dyf * _gamma(weight, zero_centered_gamma)
    c1 = (xhat * g).mean(dim=1, keepdim=True)
    c2 = g.mean(dim=1, keepdim=True)
    dx = (g - (xhat * c1 + c2)) * r
    dweight = (dyf * xhat).sum(dim=0).to(weight.dtype)
    dbias = dyf.sum(dim=0).to(weight.dtype) if need_bias_grad else None
    return dx.to(x.dtype), dweight, dbias


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
    """-> (y [rows, hidden] in x.dtype, rstd fp32 [rows])."""
    xf = x.float()
    rstd = torch.rsqrt((xf * xf).mean(dim=1) + eps)
    y = (xf * rstd[:, None]) * _gamma(weight, zero_centered_gamma)
    return y.to(x.dtype), rstd


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                zero_centered_gamma: bool):
    """-> (dx in x.dtype, dweight in weight.dtype)."""
    dyf = dy.float()
    r = rstd[:, None]
    xhat = x.float() * r
    g = dyf * _gamma(weight, zero_centered_gamma)
    dx = (g - xhat * (xhat * g).mean(dim=1, keepdim=True)) * r
    return dx.to(x.dtype), (dyf * xhat).sum(dim=0).to(weight.dtype)


def _cast(y, scale, amax, fp8_dtype, write_transpose, write_hp, pad_rows_to):
    data, data_t, scale_inv = cast_transpose(y, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                             write_transpose=write_transpose)
    return (y if write_hp else None), data, data_t, scale_inv


def layernorm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      eps: float, zero_centered_gamma: bool, scale: torch.Tensor,
                      amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                      write_transpose: bool = False, write_hp: bool = False,
                      pad_rows_to: int = 16):
    """LayerNorm whose output is written as fp8 for the next GEMM (see the module docstring).
    -> (y or None, data [Tp, H], data_t [H, Tp] or None, scale_inv [1], mean, rstd)."""
    y, mean, rstd = layernorm_fwd(x, weight, bias, eps, zero_centered_gamma)
    return (*_cast(y, scale, amax, fp8_dtype, write_transpose, write_hp, pad_rows_to),
            mean, rstd)


def rmsnorm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool,
                    scale: torch.Tensor, amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                    write_transpose: bool = False, write_hp: bool = False, pad_rows_to: int = 16):
    """RMSNorm with an fp8 output. -> (y or None, data, data_t or None, scale_inv, rstd)."""
    y, rstd = rmsnorm_fwd(x, weight, eps, zero_centered_gamma)
    return (*_cast(y, scale, amax, fp8_dtype, write_transpose, write_hp, pad_rows_to), rstd)


def _blocks(y, fp8_dtype, columnwise, write_hp, power_2_scale, amax_epsilon, pad_rows_to):
    rows, n = y.shape
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    yp = torch.cat([y, y.new_zeros(rows_p - rows, n)]) if rows_p != rows else y
    bq = quantize_blocks(yp, fp8_dtype, rowwise=True, columnwise=columnwise,
                         power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    return (y if write_hp else None), bq


def layernorm_fwd_blocks(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float, zero_centered_gamma: bool, fp8_dtype: torch.dtype, *,
                         columnwise: bool = True, write_hp: bool = False,
                         power_2_scale: bool = True, amax_epsilon: float = 0.0,
                         pad_rows_to: int = 16):
    """LayerNorm whose output is written as Float8BlockScaling's 1x128 blocks (rows zero-padded
    to Tp) -> (y or None, BlockQuantized: data [Tp, H], scale_inv [ceil(H/128), Tp] and
    (columnwise) data_t [H, Tp], scale_inv_t [ceil(Tp/128), H], mean, rstd)."""
    y, mean, rstd = layernorm_fwd(x, weight, bias, eps, zero_centered_gamma)
    return (*_blocks(y, fp8_dtype, columnwise, write_hp, power_2_scale, amax_epsilon,
                     pad_rows_to), mean, rstd)


def rmsnorm_fwd_blocks(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered_gamma: bool, fp8_dtype: torch.dtype, *,
                       columnwise: bool = True, write_hp: bool = False,
                       power_2_scale: bool = True, amax_epsilon: float = 0.0,
                       pad_rows_to: int = 16):
    """RMSNorm with a 1x128 block fp8 output -> (y or None, BlockQuantized, rstd)."""
    y, rstd = rmsnorm_fwd(x, weight, eps, zero_centered_gamma)
    return (*_blocks(y, fp8_dtype, columnwise, write_hp, power_2_scale, amax_epsilon,
                     pad_rows_to), rstd)


__all__ = ["layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
           "layernorm_fwd_fp8", "rmsnorm_fwd_fp8", "layernorm_fwd_blocks",
           "rmsnorm_fwd_blocks"]
