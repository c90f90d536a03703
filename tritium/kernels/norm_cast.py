"""Triton LayerNorm / RMSNorm forward that writes the next GEMM's FP8 input directly.

Twins: `layernorm_fwd_fp8` / `rmsnorm_fwd_fp8` in `tritium.ref.norm` (the plain forward, then
`ref.cast.cast_transpose`). Delayed scaling only: the scale is read from device memory before
the cast (Float8CurrentScaling needs the amax first and keeps the unfused path).

One kernel per call: each program owns BLOCK_M rows (32 on the GPU when it writes the transpose,
else 4 forward tiles). It walks them in steps of
the plain forward's tile (`kernels.norm._norm_fwd_tile`, BLOCK_ROWS whole rows, same BLOCK_N and
num_warps as `kernels.norm._tile` picks), so the row reductions are the plain kernel's, bit for
bit: fused == norm kernel + cast kernel. Per step it rounds y to x.dtype (the unfused path casts
the rounded norm output), optionally stores that high-precision y (return_layernorm_output),
scales, clamps and rounds it to fp8 into `data` [Tp, H] (rows >= T are the zero padding FP8
GEMMs need), and folds max|y| (NaN wins) into a per-program amax; one atomic max per program
into the amax slot. Then, after a CTA barrier (bar.sync makes the program's global writes
visible to all its threads), it reads its [BLOCK_M, H] block of `data` back in [BLOCK_TN,
BLOCK_M] tiles (L1/L2 hits) and writes them transposed into `data_t` [H, Tp]: 32 rows give
32-byte runs per column, one full sector. Traffic: x read once; fp8 data and transpose written
once (plus y when asked). scale_inv = div_rn(1, scale), written by program 0.

The transpose comes from the fp8 bytes, not from tl.trans of a float tile (Triton 3.6
miscompiles tl.trans of fp32 tiles when both layouts are stored, see kernels/cast.py) and not
from re-normalizing (the row statistics would be needed again).

Not done here: hidden sizes above kernels.norm.MAX_HIDDEN (the functional layer uses the twin).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher
from .cast import _TL_FP8, _abs_max_nan, _scaled_fp8
from .norm import _norm_fwd_tile, _rows_contiguous, _tile

_BLOCK_M = 32     # rows per program on the GPU (>= the largest BLOCK_ROWS, 16)
_TILES_WITHOUT_T = 4   # forward tiles per program when no transpose is written
_BLOCK_TN = 128   # columns per transposed tile


@triton.jit
def _norm_fp8_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                         data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
                         rows, rows_p, N, n, stride_x, eps,
                         IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                         WRITE_HP: tl.constexpr, WRITE_T: tl.constexpr, UPDATE_AMAX: tl.constexpr,
                         FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_TN: tl.constexpr):
    pid = tl.program_id(0)
    scale = tl.load(scale_ptr)
    amax = tl.zeros([1], dtype=tl.float32)
    for i in range(BLOCK_M // BLOCK_ROWS):
        r = pid * BLOCK_M + i * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        y, mask, r64, c = _norm_fwd_tile(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, rows, N, n,
                                         stride_x, eps, IS_RMS, HAS_BIAS, ZERO_CENTERED, BLOCK_N)
        y = y.to(x_ptr.dtype.element_ty)  # what the unfused path's cast reads
        if WRITE_HP:
            tl.store(y_ptr + r64[:, None] * N + c[None, :], y, mask=mask)
        y = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(data_ptr + r64[:, None] * N + c[None, :],
                 _scaled_fp8(y, scale, mask, FP8_MAX, OUT_DTYPE),
                 mask=(r64[:, None] < rows_p) & (c[None, :] < N))
        if UPDATE_AMAX:
            m = _abs_max_nan(y)
            amax = tl.where((m > amax) | (m != m), m, amax)
    if UPDATE_AMAX:
        tl.atomic_max(amax_ptr + tl.arange(0, 1), amax)
    if WRITE_T:
        tl.debug_barrier()  # this program's data rows, visible to all its threads
        rm = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        for c0 in range(0, N, BLOCK_TN):
            cn = c0 + tl.arange(0, BLOCK_TN)
            tmask = (cn[:, None] < N) & (rm[None, :] < rows_p)
            t = tl.load(data_ptr + rm[None, :] * N + cn[:, None], mask=tmask)
            tl.store(data_t_ptr + cn[:, None] * rows_p + rm[None, :], t, mask=tmask)
    if pid == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


_launch = Launcher(_norm_fp8_fwd_kernel)


def _fwd_fp8(x, weight, bias, eps, zero_centered_gamma, is_rms, scale, amax, fp8_dtype,
             write_transpose, write_hp, pad_rows_to):
    x, weight = _rows_contiguous(x), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    rows, n = x.shape
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    dev = x.device
    # sizes as separate ints: a tuple argument parses slower (host time on every call)
    y = torch.empty(rows, n, dtype=x.dtype, device=dev) if write_hp else None
    data = torch.empty(rows_p, n, dtype=fp8_dtype, device=dev)
    data_t = torch.empty(n, rows_p, dtype=fp8_dtype, device=dev) if write_transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    mean = rstd if is_rms else torch.empty(rows, dtype=torch.float32, device=dev)
    interpret = not x.is_cuda
    block_rows, block_n, warps = _tile(n, interpret)
    # the transpose wants _BLOCK_M rows per program (full sectors); without it a few tiles
    # per program keep enough programs in flight (32 rows of 4096 made 128 programs for a
    # sequence-parallel rank's 4096 rows: under one per SM)
    block_m = (max(8 if interpret else _BLOCK_M, block_rows) if write_transpose
               else block_rows * _TILES_WITHOUT_T)
    block_tn = 16 if interpret else _BLOCK_TN
    grid = (max(-(-rows_p // block_m), 1),)
    _launch(grid, x, weight, bias if bias is not None else weight,
            y if y is not None else data, mean, rstd,
            data, data_t if data_t is not None else data, scale,
            amax if amax is not None else scale_inv, scale_inv,
            rows, rows_p, n, float(n), x.stride(0), float(eps),
            IS_RMS=is_rms, HAS_BIAS=bias is not None, ZERO_CENTERED=bool(zero_centered_gamma),
            WRITE_HP=write_hp, WRITE_T=write_transpose, UPDATE_AMAX=amax is not None,
            FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
            BLOCK_ROWS=block_rows, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_TN=block_tn,
            num_warps=warps)
    return y, data, data_t, scale_inv, mean, rstd


def layernorm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      eps: float, zero_centered_gamma: bool, scale: torch.Tensor,
                      amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                      write_transpose: bool = False, write_hp: bool = False,
                      pad_rows_to: int = 16):
    """See `tritium.ref.norm.layernorm_fwd_fp8`."""
    return _fwd_fp8(x, weight, bias, eps, zero_centered_gamma, False, scale, amax, fp8_dtype,
                    write_transpose, write_hp, pad_rows_to)


def rmsnorm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool,
                    scale: torch.Tensor, amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                    write_transpose: bool = False, write_hp: bool = False, pad_rows_to: int = 16):
    """See `tritium.ref.norm.rmsnorm_fwd_fp8`."""
    y, data, data_t, scale_inv, _, rstd = _fwd_fp8(x, weight, None, eps, zero_centered_gamma,
                                                   True, scale, amax, fp8_dtype, write_transpose,
                                                   write_hp, pad_rows_to)
    return y, data, data_t, scale_inv, rstd


__all__ = ["layernorm_fwd_fp8", "rmsnorm_fwd_fp8"]
