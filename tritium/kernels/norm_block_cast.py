"""Triton LayerNorm / RMSNorm forward fused with Float8BlockScaling's 1x128 input casts.

Twins: `layernorm_fwd_blocks` / `rmsnorm_fwd_blocks` in `tritium.ref.norm` (the plain forward,
zero rows to a multiple of `pad_rows_to`, then `ref.block_cast.quantize_blocks(rowwise=True,
columnwise=...)`). The unfused chain is `kernels.norm` then the block Linear's zero padding and
`kernels.block_cast.quantize_blocks`; this kernel writes the same BlockQuantized (layouts and
scale rule in `ref.block_cast`): data [Tp, H], scale_inv [ceil(H/128), Tp] (1x128 along the
hidden dim, fprop) and data_t [H, Tp], scale_inv_t [ceil(Tp/128), H] (1x128 along the tokens,
wgrad), plus mean/rstd as the plain kernel writes them and, when asked, y [T, H] (x.dtype).

Layout: one program per 128 (padded) tokens, two passes over its rows.
  1. Rows: the plain forward's tile (`kernels.norm._norm_fwd_tile`, BLOCK_ROWS whole rows, the
     BLOCK_N and num_warps `kernels.norm._tile` picks), so mean, rstd and y are the plain
     kernel's reductions, bit for bit. y is rounded to x.dtype (what the unfused cast reads),
     optionally stored, and cast rowwise: the [BLOCK_ROWS, BLOCK_N] tile is viewed as
     [BLOCK_ROWS, BLOCK_N / 128, 128] for the per-block amax (BLOCK_N <= 128: one block a row).
  2. Columns (COLUMNWISE): after a CTA barrier (this program's mean/rstd stores visible to all
     its threads) the program walks the hidden dim in strips of SUB columns x 128 tokens, read
     with transposed indices, and recomputes y elementwise from x, mean, rstd, gamma (, beta)
     with the tile's expression ((x - mean) * rstd) * gamma + beta, then the columnwise cast.
Why this split and not a separate statistics pass or column-chunked statistics: the row sums must
be the plain kernel's (whole-row tiles) for fused == unfused, and a columnwise block needs all
128 tokens of a column; recomputing y in pass 2 costs a second read of x (about 2 bytes an
element, partly L2 hits) instead of writing and reading back y (4 bytes). Traffic per element:
x read twice, 1 + 1 fp8 bytes written (unfused: x read, y written, y read, 2 fp8 bytes).
Rows T..Tp-1 are zeros (amax 0 -> scale 1, data 0), as the padded copy is.

Numerics: on the CPU/interpreter tier the recomputed y of pass 2 is the pass-1 value exactly
(the same fp32 ops in the same order); on the GPU it relies on the compiler contracting the
same expression the same way (checked by tests/gpu/test_gpu_norm_block_cast.py).

Limits: one program per 128 tokens, so few programs for short inputs (T / 128); hidden sizes
above kernels.norm.MAX_HIDDEN use the twin (functional layer). Not done here: 128x128 blocks
(activations are 1x128 under Float8BlockScaling).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ..ref.block_cast import BLOCK, BlockQuantized
from ._launch import Launcher
from .block_cast import _amax_rows_nan
from .cast import _TL_FP8, _current_scale, _scaled_fp8
from .norm import _norm_fwd_tile, _rows_contiguous, _tile


@triton.jit
def _norm_block_cast_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                            data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr,
                            rows, rows_p, N, n, stride_x, eps,
                            IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ZERO_CENTERED: tl.constexpr, WRITE_HP: tl.constexpr,
                            COLUMNWISE: tl.constexpr, FP8_MAX: tl.constexpr,
                            OUT_DTYPE: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0)
    m0 = pid * BLOCK
    in_ty = x_ptr.dtype.element_ty
    for i in range(BLOCK // BLOCK_ROWS):  # pass 1: statistics, y, rowwise blocks
        r = m0 + i * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        y, mask, r64, c = _norm_fwd_tile(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, rows, N, n,
                                         stride_x, eps, IS_RMS, HAS_BIAS, ZERO_CENTERED, BLOCK_N)
        y = y.to(in_ty)
        if WRITE_HP:
            tl.store(y_ptr + r64[:, None] * N + c[None, :], y, mask=mask)
        y = tl.where(mask, y.to(tl.float32), 0.0)
        if BLOCK_N <= BLOCK:  # one 1x128 block per row
            scale = _current_scale(_amax_rows_nan(y), FP8_MAX, EPS, POW2)
            q = _scaled_fp8(y, scale[:, None], mask, FP8_MAX, OUT_DTYPE)
            tl.store(scale_inv_ptr + r64, tl.math.div_rn(1.0, scale), mask=r64 < rows_p)
        else:
            NB: tl.constexpr = BLOCK_N // BLOCK
            y3 = tl.reshape(y, [BLOCK_ROWS * NB, BLOCK])
            scale = _current_scale(_amax_rows_nan(y3), FP8_MAX, EPS, POW2)
            scale2 = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK_ROWS * NB, BLOCK]),
                                [BLOCK_ROWS, BLOCK_N])
            q = _scaled_fp8(y, scale2, mask, FP8_MAX, OUT_DTYPE)
            s2 = tl.reshape(scale, [BLOCK_ROWS, NB])
            kb = tl.arange(0, NB)
            tl.store(scale_inv_ptr + kb[None, :] * rows_p + r64[:, None],
                     tl.math.div_rn(1.0, s2),
                     mask=(r64[:, None] < rows_p) & (kb[None, :] * BLOCK < N))
        tl.store(data_ptr + r64[:, None] * N + c[None, :], q,
                 mask=(r64[:, None] < rows_p) & (c[None, :] < N))
    if COLUMNWISE:  # pass 2: columnwise blocks, y recomputed from x and the row statistics
        tl.debug_barrier()  # this program's mean/rstd, visible to all its threads
        rm = (m0 + tl.arange(0, BLOCK)).to(tl.int64)
        rmask = rm < rows
        rstd = tl.load(rstd_ptr + rm, mask=rmask, other=0.0)
        if not IS_RMS:
            mean = tl.load(mean_ptr + rm, mask=rmask, other=0.0)
        for c0 in range(0, N, SUB):
            ck = c0 + tl.arange(0, SUB)
            cmask = ck < N
            valid = cmask[:, None] & rmask[None, :]
            x = tl.load(x_ptr + rm[None, :] * stride_x + ck[:, None], mask=valid,
                        other=0.0).to(tl.float32)
            if IS_RMS:
                xc = x
            else:
                xc = tl.where(valid, x - mean[None, :], 0.0)
            gamma = tl.load(w_ptr + ck, mask=cmask, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                gamma = gamma + 1.0
            yt = (xc * rstd[None, :]) * gamma[:, None]
            if HAS_BIAS:
                yt = yt + tl.load(b_ptr + ck, mask=cmask, other=0.0).to(tl.float32)[:, None]
            yt = tl.where(valid, yt.to(in_ty).to(tl.float32), 0.0)
            scale_t = _current_scale(_amax_rows_nan(yt), FP8_MAX, EPS, POW2)
            tl.store(data_t_ptr + ck[:, None] * rows_p + rm[None, :],
                     _scaled_fp8(yt, scale_t[:, None], valid, FP8_MAX, OUT_DTYPE),
                     mask=cmask[:, None] & (rm[None, :] < rows_p))
            tl.store(scale_inv_t_ptr + pid * N + ck, tl.math.div_rn(1.0, scale_t), mask=cmask)


_launch = Launcher(_norm_block_cast_kernel)


def _fwd_blocks(x, weight, bias, eps, zero_centered_gamma, is_rms, fp8_dtype, columnwise,
                write_hp, power_2_scale, amax_epsilon, pad_rows_to):
    x, weight = _rows_contiguous(x), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    rows, n = x.shape
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    mb, kb = -(-rows_p // BLOCK), -(-n // BLOCK)
    dev = x.device
    y = torch.empty((rows, n), dtype=x.dtype, device=dev) if write_hp else None
    data = torch.empty(rows_p, n, dtype=fp8_dtype, device=dev)
    scale_inv = torch.empty(kb, rows_p, dtype=torch.float32, device=dev)
    data_t = torch.empty(n, rows_p, dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv_t = torch.empty(mb, n, dtype=torch.float32, device=dev) if columnwise else None
    mean = torch.empty(rows if not is_rms else 0, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows_p and n:
        block_rows, block_n, warps = _tile(n, not x.is_cuda)
        _launch((mb,), x, weight, bias if bias is not None else weight,
                y if y is not None else data, rstd if is_rms else mean, rstd,
                data, scale_inv, data_t if columnwise else data,
                scale_inv_t if columnwise else scale_inv,
                rows, rows_p, n, float(n), x.stride(0), float(eps),
                IS_RMS=is_rms, HAS_BIAS=bias is not None,
                ZERO_CENTERED=bool(zero_centered_gamma), WRITE_HP=write_hp,
                COLUMNWISE=columnwise, FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
                EPS=float(amax_epsilon), POW2=bool(power_2_scale),
                BLOCK_ROWS=block_rows, BLOCK_N=block_n, BLOCK=BLOCK, SUB=32, num_warps=warps)
    return y, BlockQuantized(data, scale_inv, data_t, scale_inv_t), mean, rstd


def layernorm_fwd_blocks(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float, zero_centered_gamma: bool, fp8_dtype: torch.dtype, *,
                         columnwise: bool = True, write_hp: bool = False,
                         power_2_scale: bool = True, amax_epsilon: float = 0.0,
                         pad_rows_to: int = 16):
    """See `tritium.ref.norm.layernorm_fwd_blocks`."""
    return _fwd_blocks(x, weight, bias, eps, zero_centered_gamma, False, fp8_dtype, columnwise,
                       write_hp, power_2_scale, amax_epsilon, pad_rows_to)


def rmsnorm_fwd_blocks(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered_gamma: bool, fp8_dtype: torch.dtype, *,
                       columnwise: bool = True, write_hp: bool = False,
                       power_2_scale: bool = True, amax_epsilon: float = 0.0,
                       pad_rows_to: int = 16):
    """See `tritium.ref.norm.rmsnorm_fwd_blocks`."""
    y, bq, _, rstd = _fwd_blocks(x, weight, None, eps, zero_centered_gamma, True, fp8_dtype,
                                 columnwise, write_hp, power_2_scale, amax_epsilon, pad_rows_to)
    return y, bq, rstd


__all__ = ["layernorm_fwd_blocks", "rmsnorm_fwd_blocks"]
