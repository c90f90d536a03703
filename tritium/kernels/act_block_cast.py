"""Triton activation fused with Float8BlockScaling's 1x128 casts of its output (fc2's input).

Twin: `tritium.ref.activation.activation_fwd_blocks` (the plain activation, rounded to x.dtype,
zero rows to a multiple of `pad_rows_to`, then `ref.block_cast.quantize_blocks`). The unfused
chain is `kernels.activation.activation_fwd`, the Linear's zero padding of the tokens to a
multiple of 16, then `kernels.block_cast.quantize_blocks(rowwise=True, columnwise=...)`; this
kernel writes the same BlockQuantized (layouts and scale rule in `ref.block_cast`) without the
high-precision [T, F] activation ever reaching memory (one T x F write + read saved).

Numerics, equal to the unfused chain by construction: the values come from the plain kernel's
`_fwd_values` (elementwise), are rounded to x.dtype (what the unfused cast reads) and go through
`kernels.block_cast`'s helpers (`_amax_rows_nan`, `_current_scale`, `_scaled_fp8`); rows
T..Tp-1 are zeros (amax 0 -> scale 1, data 0), as the padded copy is.

Layout: one program per 128x128 tile of (padded tokens Tp, F), walked in strips of SUB: rowwise
strips [SUB tokens, 128 features] (one scale per token and 128-feature slice -> data [Tp, F],
scale_inv [ceil(F/128), Tp]); columnwise strips [SUB features, 128 tokens] computed from the
input read with transposed indices (an L1/L2 hit; no tl.trans of an fp8 tile, see
kernels/cast.py), one scale per feature and 128-token slice -> data_t [F, Tp], scale_inv_t
[ceil(Tp/128), F]. The activation is evaluated twice per element when both forms are written:
a few exps, free in a memory-bound kernel.

Not done here: the backward (activation backward fused with the 1x128 casts of fc1's grad);
128x128 (2D) blocks (activations are 1x128 under Float8BlockScaling).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ..ref.block_cast import BLOCK, BlockQuantized
from ._launch import Launcher
from .activation import _CODE, GATED, _check, _fwd_values, _rows_view
from .block_cast import _amax_rows_nan
from .cast import _TL_FP8, _current_scale, _scaled_fp8


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
        scale = _current_scale(_amax_rows_nan(y), FP8_MAX, EPS, POW2)
        tl.store(data_ptr + rm[:, None] * F + rk_all[None, :],
                 _scaled_fp8(y, scale[:, None], valid, FP8_MAX, OUT_DTYPE),
                 mask=(rm[:, None] < Rp) & (rk_all[None, :] < F))
        tl.store(scale_inv_ptr + pid_k * Rp + rm, tl.math.div_rn(1.0, scale), mask=rm < Rp)
    if COLUMNWISE:
        for c in range(0, BLOCK, SUB):  # columnwise: 1x128 along the tokens (x^T)
            rk = (k0 + c + tl.arange(0, SUB)).to(tl.int64)
            valid_t = (rk[:, None] < F) & (rm_all[None, :] < R)
            yt = _fwd_values(x_ptr, rm_all[None, :] * stride_x + rk[:, None], F, valid_t,
                             ACT, GATED)
            yt = tl.where(valid_t, yt.to(in_ty).to(tl.float32), 0.0)
            scale_t = _current_scale(_amax_rows_nan(yt), FP8_MAX, EPS, POW2)
            tl.store(data_t_ptr + rk[:, None] * Rp + rm_all[None, :],
                     _scaled_fp8(yt, scale_t[:, None], valid_t, FP8_MAX, OUT_DTYPE),
                     mask=(rk[:, None] < F) & (rm_all[None, :] < Rp))
            tl.store(scale_inv_t_ptr + pid_m * F + rk, tl.math.div_rn(1.0, scale_t),
                     mask=rk < F)


_launch = Launcher(_act_block_cast_kernel)


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


__all__ = ["activation_fwd_blocks"]
