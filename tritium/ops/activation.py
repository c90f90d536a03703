"""Custom ops behind `tritium.functional.activation`, and the namespace with
`tritium.ref.activation`'s names.

Ops (tritium::...): activation_fwd, activation_bwd (write nothing in place) and the fused
activation + FP8 cast activation_fwd_fp8, activation_bwd_fp8 (max-accumulate the cast's amax
into `amax` when given). Outputs not written (data / data_t / the high-precision dx, by the
write_* flags) are 0-element placeholders in the graph and None for the caller.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _device
from ..ref import activation as ref_activation
from ._common import filled, fresh, or_none, tritium_op


def _impl(t: Tensor):
    if _device.use_triton(t):
        from ..kernels import activation as kernel_activation
        return kernel_activation
    return ref_activation


def _impl_fp8(t: Tensor):
    if _device.use_triton(t):
        from ..kernels import act_cast as kernel_act_cast
        return kernel_act_cast
    return ref_activation


def _width(x: Tensor, kind: str) -> int:
    return x.shape[1] // 2 if kind in ref_activation.GATED else x.shape[1]


@tritium_op("tritium::activation_fwd", mutates_args=())
def _fwd(x: Tensor, kind: str) -> Tensor:
    return fresh((_impl(x).activation_fwd(x, kind),), (x,))[0]


@_fwd.register_fake
def _(x, kind):
    return x.new_empty((x.shape[0], _width(x, kind)))


@tritium_op("tritium::activation_bwd", mutates_args=())
def _bwd(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    return fresh((_impl(x).activation_bwd(dy, x, kind),), (dy, x))[0]


@_bwd.register_fake
def _(dy, x, kind):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def activation_fwd(x: Tensor, kind: str) -> Tensor:
    return torch.ops.tritium.activation_fwd(x, kind)


def activation_bwd(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    return torch.ops.tritium.activation_bwd(dy, x, kind)


def _fake_cast(t, rows, width, fp8_dtype, write_data, write_transpose, pad_rows_to):
    rp = -(-rows // pad_rows_to) * pad_rows_to
    return (t.new_empty((rp, width) if write_data else (0,), dtype=fp8_dtype),
            t.new_empty((width, rp) if write_transpose else (0,), dtype=fp8_dtype),
            t.new_empty((1,), dtype=torch.float32))


def _cast_outs(like, data, data_t, fp8_dtype):
    return filled(data, like, fp8_dtype), filled(data_t, like, fp8_dtype)


@tritium_op("tritium::activation_fwd_fp8", mutates_args=("amax",))
def _fwd_fp8(x: Tensor, kind: str, scale: Tensor, amax: Optional[Tensor],
             fp8_dtype: torch.dtype, write_data: bool, write_transpose: bool,
             pad_rows_to: int) -> tuple[Tensor, Tensor, Tensor]:
    data, data_t, scale_inv = _impl_fp8(x).activation_fwd_fp8(
        x, kind, scale, amax, fp8_dtype, write_data=write_data, write_transpose=write_transpose,
        pad_rows_to=pad_rows_to)
    return fresh((*_cast_outs(x, data, data_t, fp8_dtype), scale_inv), (x, scale, amax))


@_fwd_fp8.register_fake
def _(x, kind, scale, amax, fp8_dtype, write_data, write_transpose, pad_rows_to):
    return _fake_cast(x, x.shape[0], _width(x, kind), fp8_dtype, write_data, write_transpose,
                      pad_rows_to)


@tritium_op("tritium::activation_bwd_fp8", mutates_args=("amax",))
def _bwd_fp8(dy: Tensor, x: Tensor, kind: str, scale: Tensor, amax: Optional[Tensor],
             fp8_dtype: torch.dtype, write_data: bool, write_transpose: bool, write_hp: bool,
             pad_rows_to: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, data, data_t, scale_inv = _impl_fp8(x).activation_bwd_fp8(
        dy, x, kind, scale, amax, fp8_dtype, write_data=write_data,
        write_transpose=write_transpose, write_hp=write_hp, pad_rows_to=pad_rows_to)
    return fresh((filled(dx, x, x.dtype),
                  *_cast_outs(x, data, data_t, fp8_dtype), scale_inv), (dy, x, scale, amax))


@_bwd_fp8.register_fake
def _(dy, x, kind, scale, amax, fp8_dtype, write_data, write_transpose, write_hp, pad_rows_to):
    hp = x.new_empty(tuple(x.shape) if write_hp else (0,))
    return (hp, *_fake_cast(x, x.shape[0], x.shape[1], fp8_dtype, write_data, write_transpose,
                            pad_rows_to))


def activation_fwd_fp8(x: Tensor, kind: str, scale: Tensor, amax: Optional[Tensor],
                       fp8_dtype: torch.dtype, *, write_data: bool = True,
                       write_transpose: bool = False, pad_rows_to: int = 16):
    data, data_t, scale_inv = torch.ops.tritium.activation_fwd_fp8(
        x, kind, scale, amax, fp8_dtype, write_data, write_transpose, pad_rows_to)
    return or_none(data, write_data), or_none(data_t, write_transpose), scale_inv


def activation_bwd_fp8(dy: Tensor, x: Tensor, kind: str, scale: Tensor, amax: Optional[Tensor],
                       fp8_dtype: torch.dtype, *, write_data: bool = True,
                       write_transpose: bool = True, write_hp: bool = False,
                       pad_rows_to: int = 16):
    dx, data, data_t, scale_inv = torch.ops.tritium.activation_bwd_fp8(
        dy, x, kind, scale, amax, fp8_dtype, write_data, write_transpose, write_hp, pad_rows_to)
    return (or_none(dx, write_hp), or_none(data, write_data), or_none(data_t, write_transpose),
            scale_inv)


__all__ = ["activation_fwd", "activation_bwd", "activation_fwd_fp8", "activation_bwd_fp8"]
