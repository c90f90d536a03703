"""Triton block-scaled FP8 quantization (Float8BlockScaling): 1x128 tiles or 128x128 blocks.

Twin: `tritium.ref.block_cast.quantize_blocks` (same signature, same bits; the layouts and the
scale rule are described there). One program owns one 128x128 tile of x [M, K] and writes
everything that tile decides, from the high-precision values (walked in strips of 32 rows or
columns to keep registers low; a 128x128 block reads its strips twice, amax then cast, the
second time from L1/L2):
  * 1D rowwise: 128 row scales (amax of each row's 128 columns) -> data, scale_inv[k-block, :];
  * 1D columnwise: 128 column scales (amax of each column's 128 rows) -> data_t [K, M] and
    scale_inv_t[m-block, :]; the tile is read a second time, transposed (an L1/L2 hit), so the
    transposed store is coalesced (no tl.trans of an fp8 tile: see kernels/cast.py);
  * 2D: one scale for the tile -> data, data_t (the same fp8 numbers) and one scale_inv.
Edges are masked: a partial tile's amax covers only the elements that exist. The scale is the
current-scaling rule of `kernels.cast._current_scale` (div_rn, power-of-2 mask), per block.

`skip` / `out` (CUDA graphs with weight caching): as `kernels.cast.cast_transpose`'s: with a
non-zero int32 device flag every program returns before reading or writing, so `out` keeps what
an earlier launch wrote.

Fused into the activation (forward and backward) of LayerNormMLP: `kernels.act_block_cast`,
and into the norm of LayerNormLinear / LayerNormMLP: `kernels.norm_block_cast`; both reuse the
helpers here. Not done here: MXFP8 (emulated in `ref.block_cast.quantize_mx`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ..ref.block_cast import BLOCK, BlockQuantized
from ._launch import Launcher
from .cast import _TL_FP8, _current_scale, _scaled_fp8


@triton.jit
def _amax_rows_nan(x):
    """max|x| of each row of a [R, C] tile, NaN where the row holds a NaN."""
    m = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, float("nan"), m)


@triton.jit
def _load(x_ptr, rows, cols, M, K, stride_xm, TRANSPOSED: tl.constexpr):
    """x[rows, cols] as fp32 (TRANSPOSED: x[cols, rows]^T, i.e. rows index K), 0 outside."""
    if TRANSPOSED:
        mask = (rows[:, None] < K) & (cols[None, :] < M)
        x = tl.load(x_ptr + cols[None, :] * stride_xm + rows[:, None], mask=mask, other=0.0)
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _store_1x128(v, valid, rows, cols, n_rows, n_cols, data_ptr, scale_inv_ptr,
                 FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, EPS: tl.constexpr,
                 POW2: tl.constexpr):
    """A strip v [rows, cols] of values (`valid` where they exist), each row one 1x128 block:
    its fp8 data at data[rows, cols] of a row-major [n_rows, n_cols] tensor and its scale_inv at
    scale_inv_ptr + rows. Stores cover every position inside the tensor, so padding rows and
    columns get zeros (the fused norm / activation casts, whose outputs are padded)."""
    scale = _current_scale(_amax_rows_nan(v), FP8_MAX, EPS, POW2)
    tl.store(data_ptr + rows[:, None] * n_cols + cols[None, :],
             _scaled_fp8(v, scale[:, None], valid, FP8_MAX, OUT_DTYPE),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
    tl.store(scale_inv_ptr + rows, tl.math.div_rn(1.0, scale), mask=rows < n_rows)


@triton.jit
def _block_cast_kernel(x_ptr, data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr, skip_ptr,
                       M, K, stride_xm, KB, MB,
                       FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, EPS: tl.constexpr,
                       POW2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                       BLOCK_2D: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr,
                       SUB: tl.constexpr):
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:  # a cached weight on a non-first micro-batch: a no-op
            return
    # The 128x128 tile is walked in [SUB, 128] strips (fewer live registers than the whole
    # tile): a 1x128 tile's reduction runs along a strip's 128, so each strip is final; a
    # 128x128 block needs its amax first (one pass over the strips), then a second pass.
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m * BLOCK, pid_k * BLOCK
    rm_all = (m0 + tl.arange(0, BLOCK)).to(tl.int64)
    rk_all = (k0 + tl.arange(0, BLOCK)).to(tl.int64)
    if BLOCK_2D:
        a = tl.zeros((), tl.float32)
        for r in range(0, BLOCK, SUB):
            x, _ = _load(x_ptr, (m0 + r + tl.arange(0, SUB)).to(tl.int64), rk_all, M, K,
                         stride_xm, False)
            tile_max = tl.max(tl.abs(x))
            tile_max = tl.where(tl.max((x != x).to(tl.int32)) > 0, float("nan"), tile_max)
            a = tl.where((a != a) | (tile_max != tile_max), float("nan"), tl.maximum(a, tile_max))
        scale = _current_scale(a, FP8_MAX, EPS, POW2)
        if ROWWISE:
            for r in range(0, BLOCK, SUB):
                rm = (m0 + r + tl.arange(0, SUB)).to(tl.int64)
                x, mask = _load(x_ptr, rm, rk_all, M, K, stride_xm, False)
                tl.store(data_ptr + rm[:, None] * K + rk_all[None, :],
                         _scaled_fp8(x, scale, mask, FP8_MAX, OUT_DTYPE), mask=mask)
            tl.store(scale_inv_ptr + pid_m * KB + pid_k, tl.math.div_rn(1.0, scale))
        if COLUMNWISE:
            for c in range(0, BLOCK, SUB):
                rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
                xt, mask_t = _load(x_ptr, rk, rm_all, M, K, stride_xm, True)
                tl.store(data_t_ptr + rk[:, None] * M + rm_all[None, :],
                         _scaled_fp8(xt, scale, mask_t, FP8_MAX, OUT_DTYPE), mask=mask_t)
            tl.store(scale_inv_t_ptr + pid_k * MB + pid_m, tl.math.div_rn(1.0, scale))
    else:
        if ROWWISE:
            for r in range(0, BLOCK, SUB):
                rm = (m0 + r + tl.arange(0, SUB)).to(tl.int64)
                x, mask = _load(x_ptr, rm, rk_all, M, K, stride_xm, False)
                scale = _current_scale(_amax_rows_nan(x), FP8_MAX, EPS, POW2)
                tl.store(data_ptr + rm[:, None] * K + rk_all[None, :],
                         _scaled_fp8(x, scale[:, None], mask, FP8_MAX, OUT_DTYPE), mask=mask)
                tl.store(scale_inv_ptr + pid_k * M + rm, tl.math.div_rn(1.0, scale),
                         mask=rm < M)
        if COLUMNWISE:
            for c in range(0, BLOCK, SUB):
                rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
                xt, mask_t = _load(x_ptr, rk, rm_all, M, K, stride_xm, True)
                scale_t = _current_scale(_amax_rows_nan(xt), FP8_MAX, EPS, POW2)
                tl.store(data_t_ptr + rk[:, None] * M + rm_all[None, :],
                         _scaled_fp8(xt, scale_t[:, None], mask_t, FP8_MAX, OUT_DTYPE),
                         mask=mask_t)
                tl.store(scale_inv_t_ptr + pid_m * K + rk, tl.math.div_rn(1.0, scale_t),
                         mask=rk < K)


_launch = Launcher(_block_cast_kernel)
# (SUB rows or columns of a strip, num_warps) for 1x128 tiles and for 128x128 blocks, the best
# of `bench_block_scaling.py`'s sweep on an H100 (2026-11-27: 1x128 row+col of 8192x4096 0.089
# ms, 1.51 TB/s moved; 128x128 of 14336x4096 0.093 ms, 2.52 TB/s; (32, 4) took 0.098 / 0.153)
# Reading 1x128's columnwise strips as they lie and transposing them in registers measured no
# faster (same H100, 2026-11-27: 0.090 ms at (64, 4) either way) and was dropped.
CONFIG = {False: (64, 4), True: (128, 8)}


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, *, block_2d: bool = False,
                    rowwise: bool = True, columnwise: bool = False, power_2_scale: bool = True,
                    amax_epsilon: float = 0.0, skip=None, out=None,
                    config=None) -> BlockQuantized:
    """See `tritium.ref.block_cast.quantize_blocks`. `config`: (SUB, num_warps),
    benchmarks."""
    sub, warps = config or CONFIG[block_2d]
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    mb, kb = -(-m // BLOCK), -(-k // BLOCK)
    if out is not None:
        data, scale_inv, data_t, scale_inv_t = (t if want else None for t, want in zip(
            out, (rowwise, rowwise, columnwise, columnwise)))
    else:
        dev = x.device
        data = torch.empty(m, k, dtype=fp8_dtype, device=dev) if rowwise else None
        data_t = torch.empty(k, m, dtype=fp8_dtype, device=dev) if columnwise else None
        s_shape, st_shape = ((mb, kb), (kb, mb)) if block_2d else ((kb, m), (mb, k))
        scale_inv = torch.empty(s_shape, dtype=torch.float32, device=dev) if rowwise else None
        scale_inv_t = (torch.empty(st_shape, dtype=torch.float32, device=dev) if columnwise
                       else None)
    if m and k and (rowwise or columnwise):
        dummy = data if rowwise else data_t
        dummy_s = scale_inv if rowwise else scale_inv_t
        _launch((mb, kb), x, data if rowwise else dummy, scale_inv if rowwise else dummy_s,
                data_t if columnwise else dummy, scale_inv_t if columnwise else dummy_s,
                skip if skip is not None else dummy_s,
                m, k, x.stride(0), kb, mb, FP8_MAX=fp8_max(fp8_dtype),
                OUT_DTYPE=_TL_FP8[fp8_dtype], EPS=float(amax_epsilon), POW2=bool(power_2_scale),
                ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_2D=block_2d,
                HAS_SKIP=skip is not None, BLOCK=BLOCK, SUB=sub, num_warps=warps)
    return BlockQuantized(data, scale_inv, data_t, scale_inv_t)


__all__ = ["quantize_blocks", "CONFIG"]
