"""Custom ops behind `tritium.fp8.cast`: cast_transpose (delayed and current scaling),
cast_transpose_pair, amax_into, dequantize; and the namespace with `tritium.ref.cast`'s names.

Ops (tritium::...), what they write in place:
  cast_transpose          amax (max-accumulated, when given)
  cast_transpose_current  nothing (the scale comes from the amax the caller measured)
  cast_transpose_pair / cast_transpose_pair_current   a_amax, b_amax / nothing
  amax_into               amax
  dequantize              nothing
Outputs not written (write_data / write_transpose False) are 0-element placeholders inside the
graph and None again for the caller. The CUDA-graph extras `skip=` / `out=` raise under compile.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import _device
from ..ref import cast as ref_cast
from ._common import filled, fresh, or_none, tritium_op


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..kernels import cast as kernel_cast
    return kernel_cast


def _impl(t: Tensor):
    return _kernels() if _device.use_triton(t) else ref_cast


def _rows(m: int, pad_rows_to: int) -> int:
    return -(-m // pad_rows_to) * pad_rows_to


def _fake_cast(x, fp8_dtype, pad_rows_to, write_data, write_transpose):
    m, n = x.shape
    mp = _rows(m, pad_rows_to)
    return (x.new_empty((mp, n) if write_data else (0,), dtype=fp8_dtype),
            x.new_empty((n, mp) if write_transpose else (0,), dtype=fp8_dtype),
            x.new_empty((1,), dtype=torch.float32))


def _filled(x, fp8_dtype, res) -> tuple:
    data, data_t, scale_inv = res
    return filled(data, x, fp8_dtype), filled(data_t, x, fp8_dtype), scale_inv


# ------------------------------------------------------------------------------ single cast
@tritium_op("tritium::cast_transpose", mutates_args=("amax",))
def _cast_transpose(x: Tensor, scale: Tensor, amax: Optional[Tensor], fp8_dtype: torch.dtype,
                    pad_rows_to: int, write_data: bool, write_transpose: bool
                    ) -> tuple[Tensor, Tensor, Tensor]:
    res = _impl(x).cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                  write_data=write_data, write_transpose=write_transpose)
    return fresh(_filled(x, fp8_dtype, res), (x, scale, amax))


@_cast_transpose.register_fake
def _(x, scale, amax, fp8_dtype, pad_rows_to, write_data, write_transpose):
    return _fake_cast(x, fp8_dtype, pad_rows_to, write_data, write_transpose)


@tritium_op("tritium::cast_transpose_current", mutates_args=())
def _cast_transpose_current(x: Tensor, amax: Tensor, fp8_dtype: torch.dtype, pad_rows_to: int,
                            write_data: bool, write_transpose: bool, amax_epsilon: float,
                            power_2_scale: bool) -> tuple[Tensor, Tensor, Tensor]:
    res = _impl(x).cast_transpose(x, None, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                  write_data=write_data, write_transpose=write_transpose,
                                  current=(amax_epsilon, power_2_scale))
    return fresh(_filled(x, fp8_dtype, res), (x, amax))


@_cast_transpose_current.register_fake
def _(x, amax, fp8_dtype, pad_rows_to, write_data, write_transpose, amax_epsilon,
      power_2_scale):
    return _fake_cast(x, fp8_dtype, pad_rows_to, write_data, write_transpose)


def cast_transpose(x: Tensor, scale: Optional[Tensor], amax: Optional[Tensor],
                   fp8_dtype: torch.dtype, *, pad_rows_to: int = 1, write_data: bool = True,
                   write_transpose: bool = False, current: Optional[tuple] = None,
                   skip: Optional[Tensor] = None, out: Optional[tuple] = None):
    """`tritium.ref.cast.cast_transpose` through the ops (see the module docstring)."""
    if skip is not None or out is not None:
        raise NotImplementedError(
            "cast_transpose(skip=..., out=...) (the CUDA-graph FP8 weight cache of "
            "make_graphed_callables) is not supported under torch.compile: call it without "
            "skip and out there, or run that part eagerly / in a CUDA graph")
    if current is None:
        res = torch.ops.tritium.cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to,
                                               write_data, write_transpose)
    else:
        res = torch.ops.tritium.cast_transpose_current(
            x, amax, fp8_dtype, pad_rows_to, write_data, write_transpose, float(current[0]),
            bool(current[1]))
    data, data_t, scale_inv = res
    return or_none(data, write_data), or_none(data_t, write_transpose), scale_inv


# ------------------------------------------------------------------------------ two casts
_PAIR = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@tritium_op("tritium::cast_transpose_pair", mutates_args=("a_amax", "b_amax"))
def _cast_pair(a: Tensor, a_scale: Tensor, a_amax: Optional[Tensor], a_pad: int, a_data: bool,
               a_t: bool, b: Tensor, b_scale: Tensor, b_amax: Optional[Tensor], b_pad: int,
               b_data: bool, b_t: bool, fp8_dtype: torch.dtype) -> _PAIR:
    ra, rb = _impl(a).cast_transpose_pair((a, a_scale, a_amax, a_pad, a_data, a_t),
                                          (b, b_scale, b_amax, b_pad, b_data, b_t), fp8_dtype)
    ins = (a, a_scale, a_amax, b, b_scale, b_amax)
    return fresh((*_filled(a, fp8_dtype, ra), *_filled(b, fp8_dtype, rb)), ins)


@_cast_pair.register_fake
def _(a, a_scale, a_amax, a_pad, a_data, a_t, b, b_scale, b_amax, b_pad, b_data, b_t,
      fp8_dtype):
    return (*_fake_cast(a, fp8_dtype, a_pad, a_data, a_t),
            *_fake_cast(b, fp8_dtype, b_pad, b_data, b_t))


@tritium_op("tritium::cast_transpose_pair_current", mutates_args=())
def _cast_pair_current(a: Tensor, a_amax: Tensor, a_pad: int, a_data: bool, a_t: bool,
                       b: Tensor, b_amax: Tensor, b_pad: int, b_data: bool, b_t: bool,
                       fp8_dtype: torch.dtype, amax_epsilon: float, power_2_scale: bool) -> _PAIR:
    ra, rb = _impl(a).cast_transpose_pair((a, None, a_amax, a_pad, a_data, a_t),
                                          (b, None, b_amax, b_pad, b_data, b_t), fp8_dtype,
                                          (amax_epsilon, power_2_scale))
    ins = (a, a_amax, b, b_amax)
    return fresh((*_filled(a, fp8_dtype, ra), *_filled(b, fp8_dtype, rb)), ins)


@_cast_pair_current.register_fake
def _(a, a_amax, a_pad, a_data, a_t, b, b_amax, b_pad, b_data, b_t, fp8_dtype, amax_epsilon,
      power_2_scale):
    return (*_fake_cast(a, fp8_dtype, a_pad, a_data, a_t),
            *_fake_cast(b, fp8_dtype, b_pad, b_data, b_t))


def cast_transpose_pair(a_job: tuple, b_job: tuple, fp8_dtype: torch.dtype,
                        current: Optional[tuple] = None):
    """`tritium.ref.cast.cast_transpose_pair` through the ops: jobs are
    (x, scale, amax, pad_rows_to, write_data, write_transpose)."""
    a, a_scale, a_amax, a_pad, a_data, a_t = a_job
    b, b_scale, b_amax, b_pad, b_data, b_t = b_job
    if current is None:
        res = torch.ops.tritium.cast_transpose_pair(a, a_scale, a_amax, a_pad, a_data, a_t,
                                                    b, b_scale, b_amax, b_pad, b_data, b_t,
                                                    fp8_dtype)
    else:
        res = torch.ops.tritium.cast_transpose_pair_current(
            a, a_amax, a_pad, a_data, a_t, b, b_amax, b_pad, b_data, b_t, fp8_dtype,
            float(current[0]), bool(current[1]))
    return ((or_none(res[0], a_data), or_none(res[1], a_t), res[2]),
            (or_none(res[3], b_data), or_none(res[4], b_t), res[5]))


# ------------------------------------------------------------------------------ amax, dequantize
@tritium_op("tritium::amax_into", mutates_args=("amax",))
def _amax_into(x: Tensor, amax: Tensor) -> None:
    _impl(x).amax_into(x, amax)


@_amax_into.register_fake
def _(x, amax):
    return None


def amax_into(x: Tensor, amax: Tensor) -> None:
    torch.ops.tritium.amax_into(x, amax)


@tritium_op("tritium::dequantize", mutates_args=())
def _dequantize(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return fresh((_impl(data).dequantize(data, scale_inv, out_dtype),), (data, scale_inv))[0]


@_dequantize.register_fake
def _(data, scale_inv, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


def dequantize(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return torch.ops.tritium.dequantize(data, scale_inv, out_dtype)


__all__ = ["cast_transpose", "cast_transpose_pair", "amax_into", "dequantize"]
