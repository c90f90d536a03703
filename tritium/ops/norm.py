"""Custom ops behind `tritium.functional.norm`, and the namespace with `tritium.ref.norm`'s names.

Ops (tritium::...): layernorm_fwd, layernorm_bwd, rmsnorm_fwd, rmsnorm_bwd (write nothing in
place) and the fused norm + FP8 cast layernorm_fwd_fp8, rmsnorm_fwd_fp8 (max-accumulate the
cast's amax into `amax` when given). Kernel or twin as the eager site picks: the Triton kernels
for rows of at most MAX_HIDDEN on a device `_device.use_triton` accepts, the twins otherwise.
Outputs not written (LayerNorm's dbias without need_bias_grad, y without write_hp, data_t
without write_transpose) are 0-element placeholders in the graph and None for the caller.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _device
from ..ref import norm as ref_norm
from ._common import filled, fresh, or_none, tritium_op

MAX_HIDDEN = 65536  # == tritium.kernels.norm.MAX_HIDDEN (not imported: it would import triton)


def _impl(t: Tensor):
    if t.shape[-1] <= MAX_HIDDEN and _device.use_triton(t):
        from ..kernels import norm as kernel_norm
        return kernel_norm
    return ref_norm


def _impl_fp8(t: Tensor):
    if t.shape[-1] <= MAX_HIDDEN and _device.use_triton(t):
        from ..kernels import norm_cast as kernel_norm_cast
        return kernel_norm_cast
    return ref_norm


def _stats(x):
    return x.new_empty((x.shape[0],), dtype=torch.float32)


# ------------------------------------------------------------------------------ LayerNorm
@tritium_op("tritium::layernorm_fwd", mutates_args=())
def _ln_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
            zero_centered_gamma: bool) -> tuple[Tensor, Tensor, Tensor]:
    return fresh(_impl(x).layernorm_fwd(x, weight, bias, eps, zero_centered_gamma),
                 (x, weight, bias))


@_ln_fwd.register_fake
def _(x, weight, bias, eps, zero_centered_gamma):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _stats(x), _stats(x)


@tritium_op("tritium::layernorm_bwd", mutates_args=())
def _ln_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor,
            zero_centered_gamma: bool, need_bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _impl(dy).layernorm_bwd(dy, x, weight, mean, rstd, zero_centered_gamma,
                                         need_bias_grad=need_bias_grad)
    return fresh((dx, dw, filled(db, x, weight.dtype)),
                 (dy, x, weight, mean, rstd))


@_ln_bwd.register_fake
def _(dy, x, weight, mean, rstd, zero_centered_gamma, need_bias_grad):
    n = x.shape[1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            weight.new_empty((n,)), weight.new_empty((n,) if need_bias_grad else (0,)))


def layernorm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                  zero_centered_gamma: bool):
    return torch.ops.tritium.layernorm_fwd(x, weight, bias, eps, zero_centered_gamma)


def layernorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor,
                  zero_centered_gamma: bool, need_bias_grad: bool = True):
    dx, dw, db = torch.ops.tritium.layernorm_bwd(dy, x, weight, mean, rstd, zero_centered_gamma,
                                                 need_bias_grad)
    return dx, dw, or_none(db, need_bias_grad)


# ------------------------------------------------------------------------------ RMSNorm
@tritium_op("tritium::rmsnorm_fwd", mutates_args=())
def _rms_fwd(x: Tensor, weight: Tensor, eps: float,
             zero_centered_gamma: bool) -> tuple[Tensor, Tensor]:
    return fresh(_impl(x).rmsnorm_fwd(x, weight, eps, zero_centered_gamma), (x, weight))


@_rms_fwd.register_fake
def _(x, weight, eps, zero_centered_gamma):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _stats(x)


@tritium_op("tritium::rmsnorm_bwd", mutates_args=())
def _rms_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
             zero_centered_gamma: bool) -> tuple[Tensor, Tensor]:
    return fresh(_impl(dy).rmsnorm_bwd(dy, x, weight, rstd, zero_centered_gamma),
                 (dy, x, weight, rstd))


@_rms_bwd.register_fake
def _(dy, x, weight, rstd, zero_centered_gamma):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            weight.new_empty((x.shape[1],)))


def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool):
    return torch.ops.tritium.rmsnorm_fwd(x, weight, eps, zero_centered_gamma)


def rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, zero_centered_gamma: bool):
    return torch.ops.tritium.rmsnorm_bwd(dy, x, weight, rstd, zero_centered_gamma)


# ------------------------------------------------------------------------------ norm + FP8 cast
def _fp8_outs(x, y, data, data_t, fp8_dtype):
    return filled(y, x, x.dtype), data, filled(data_t, x, fp8_dtype)


def _fake_fp8(x, fp8_dtype, write_transpose, write_hp, pad_rows_to):
    rows, n = x.shape
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    return (x.new_empty((rows, n) if write_hp else (0,)),
            x.new_empty((rows_p, n), dtype=fp8_dtype),
            x.new_empty((n, rows_p) if write_transpose else (0,), dtype=fp8_dtype),
            x.new_empty((1,), dtype=torch.float32))


@tritium_op("tritium::layernorm_fwd_fp8", mutates_args=("amax",))
def _ln_fwd_fp8(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                zero_centered_gamma: bool, scale: Tensor, amax: Optional[Tensor],
                fp8_dtype: torch.dtype, write_transpose: bool, write_hp: bool,
                pad_rows_to: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, data, data_t, scale_inv, mean, rstd = _impl_fp8(x).layernorm_fwd_fp8(
        x, weight, bias, eps, zero_centered_gamma, scale, amax, fp8_dtype,
        write_transpose=write_transpose, write_hp=write_hp, pad_rows_to=pad_rows_to)
    return fresh((*_fp8_outs(x, y, data, data_t, fp8_dtype), scale_inv, mean, rstd),
                 (x, weight, bias, scale, amax))


@_ln_fwd_fp8.register_fake
def _(x, weight, bias, eps, zero_centered_gamma, scale, amax, fp8_dtype, write_transpose,
      write_hp, pad_rows_to):
    return (*_fake_fp8(x, fp8_dtype, write_transpose, write_hp, pad_rows_to), _stats(x),
            _stats(x))


@tritium_op("tritium::rmsnorm_fwd_fp8", mutates_args=("amax",))
def _rms_fwd_fp8(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool,
                 scale: Tensor, amax: Optional[Tensor], fp8_dtype: torch.dtype,
                 write_transpose: bool, write_hp: bool,
                 pad_rows_to: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, data, data_t, scale_inv, rstd = _impl_fp8(x).rmsnorm_fwd_fp8(
        x, weight, eps, zero_centered_gamma, scale, amax, fp8_dtype,
        write_transpose=write_transpose, write_hp=write_hp, pad_rows_to=pad_rows_to)
    return fresh((*_fp8_outs(x, y, data, data_t, fp8_dtype), scale_inv, rstd),
                 (x, weight, scale, amax))


@_rms_fwd_fp8.register_fake
def _(x, weight, eps, zero_centered_gamma, scale, amax, fp8_dtype, write_transpose, write_hp,
      pad_rows_to):
    return (*_fake_fp8(x, fp8_dtype, write_transpose, write_hp, pad_rows_to), _stats(x))


def layernorm_fwd_fp8(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                      zero_centered_gamma: bool, scale: Tensor, amax: Optional[Tensor],
                      fp8_dtype: torch.dtype, *, write_transpose: bool = False,
                      write_hp: bool = False, pad_rows_to: int = 16):
    y, data, data_t, scale_inv, mean, rstd = torch.ops.tritium.layernorm_fwd_fp8(
        x, weight, bias, eps, zero_centered_gamma, scale, amax, fp8_dtype, write_transpose,
        write_hp, pad_rows_to)
    return or_none(y, write_hp), data, or_none(data_t, write_transpose), scale_inv, mean, rstd


def rmsnorm_fwd_fp8(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool,
                    scale: Tensor, amax: Optional[Tensor], fp8_dtype: torch.dtype, *,
                    write_transpose: bool = False, write_hp: bool = False, pad_rows_to: int = 16):
    y, data, data_t, scale_inv, rstd = torch.ops.tritium.rmsnorm_fwd_fp8(
        x, weight, eps, zero_centered_gamma, scale, amax, fp8_dtype, write_transpose, write_hp,
        pad_rows_to)
    return or_none(y, write_hp), data, or_none(data_t, write_transpose), scale_inv, rstd


__all__ = ["layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
           "layernorm_fwd_fp8", "rmsnorm_fwd_fp8"]
