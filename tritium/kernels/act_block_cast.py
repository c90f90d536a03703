"""Triton activation (forward and backward) fused with Float8BlockScaling's 1x128 casts.

Forward (`activation_fwd_blocks`, fc2's input). Twin: `tritium.ref.activation`'s function of
the same name (the plain activation, rounded to x.dtype, zero rows to a multiple of
`pad_rows_to`, then `ref.block_cast.quantize_blocks`). The unfused chain is
`kernels.activation.activation_fwd`, the Linear's zero padding of the tokens to a multiple of
16, then `kernels.block_cast.quantize_blocks(rowwise=True, columnwise=...)`; this kernel writes
the same BlockQuantized (layouts and scale rule in `ref.block_cast`) without the
high-precision [T, F] activation ever reaching memory (one T x F write + read saved).

Numerics, equal to the unfused chain by construction: the values come from the plain kernel's
`_fwd_values` (elementwise), are rounded to x.dtype (what the unfused cast reads) and go through
`kernels.block_cast`'s `_store_1x128` (amax, scale and cast of a 1x128 strip); rows
T..Tp-1 are zeros (amax 0 -> scale 1, data 0), as the padded copy is.

Layout: one program per 128x128 tile of (padded tokens Tp, F), walked in strips of SUB: rowwise
strips [SUB tokens, 128 features] (one scale per token and 128-feature slice -> data [Tp, F],
scale_inv [ceil(F/128), Tp]); columnwise strips [SUB features, 128 tokens] computed from the
input read with transposed indices (an L1/L2 hit; no tl.trans of an fp8 tile, see
kernels/cast.py), one scale per feature and 128-token slice -> data_t [F, Tp], scale_inv_t
[ceil(Tp/128), F]. The activation is evaluated twice per element when both forms are written:
a few exps, free in a memory-bound kernel.

Backward (`activation_bwd_blocks`): from d(act_out) [T, F] and h, d(h) [T, W] (W = 2F gated,
F plain; `kernels.activation._bwd_values`, rounded to x.dtype) as fc1's grad_output blocks:
rowwise 1x128 along W (data [Tp, W], scale_inv [ceil(W/128), Tp]) and columnwise 1x128 along
the tokens (data_t [W, Tp], scale_inv_t [ceil(Tp/128), W]), with the recipe's grad QParams;
optionally d(h) in high precision (fc1's bias gradient sums it). Output column c of a gated
kind is d_a[:, c] for c < F and d_b[:, c - F] after, so a 128-wide block may straddle the two
halves (F not a multiple of 128) and still holds exactly the unfused d(h)'s columns.

Not done here: 128x128 (2D) blocks (activations and gradients are 1x128 under
Float8BlockScaling).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ..ref.block_cast import BLOCK, BlockQuantized
from ._launch import Launcher
from .activation import (_CODE, GATED, _bwd_values, _check, _check_bwd, _fwd_values,
                         _rows_view)
from .block_cast import _store_1x128
from .cast import _TL_FP8


@triton.jit
def _act_block_cast_kernel(x_ptr, data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr,
                           R, Rp, F, stride_x,
                           ACT: tl.constexpr, GATED: tl.constexpr, COLUMNWISE: tl.constexpr,
                           FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, EPS: tl.constexpr,
                           POW2: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m * BLOCK, pid_k * BLOCK
    rm_all = (m0 + tl.arange(0, BLOCK)).to(tl.int64)
    rk_all = (k0 + tl.arange(0, BLOCK)).to(tl.int64)
    in_ty = x_ptr.dtype.element_ty
    for r in range(0, BLOCK, SUB):  # rowwise: 1x128 along the features
        rm = (m0 + r + tl.arange(0, SUB)).to(tl.int64)
        valid = (rm[:, None] < R) & (rk_all[None, :] < F)
        y = _fwd_values(x_ptr, rm[:, None] * stride_x + rk_all[None, :], F, valid, ACT, GATED)
        y = tl.where(valid, y.to(in_ty).to(tl.float32), 0.0)
        _store_1x128(y, valid, rm, rk_all, Rp, F, data_ptr, scale_inv_ptr + pid_k * Rp,
                     FP8_MAX, OUT_DTYPE, EPS, POW2)
    if COLUMNWISE:
        for c in range(0, BLOCK, SUB):  # columnwise: 1x128 along the tokens (x^T)
            rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
            valid_t = (rk[:, None] < F) & (rm_all[None, :] < R)
            yt = _fwd_values(x_ptr, rm_all[None, :] * stride_x + rk[:, None], F, valid_t,
                             ACT, GATED)
            yt = tl.where(valid_t, yt.to(in_ty).to(tl.float32), 0.0)
            _store_1x128(yt, valid_t, rk, rm_all, F, Rp, data_t_ptr,
                         scale_inv_t_ptr + pid_m * F, FP8_MAX, OUT_DTYPE, EPS, POW2)


@triton.jit
def _dh_values(dy_ptr, x_ptr, r2, c2, R, F, W, stride_dy, stride_x, ACT: tl.constexpr,
               GATED: tl.constexpr):
    """d(h)[r2, c2] (c2 in [0, W): gated, d_a for c2 < F and d_b after), rounded to x.dtype
    as the unfused backward writes it, fp32; 0 outside [R, W]."""
    valid = (r2 < R) & (c2 < W)
    if GATED:
        f = tl.where(c2 >= F, c2 - F, c2)
    else:
        f = c2
    dy = tl.load(dy_ptr + r2 * stride_dy + f, mask=valid, other=0.0).to(tl.float32)
    da, db = _bwd_values(dy, x_ptr, r2 * stride_x + f, F, valid, ACT, GATED)
    if GATED:
        da = tl.where(c2 >= F, db, da)
    return tl.where(valid, da.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0), valid


@triton.jit
def _act_bwd_block_cast_kernel(dy_ptr, x_ptr, hp_ptr, data_ptr, scale_inv_ptr, data_t_ptr,
                               scale_inv_t_ptr, R, Rp, F, W, stride_dy, stride_x,
                               ACT: tl.constexpr, GATED: tl.constexpr, WRITE_HP: tl.constexpr,
                               COLUMNWISE: tl.constexpr, FP8_MAX: tl.constexpr,
                               OUT_DTYPE: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                               BLOCK: tl.constexpr, SUB: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m * BLOCK, pid_k * BLOCK
    rm_all = (m0 + tl.arange(0, BLOCK)).to(tl.int64)
    rk_all = (k0 + tl.arange(0, BLOCK)).to(tl.int64)
    for r in range(0, BLOCK, SUB):  # rowwise: 1x128 along W (fc1's dgrad)
        rm = (m0 + r + tl.arange(0, SUB)).to(tl.int64)
        v, valid = _dh_values(dy_ptr, x_ptr, rm[:, None], rk_all[None, :], R, F, W, stride_dy,
                              stride_x, ACT, GATED)
        if WRITE_HP:
            tl.store(hp_ptr + rm[:, None] * W + rk_all[None, :],
                     v.to(hp_ptr.dtype.element_ty), mask=valid)
        _store_1x128(v, valid, rm, rk_all, Rp, W, data_ptr, scale_inv_ptr + pid_k * Rp,
                     FP8_MAX, OUT_DTYPE, EPS, POW2)
    if COLUMNWISE:
        for c in range(0, BLOCK, SUB):  # columnwise: 1x128 along the tokens (fc1's wgrad)
            rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
            vt, valid_t = _dh_values(dy_ptr, x_ptr, rm_all[None, :], rk[:, None], R, F, W,
                                     stride_dy, stride_x, ACT, GATED)
            _store_1x128(vt, valid_t, rk, rm_all, W, Rp, data_t_ptr,
                         scale_inv_t_ptr + pid_m * W, FP8_MAX, OUT_DTYPE, EPS, POW2)


_launch = Launcher(_act_block_cast_kernel)
_launch_bwd = Launcher(_act_bwd_block_cast_kernel)


def activation_fwd_blocks(x: torch.Tensor, kind: str, fp8_dtype: torch.dtype, *,
                          columnwise: bool = True, power_2_scale: bool = True,
                          amax_epsilon: float = 0.0, pad_rows_to: int = 16) -> BlockQuantized:
    """See `tritium.ref.activation.activation_fwd_blocks`."""
    _check(x, kind)
    gated = kind in GATED
    rows, f = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    mb, kb = -(-rows_p // BLOCK), -(-f // BLOCK)
    dev = x.device
    data = torch.empty(rows_p, f, dtype=fp8_dtype, device=dev)
    scale_inv = torch.empty(kb, rows_p, dtype=torch.float32, device=dev)
    data_t = torch.empty(f, rows_p, dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv_t = (torch.empty(mb, f, dtype=torch.float32, device=dev) if columnwise
                   else None)
    if rows_p and f:
        x = _rows_view(x)
        _launch((mb, kb), x, data, scale_inv, data_t if columnwise else data,
                scale_inv_t if columnwise else scale_inv, rows, rows_p, f, x.stride(0),
                ACT=_CODE[kind], GATED=gated, COLUMNWISE=columnwise,
                FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
                EPS=float(amax_epsilon), POW2=bool(power_2_scale), BLOCK=BLOCK, SUB=32,
                num_warps=4)
    return BlockQuantized(data, scale_inv, data_t, scale_inv_t)


def activation_bwd_blocks(dy: torch.Tensor, x: torch.Tensor, kind: str, fp8_dtype: torch.dtype,
                          *, columnwise: bool = True, write_hp: bool = False,
                          power_2_scale: bool = True, amax_epsilon: float = 0.0,
                          pad_rows_to: int = 16):
    """See `tritium.ref.activation.activation_bwd_blocks`."""
    gated, rows, w, f = _check_bwd(dy, x, kind)
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    mb, kb = -(-rows_p // BLOCK), -(-w // BLOCK)
    dev = x.device
    hp = torch.empty(rows, w, dtype=x.dtype, device=dev) if write_hp else None
    data = torch.empty(rows_p, w, dtype=fp8_dtype, device=dev)
    scale_inv = torch.empty(kb, rows_p, dtype=torch.float32, device=dev)
    data_t = torch.empty(w, rows_p, dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv_t = (torch.empty(mb, w, dtype=torch.float32, device=dev) if columnwise
                   else None)
    if rows_p and w:
        x, dy = _rows_view(x), _rows_view(dy)
        _launch_bwd((mb, kb), dy, x, hp if write_hp else data, data, scale_inv,
                    data_t if columnwise else data, scale_inv_t if columnwise else scale_inv,
                    rows, rows_p, f, w, dy.stride(0), x.stride(0),
                    ACT=_CODE[kind], GATED=gated, WRITE_HP=write_hp, COLUMNWISE=columnwise,
                    FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
                    EPS=float(amax_epsilon), POW2=bool(power_2_scale), BLOCK=BLOCK, SUB=32,
                    num_warps=4)
    return hp, BlockQuantized(data, scale_inv, data_t, scale_inv_t)


__all__ = ["activation_fwd_blocks", "activation_bwd_blocks"]
