"""Block-scaled FP8 quantization (Float8BlockScaling) and MXFP8 quantization, in pure PyTorch.

Twin of `tritium.kernels.block_cast` (same names, signatures and bits) and the CPU path.

Float8BlockScaling (`quantize_blocks`): x [M, K] in high precision, K the GEMM's reduction dim.
  * 1D (1x128 tiles): rowwise data [M, K] with scale_inv [ceil(K/128), M] (one per row and
    128-column group, stored slice-major: row s holds the scales of K slice s for every row,
    TE's "GEMM-ready" layout, so a GEMM reads one contiguous vector per K step), and, when
    asked, columnwise data [K, M] (x^T) with scale_inv_t [ceil(M/128), K]: tiles of 128
    consecutive rows of x, made from x itself, not from the rowwise fp8 (the two are different
    numbers: TE does the same).
  * 2D (128x128 blocks, weights): data [M, K] and scale_inv [ceil(M/128), ceil(K/128)]; the
    transpose data_t [K, M] holds the same fp8 numbers and scale_inv_t is scale_inv^T.
  Per block: scale = fp8_max / max(amax, amax_epsilon), inf -> fp32 max, rounded down to a
  power of 2 under power_2_scale (the exponent bits kept), amax 0 / inf / NaN -> 1 (the same
  rule as Float8CurrentScaling's scale, per block); data = clamp(x * scale, +-fp8_max) rounded to
  nearest even; scale_inv = 1 / scale (IEEE division). Dims need not be multiples of 128: the
  last tile of a row (or block) is partial and its amax covers the elements that exist (TE asks
  for multiples of 128 for speed only; tritium accepts any size, padding nothing).

MXFP8 (`quantize_mx`, OCP Microscaling spec v1.0): blocks of 32 consecutive elements along the
last dim; shared scale X = 2^(floor(log2(amax)) - emax) with emax = 8 for E4M3 (448 = 1.75 *
2^8) and 15 for E5M2, the exponent clamped to E8M0's range [-127, 127]; an all-zero block gets
X = 2^-127; data = x / X saturated to +-fp8_max (values in (fp8_max, 2^(emax+1)) clamp) and
rounded to nearest even. Emulation only: there is no MXFP8 tensor core before Blackwell.
TE's MXFP8 kernels round the scale up instead (X = 2^ceil(log2(amax / fp8_max)), no saturation):
`quantize_mx(..., round_up=True)`; the recipe uses OCP's rule (docs/block_scaling.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..fp8.formats import fp8_max
from .cast import current_scale

BLOCK = 128
MX_BLOCK = 32
_MX_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


class BlockQuantized(NamedTuple):
    """A tensor's block-scaled fp8 forms; a field is None where it was not asked for."""

    data: Optional[torch.Tensor]         # [M, K]
    scale_inv: Optional[torch.Tensor]    # 1D: [Kb, M]; 2D: [Mb, Kb]
    data_t: Optional[torch.Tensor]       # [K, M]
    scale_inv_t: Optional[torch.Tensor]  # 1D: [Mb, K]; 2D: [Kb, Mb]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = x.shape
    if (m, k) == (rows, cols):
        return x.float()
    out = x.new_zeros(rows, cols, dtype=torch.float32)
    out[:m, :k] = x
    return out


def _amax_nan(blocks: torch.Tensor, dims) -> torch.Tensor:
    return blocks.abs().amax(dim=dims)  # torch's amax propagates NaN, as the kernel does


def _scaled(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    limit = fp8_max(fp8_dtype)
    y = x * scale
    y = torch.where(torch.isnan(y), y, y.clamp(-limit, limit))
    return y.to(fp8_dtype)


def _rowwise(x: torch.Tensor, fp8_dtype, power_2_scale, amax_epsilon):
    m, k = x.shape
    kb = _cdiv(k, BLOCK)
    xp = _padded(x, m, kb * BLOCK).view(m, kb, BLOCK)
    scale = current_scale(_amax_nan(xp, -1), fp8_dtype, amax_epsilon, power_2_scale)
    data = _scaled(xp, scale[:, :, None], fp8_dtype).view(m, kb * BLOCK)[:, :k].contiguous()
    return data, (torch.ones_like(scale) / scale).t().contiguous()


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, *, block_2d: bool = False,
                    rowwise: bool = True, columnwise: bool = False, power_2_scale: bool = True,
                    amax_epsilon: float = 0.0, skip: Optional[torch.Tensor] = None,
                    out: Optional[BlockQuantized] = None) -> BlockQuantized:
    """x [M, K] (any float dtype, last dim contiguous) -> BlockQuantized (see the module doc).

    out: a BlockQuantized of buffers to write into (the entries the call writes must be there);
    skip (needs out): an int32 [1] flag; non-zero: nothing is read or written and `out` (what an
    earlier call wrote) is returned (CUDA graphs with weight caching)."""
    if out is not None:
        if skip is None or not bool(skip.reshape(-1)[0] != 0):
            new = quantize_blocks(x, fp8_dtype, block_2d=block_2d, rowwise=rowwise,
                                  columnwise=columnwise, power_2_scale=power_2_scale,
                                  amax_epsilon=amax_epsilon)
            for dst, src in zip(out, new):
                if src is not None:
                    dst.copy_(src)
        return BlockQuantized(*(t if want else None for t, want in zip(
            out, (rowwise, rowwise, columnwise, columnwise))))
    if block_2d:
        m, k = x.shape
        mb, kb = _cdiv(m, BLOCK), _cdiv(k, BLOCK)
        xp = _padded(x, mb * BLOCK, kb * BLOCK).view(mb, BLOCK, kb, BLOCK)
        scale = current_scale(_amax_nan(xp, (1, 3)), fp8_dtype, amax_epsilon, power_2_scale)
        data = _scaled(xp, scale[:, None, :, None], fp8_dtype).view(mb * BLOCK, kb * BLOCK)
        data = data[:m, :k].contiguous()
        scale_inv = torch.ones_like(scale) / scale
        return BlockQuantized(data if rowwise else None, scale_inv if rowwise else None,
                              data.t().contiguous() if columnwise else None,
                              scale_inv.t().contiguous() if columnwise else None)
    data = scale_inv = data_t = scale_inv_t = None
    if rowwise:
        data, scale_inv = _rowwise(x, fp8_dtype, power_2_scale, amax_epsilon)
    if columnwise:
        data_t, scale_inv_t = _rowwise(x.t(), fp8_dtype, power_2_scale, amax_epsilon)
    return BlockQuantized(data, scale_inv, data_t, scale_inv_t)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor,
                      block_2d: bool = False) -> torch.Tensor:
    """fp32 values of block-quantized data [M, K] (exact: fp8 times a power of 2 or an fp32);
    scale_inv as `quantize_blocks` writes it ([Kb, M] for 1D, [Mb, Kb] for 2D)."""
    m, k = data.shape
    if block_2d:
        s = scale_inv.repeat_interleave(BLOCK, dim=0)[:m]
    else:
        s = scale_inv.t()
    return data.float() * s.repeat_interleave(BLOCK, dim=1)[:, :k]


def quantize_mx(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
                round_up: bool = False):
    """x [M, K] -> (data [M, K] fp8, scale [M, ceil(K/32)] fp32 powers of 2, the E8M0 X).

    round_up=False: OCP MX v1.0's X = 2^(floor(log2 amax) - emax) (the block's largest values
    may saturate at fp8_max). round_up=True: TE's rule, X = 2^ceil(log2(amax / fp8_max)) (the
    fp32 quotient's exponent, plus one where its mantissa is not zero): nothing saturates."""
    if fp8_dtype not in _MX_EMAX:
        raise ValueError(f"quantize_mx: fp8_dtype must be float8_e4m3fn or float8_e5m2, got "
                         f"{fp8_dtype}")
    m, k = x.shape
    kb = _cdiv(k, MX_BLOCK)
    xp = _padded(x, m, kb * MX_BLOCK).view(m, kb, MX_BLOCK)
    amax = xp.abs().amax(-1)
    if round_up:
        frac, exp = torch.frexp(amax / fp8_max(fp8_dtype))  # = frac * 2^exp, frac in [0.5, 1)
        shared = torch.where(frac == 0.5, exp - 1, exp)      # an exact power of 2 stays
    else:
        _, exp = torch.frexp(amax)        # amax = f * 2^exp, f in [0.5, 1): floor(log2) = exp - 1
        shared = exp - 1 - _MX_EMAX[fp8_dtype]
    shared = shared.clamp(-127, 127)
    shared = torch.where(amax == 0, torch.full_like(shared, -127), shared)
    # x / X as x * 2^-shared: exact (2^-shared is a normal fp32 for shared in [-127, 127])
    inv = torch.ldexp(torch.ones_like(amax), -shared)
    data = _scaled(xp, inv[:, :, None], fp8_dtype).view(m, kb * MX_BLOCK)[:, :k].contiguous()
    return data, torch.ldexp(torch.ones_like(amax), shared)


def e8m0_bits(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte of power-of-2 scales: the biased exponent log2(X) + 127, as uint8."""
    _, exp = torch.frexp(scale)
    return (exp - 1 + 127).to(torch.uint8)


__all__ = ["BLOCK", "MX_BLOCK", "BlockQuantized", "quantize_blocks", "dequantize_blocks",
           "quantize_mx", "e8m0_bits"]
