"""Triton activations fused with the FP8 casts around them in LayerNormMLP (fc1 -> act -> fc2).

Twins: `activation_fwd_fp8` / `activation_bwd_fp8` in `tritium.ref.activation` (the plain
activation, then `ref.cast.cast_transpose`). Delayed scaling only: the scale is read from device
memory before the cast; Float8CurrentScaling needs the amax first and keeps the unfused path.

Forward (`activation_fwd_fp8`): from fc1's output h [T, F] (plain) or [T, 2F] (gated) write fc2's
fp8 input: data [Tp, F], its transpose data_t [F, Tp] (fc2's wgrad), the amax of the values
into fc2's input amax slot, and scale_inv. The high-precision activation is never written.
Backward (`activation_bwd_fp8`): from d(act_out) [T, F] (fc2's dgrad, high precision) and h write
d(h) as fp8 data [Tp, W] and transpose [W, Tp] (W = 2F gated, F plain) with fc1's grad scale,
recording its amax; optionally d(h) in high precision too (fc1's bias gradient sums it).

Numerics, equal to the unfused kernels by construction: the values come from the plain kernels'
own helpers (`kernels.activation._fwd_values` / `_bwd_values`, elementwise, no reductions), are
rounded to h's dtype (what the unfused cast reads), then scaled, clamped and rounded to fp8
exactly as `kernels.cast` does (`_scaled_fp8`, `_abs_max_nan`; one atomic max per program).
Rows T..Tp-1 are zero in data and data_t (FP8 GEMMs need dims divisible by 16).

Layout: a 1D grid over [BLOCK_R, BLOCK_C] tiles (64 x 64 on the GPU) of (padded rows, F). Each
program computes its tile row-major for `data`; for `data_t` it stores the same fp8 bytes
transposed in registers (tl.trans of the tile bitcast to uint8; TRANS_T) where the input is 16-bit,
which an H100 measured at 146 against 179 us (bf16 swiglu fwd, T8192 F8192: 2.76 against 2.25
TB/s), bits equal. Where the input is fp32 it reads the same inputs again with transposed
indices (L1/L2 hits) and recomputes the values instead (Triton 3.6 miscompiled tl.trans of the
fp8 tile of fp32 inputs when both layouts are stored, see kernels/cast.py); recomputing a few
exps is free in a memory-bound kernel. Traffic: inputs read once from DRAM, 1 byte per element
written per layout.

Not done here: a fused bias-gradient (column sum) of d(h); block scaling (Float8BlockScaling's
1x128 casts fused with the activation are `kernels.act_block_cast`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher
from .activation import (_CODE, GATED, _bwd_values, _check, _check_bwd, _fwd_values,
                         _rows_view)
from .cast import _TL_FP8, _abs_max_nan, _bytes, _nan_max, _scaled_fp8, _trans_in_registers


@triton.jit
def _act_fp8_fwd_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
                        R, Rp, F, stride_x, n_col_blocks,
                        ACT: tl.constexpr, GATED: tl.constexpr, WRITE_DATA: tl.constexpr,
                        WRITE_T: tl.constexpr, TRANS_T: tl.constexpr, UPDATE_AMAX: tl.constexpr,
                        FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    pid_r = pid // n_col_blocks
    pid_c = pid - pid_r * n_col_blocks
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    scale = tl.load(scale_ptr)
    in_ty = x_ptr.dtype.element_ty
    if WRITE_DATA or TRANS_T:
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        y = _fwd_values(x_ptr, rows[:, None] * stride_x + cols[None, :], F, mask, ACT, GATED)
        y = tl.where(mask, y.to(in_ty).to(tl.float32), 0.0)
        y8 = _scaled_fp8(y, scale, mask, FP8_MAX, OUT_DTYPE)
        if WRITE_DATA:
            tl.store(data_ptr + rows[:, None] * F + cols[None, :], y8,
                     mask=(rows[:, None] < Rp) & (cols[None, :] < F))
        if TRANS_T:  # the tile's fp8 bytes transposed, stored as bytes
            tl.store(_bytes(data_t_ptr) + cols[:, None] * Rp + rows[None, :],
                     tl.trans(y8.to(tl.uint8, bitcast=True)),
                     mask=(cols[:, None] < F) & (rows[None, :] < Rp))
        if UPDATE_AMAX:
            tl.atomic_max(amax_ptr, _abs_max_nan(y))
    if WRITE_T and not TRANS_T:
        mask_t = (cols[:, None] < F) & (rows[None, :] < R)
        yt = _fwd_values(x_ptr, rows[None, :] * stride_x + cols[:, None], F, mask_t, ACT, GATED)
        yt = tl.where(mask_t, yt.to(in_ty).to(tl.float32), 0.0)
        tl.store(data_t_ptr + cols[:, None] * Rp + rows[None, :],
                 _scaled_fp8(yt, scale, mask_t, FP8_MAX, OUT_DTYPE),
                 mask=(cols[:, None] < F) & (rows[None, :] < Rp))
        if UPDATE_AMAX and not WRITE_DATA:
            tl.atomic_max(amax_ptr, _abs_max_nan(yt))
    if pid == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _act_fp8_bwd_kernel(dy_ptr, x_ptr, dx_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr,
                        scale_inv_ptr, R, Rp, F, stride_dy, stride_x, n_col_blocks,
                        ACT: tl.constexpr, GATED: tl.constexpr, WRITE_HP: tl.constexpr,
                        WRITE_DATA: tl.constexpr, WRITE_T: tl.constexpr, TRANS_T: tl.constexpr,
                        UPDATE_AMAX: tl.constexpr, FP8_MAX: tl.constexpr,
                        OUT_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    pid_r = pid // n_col_blocks
    pid_c = pid - pid_r * n_col_blocks
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    W = 2 * F if GATED else F
    scale = tl.load(scale_ptr)
    in_ty = x_ptr.dtype.element_ty
    if WRITE_DATA or WRITE_HP or not WRITE_T or TRANS_T:
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        da, db = _bwd_values(dy, x_ptr, rows[:, None] * stride_x + cols[None, :], F, mask,
                             ACT, GATED)
        offs = rows[:, None] * W + cols[None, :]
        out_mask = (rows[:, None] < Rp) & (cols[None, :] < F)
        # TRANS_T: each tile's fp8 bytes transposed, stored as bytes
        offs_t = cols[:, None] * Rp + rows[None, :]
        out_mask_t = (cols[:, None] < F) & (rows[None, :] < Rp)
        da = tl.where(mask, da.to(in_ty).to(tl.float32), 0.0)
        if WRITE_HP:
            tl.store(dx_ptr + offs, da.to(in_ty), mask=mask)
        if WRITE_DATA or TRANS_T:
            da8 = _scaled_fp8(da, scale, mask, FP8_MAX, OUT_DTYPE)
            if WRITE_DATA:
                tl.store(data_ptr + offs, da8, mask=out_mask)
            if TRANS_T:
                tl.store(_bytes(data_t_ptr) + offs_t, tl.trans(da8.to(tl.uint8, bitcast=True)),
                         mask=out_mask_t)
        m = _abs_max_nan(da)
        if GATED:
            db = tl.where(mask, db.to(in_ty).to(tl.float32), 0.0)
            if WRITE_HP:
                tl.store(dx_ptr + offs + F, db.to(in_ty), mask=mask)
            if WRITE_DATA or TRANS_T:
                db8 = _scaled_fp8(db, scale, mask, FP8_MAX, OUT_DTYPE)
                if WRITE_DATA:
                    tl.store(data_ptr + offs + F, db8, mask=out_mask)
                if TRANS_T:
                    tl.store(_bytes(data_t_ptr) + offs_t + F * Rp,
                             tl.trans(db8.to(tl.uint8, bitcast=True)), mask=out_mask_t)
            m = _nan_max(m, _abs_max_nan(db))
        if UPDATE_AMAX:
            tl.atomic_max(amax_ptr, m)
    if WRITE_T and not TRANS_T:
        mask_t = (cols[:, None] < F) & (rows[None, :] < R)
        dyt = tl.load(dy_ptr + rows[None, :] * stride_dy + cols[:, None], mask=mask_t,
                      other=0.0).to(tl.float32)
        dat, dbt = _bwd_values(dyt, x_ptr, rows[None, :] * stride_x + cols[:, None], F, mask_t,
                               ACT, GATED)
        dat = tl.where(mask_t, dat.to(in_ty).to(tl.float32), 0.0)
        offs_t = cols[:, None] * Rp + rows[None, :]
        out_mask_t = (cols[:, None] < F) & (rows[None, :] < Rp)
        tl.store(data_t_ptr + offs_t, _scaled_fp8(dat, scale, mask_t, FP8_MAX, OUT_DTYPE),
                 mask=out_mask_t)
        mt = _abs_max_nan(dat)
        if GATED:
            dbt = tl.where(mask_t, dbt.to(in_ty).to(tl.float32), 0.0)
            tl.store(data_t_ptr + offs_t + F * Rp,
                     _scaled_fp8(dbt, scale, mask_t, FP8_MAX, OUT_DTYPE), mask=out_mask_t)
            mt = _nan_max(mt, _abs_max_nan(dbt))
        if UPDATE_AMAX and not WRITE_DATA and not WRITE_HP:  # the row-major part did not run
            tl.atomic_max(amax_ptr, mt)
    if pid == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


_launch_fwd = Launcher(_act_fp8_fwd_kernel)
_launch_bwd = Launcher(_act_fp8_bwd_kernel)


def _grid(rows_p: int, f: int, interpret: bool):
    br, bc, warps = (8, 16, 1) if interpret else (64, 64, 8)
    ncb = max(-(-f // bc), 1)
    return (max(-(-rows_p // br), 1) * ncb,), ncb, br, bc, warps


def activation_fwd_fp8(x: torch.Tensor, kind: str, scale: torch.Tensor,
                       amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                       write_data: bool = True, write_transpose: bool = False,
                       pad_rows_to: int = 16):
    """See `tritium.ref.activation.activation_fwd_fp8`."""
    _check(x, kind)
    gated = kind in GATED
    rows, f = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    dev = x.device
    data = torch.empty(rows_p, f, dtype=fp8_dtype, device=dev) if write_data else None
    data_t = torch.empty(f, rows_p, dtype=fp8_dtype, device=dev) if write_transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    x = _rows_view(x)
    grid, ncb, br, bc, warps = _grid(rows_p, f, not x.is_cuda)
    trans_t = _trans_in_registers(x, write_transpose)
    _launch_fwd(grid, x, data if data is not None else scale_inv,
                data_t if data_t is not None else scale_inv, scale,
                amax if amax is not None else scale_inv, scale_inv,
                rows, rows_p, f, x.stride(0), ncb,
                ACT=_CODE[kind], GATED=gated, WRITE_DATA=write_data, WRITE_T=write_transpose,
                TRANS_T=trans_t, UPDATE_AMAX=amax is not None, FP8_MAX=fp8_max(fp8_dtype),
                OUT_DTYPE=_TL_FP8[fp8_dtype], BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return data, data_t, scale_inv


def activation_bwd_fp8(dy: torch.Tensor, x: torch.Tensor, kind: str, scale: torch.Tensor,
                       amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                       write_data: bool = True, write_transpose: bool = True,
                       write_hp: bool = False, pad_rows_to: int = 16):
    """See `tritium.ref.activation.activation_bwd_fp8`."""
    gated, rows, w, f = _check_bwd(dy, x, kind)
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    dev = x.device
    dx = torch.empty(rows, w, dtype=x.dtype, device=dev) if write_hp else None
    data = torch.empty(rows_p, w, dtype=fp8_dtype, device=dev) if write_data else None
    data_t = torch.empty(w, rows_p, dtype=fp8_dtype, device=dev) if write_transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    x, dy = _rows_view(x), _rows_view(dy)
    grid, ncb, br, bc, warps = _grid(rows_p, f, not x.is_cuda)
    trans_t = _trans_in_registers(x, write_transpose)
    _launch_bwd(grid, dy, x, dx if dx is not None else scale_inv,
                data if data is not None else scale_inv,
                data_t if data_t is not None else scale_inv, scale,
                amax if amax is not None else scale_inv, scale_inv,
                rows, rows_p, f, dy.stride(0), x.stride(0), ncb,
                ACT=_CODE[kind], GATED=gated, WRITE_HP=write_hp, WRITE_DATA=write_data,
                WRITE_T=write_transpose, TRANS_T=trans_t, UPDATE_AMAX=amax is not None,
                FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
                BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return dx, data, data_t, scale_inv


__all__ = ["activation_fwd_fp8", "activation_bwd_fp8"]
