"""Triton LayerNorm / RMSNorm forward fused with Float8BlockScaling's 1x128 input casts.

Twins: `layernorm_fwd_blocks` / `rmsnorm_fwd_blocks` in `tritium.ref.norm` (the plain forward,
zero rows to a multiple of `pad_rows_to`, then `ref.block_cast.quantize_blocks(rowwise=True,
columnwise=...)`). The unfused chain is `kernels.norm` then the block Linear's zero padding and
`kernels.block_cast.quantize_blocks`; this kernel writes the same BlockQuantized (layouts and
scale rule in `ref.block_cast`): data [Tp, H], scale_inv [ceil(H/128), Tp] (1x128 along the
hidden dim, fprop) and data_t [H, Tp], scale_inv_t [ceil(Tp/128), H] (1x128 along the tokens,
wgrad), plus mean/rstd as the plain kernel writes them and, when asked, y [T, H] (x.dtype).

Layout: two launches.
  1. `_norm_stats_kernel`: mean and rstd, from the plain forward's tile
     (`kernels.norm._norm_fwd_tile`, BLOCK_ROWS whole rows, the BLOCK_N and num_warps that
     `kernels.norm._tile` picks; its y is left unused), so the row reductions are the plain
     kernel's, bit for bit. They are also what the norm's backward reads.
  2. `_norm_block_cast_kernel`: one program per 128x128 tile of (padded tokens Tp, H), as
     `kernels.act_block_cast`: y recomputed elementwise from x, mean, rstd, gamma (, beta) with
     the tile's expression ((x - mean) * rstd) * gamma + beta, rounded to x.dtype (what the
     unfused cast reads), walked in strips of SUB: rowwise strips [SUB tokens, 128 columns]
     (also the high-precision y when asked), then columnwise strips [SUB columns, 128 tokens]
     read with transposed indices (L1/L2 hits), through `kernels.block_cast`'s helpers.
Why a separate statistics pass and not one program owning 128 whole rows (two passes inside):
the columnwise blocks need 128 tokens per column, so a row-owning program gets T/128 programs
(64 for 8192 tokens, fewer than the SMs) each walking 128 rows in sequence; the split gives
T/128 x H/128 tile programs, like the unfused cast. The row sums must be the plain kernel's
(whole-row tiles) for fused == unfused, which rules out column-chunked statistics. Traffic per
element: x read twice (statistics, tile), 1 + 1 fp8 bytes written, 8 bytes of mean/rstd per
row (unfused: x read, y written and read back, the same fp8 bytes). Rows T..Tp-1 are zeros
(amax 0 -> scale 1, data 0), as the padded copy is.

Numerics: on the CPU/interpreter tier the recomputed y is the plain kernel's exactly (the same
fp32 ops in the same order); on the GPU it relies on the compiler contracting the same
expression the same way (checked by tests/gpu/test_gpu_norm_block_cast.py).

Limits: hidden sizes above kernels.norm.MAX_HIDDEN use the twin (functional layer). Not done
here: 128x128 blocks (activations are 1x128 under Float8BlockScaling).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ..ref.block_cast import BLOCK, BlockQuantized
from ._launch import Launcher
from .block_cast import _store_1x128
from .cast import _TL_FP8
from .norm import _norm_fwd_tile, _rows_contiguous, _tile


@triton.jit
def _norm_stats_kernel(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, N, n, stride_x, eps,
                       IS_RMS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1: mean and rstd of BLOCK_ROWS whole rows, the plain forward's tile (y unused)."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    _norm_fwd_tile(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, rows, N, n, stride_x, eps,
                   IS_RMS, False, False, BLOCK_N)


@triton.jit
def _y_values(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r2, c2, R, N, stride_x,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """y[r2, c2] from x and the row statistics with `_norm_fwd_tile`'s expression, rounded to
    x.dtype as the unfused cast reads it, fp32; 0 outside [R, N]."""
    rmask, cmask = r2 < R, c2 < N
    valid = rmask & cmask
    x = tl.load(x_ptr + r2 * stride_x + c2, mask=valid, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + r2, mask=rmask, other=0.0)
    if IS_RMS:
        xc = x
    else:
        xc = tl.where(valid, x - tl.load(mean_ptr + r2, mask=rmask, other=0.0), 0.0)
    gamma = tl.load(w_ptr + c2, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    y = (xc * rstd) * gamma
    if HAS_BIAS:
        y = y + tl.load(b_ptr + c2, mask=cmask, other=0.0).to(tl.float32)
    return tl.where(valid, y.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0), valid


@triton.jit
def _norm_block_cast_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                            data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr,
                            R, Rp, N, stride_x,
                            IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ZERO_CENTERED: tl.constexpr, WRITE_HP: tl.constexpr,
                            COLUMNWISE: tl.constexpr, FP8_MAX: tl.constexpr,
                            OUT_DTYPE: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                            BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Pass 2: one 128x128 tile of y, written as rowwise and columnwise 1x128 blocks."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m * BLOCK, pid_k * BLOCK
    rm_all = (m0 + tl.arange(0, BLOCK)).to(tl.int64)
    rk_all = (k0 + tl.arange(0, BLOCK)).to(tl.int64)
    for r in range(0, BLOCK, SUB):  # rowwise: 1x128 along the hidden dim
        rm = (m0 + r + tl.arange(0, SUB)).to(tl.int64)
        y, valid = _y_values(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rm[:, None],
                             rk_all[None, :], R, N, stride_x, IS_RMS, HAS_BIAS, ZERO_CENTERED)
        if WRITE_HP:
            tl.store(y_ptr + rm[:, None] * N + rk_all[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=valid)
        _store_1x128(y, valid, rm, rk_all, Rp, N, data_ptr, scale_inv_ptr + pid_k * Rp,
                     FP8_MAX, OUT_DTYPE, EPS, POW2)
    if COLUMNWISE:
        for c in range(0, BLOCK, SUB):  # columnwise: 1x128 along the tokens (y^T)
            rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
            yt, valid_t = _y_values(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rm_all[None, :],
                                    rk[:, None], R, N, stride_x, IS_RMS, HAS_BIAS,
                                    ZERO_CENTERED)
            _store_1x128(yt, valid_t, rk, rm_all, N, Rp, data_t_ptr,
                         scale_inv_t_ptr + pid_m * N, FP8_MAX, OUT_DTYPE, EPS, POW2)


_launch_stats = Launcher(_norm_stats_kernel)
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
    if rows and n:
        block_rows, block_n, warps = _tile(n, not x.is_cuda)
        _launch_stats((-(-rows // block_rows),), x, weight, weight, rstd if is_rms else mean,
                      rstd, rows, n, float(n), x.stride(0), float(eps), IS_RMS=is_rms,
                      BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=warps)
    if rows_p and n:
        _launch((mb, kb), x, weight, bias if bias is not None else weight,
                y if y is not None else data, rstd if is_rms else mean, rstd,
                data, scale_inv, data_t if columnwise else data,
                scale_inv_t if columnwise else scale_inv, rows, rows_p, n, x.stride(0),
                IS_RMS=is_rms, HAS_BIAS=bias is not None,
                ZERO_CENTERED=bool(zero_centered_gamma), WRITE_HP=write_hp,
                COLUMNWISE=columnwise, FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
                EPS=float(amax_epsilon), POW2=bool(power_2_scale), BLOCK=BLOCK, SUB=32,
                num_warps=4)
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
