"""Per-call choice between a Triton cast kernel and its pure-PyTorch twin, plus the
recipe-level helper `quantize_2d` that every FP8 module uses to cast a GEMM operand.

`cast_transpose(..., skip=flag, out=buffers)` (CUDA graphs with FP8 weight caching): the cast
writes into the caller's persistent `out` buffers unless the int32 [1] device `flag` is non-zero,
in which case it is a no-op (see `tritium.kernels.cast`). The buffers are checked here, once for
both implementations.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _device
from ..ops import cast as ops_cast
from ..ref import cast as ref_cast


@functools.lru_cache(maxsize=None)
def _kernels():
    """tritium.kernels.cast, imported on first use (it imports triton)."""
    from ..kernels import cast as kernel_cast
    return kernel_cast


def _impl(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_cast
    return _kernels() if _device.use_triton(t) else ref_cast


def cast_transpose(x, scale, amax, fp8_dtype, **kwargs):
    if kwargs.get("out") is not None or kwargs.get("skip") is not None:
        _check_out(x, fp8_dtype, **kwargs)
    return _impl(x).cast_transpose(x, scale, amax, fp8_dtype, **kwargs)


def _check_out(x, fp8_dtype, *, pad_rows_to=1, write_data=True, write_transpose=False,
               skip=None, out=None, **_):
    if skip is not None:
        if out is None:
            raise ValueError("cast_transpose(skip=...) needs out=(data, data_t, scale_inv): a "
                             "skipped cast returns the buffers an earlier cast wrote")
        if skip.dtype != torch.int32 or skip.numel() != 1 or skip.device != x.device:
            raise ValueError(f"cast_transpose: skip must be an int32 [1] tensor on {x.device}, got "
                             f"{skip.dtype}{tuple(skip.shape)} on {skip.device}")
    m, n = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    want = ((mp, n) if write_data else None, (n, mp) if write_transpose else None, (1,))
    if not isinstance(out, tuple) or len(out) != 3:
        raise ValueError("cast_transpose: out must be a tuple (data, data_t, scale_inv)")
    for name, t, shape in zip(("data", "data_t", "scale_inv"), out, want):
        if shape is None:
            continue
        dtype = torch.float32 if name == "scale_inv" else fp8_dtype
        # data_t may be a column block of a wider buffer: rows contiguous, any row stride
        laid_out = t is not None and (t.is_contiguous() if name != "data_t" else
                                      t.stride(1) == 1 and t.stride(0) >= shape[1])
        if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != x.device \
                or not laid_out:
            got = None if t is None else f"{t.dtype}{tuple(t.shape)} on {t.device}"
            kind = "a contiguous" if name != "data_t" else "a row-contiguous"
            raise ValueError(f"cast_transpose: out {name} must be {kind} {dtype}{shape} "
                             f"tensor on {x.device}, got {got}")


def cast_transpose_pair(a_job: tuple, b_job: tuple, fp8_dtype, current=None):
    """Two casts in one launch; jobs as in `tritium.ref.cast.cast_transpose_pair`."""
    return _impl(a_job[0]).cast_transpose_pair(a_job, b_job, fp8_dtype, current)


def amax_into(x: torch.Tensor, amax: torch.Tensor) -> None:
    _impl(x).amax_into(x, amax)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _impl(data).dequantize(data, scale_inv, out_dtype)


def transpose_fp8(data: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The contiguous transpose of 2D fp8 `data` (into `out` when given). Under torch.compile
    the twin's torch ops, which Inductor fuses."""
    if data.dim() != 2 or data.element_size() != 1:
        raise ValueError(f"transpose_fp8: data must be a 2D tensor of one-byte elements (fp8 or "
                         f"uint8), got {data.dtype}{tuple(data.shape)}")
    if out is not None and (out.shape != data.shape[::-1] or out.dtype != data.dtype
                            or not out.is_contiguous() or out.device != data.device):
        raise ValueError(f"transpose_fp8: out must be a contiguous {data.dtype}"
                         f"{tuple(data.shape[::-1])} tensor on {data.device}, got {out.dtype}"
                         f"{tuple(out.shape)} on {out.device}")
    if torch.compiler.is_compiling() or not _device.use_triton(data):
        return ref_cast.transpose_fp8(data, out)
    return _kernels().transpose_fp8(data, out)


def quantize_2d(x: torch.Tensor, fp8_dtype: torch.dtype, *, scale: Optional[torch.Tensor],
                amax: Optional[torch.Tensor], current: Optional[tuple], pad_rows_to: int = 16,
                write_data: bool = True, write_transpose: bool = False,
                skip: Optional[torch.Tensor] = None, out: Optional[tuple] = None):
    """Cast a 2D GEMM operand. Delayed scaling: `scale` and `amax` are the state's slot views
    (amax may be None for a cast that must not record, e.g. a cached weight). Current scaling:
    `current=(amax_epsilon, power_2_scale)`; the amax is measured first, then the cast reads it.
    skip / out: see the module docstring (forwarded only when given).
    """
    if current is not None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        amax_into(x, amax)
        scale = None
    if skip is None and out is None:  # the hot path: no buffer checks, no extra arguments
        return _impl(x).cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                       write_data=write_data, write_transpose=write_transpose,
                                       current=current)
    return cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                          write_data=write_data, write_transpose=write_transpose, current=current,
                          skip=skip, out=out)


def quantize_pair(a_job: tuple, b_job: tuple, fp8_dtype: torch.dtype, current: Optional[tuple]):
    """`quantize_2d` of two operands in one launch (a GEMM's input and weight). Jobs are
    (x, scale, amax, pad_rows_to, write_data, write_transpose); with `current`, the scale entries
    are ignored and each operand's amax is measured first, as quantize_2d does, unless its job
    gives one: an amax the caller measured already (and keeps, to cast again with that scale)."""
    if current is not None:
        fresh = torch.zeros(2, dtype=torch.float32, device=a_job[0].device)
        jobs = []
        for i, (x, _, amax, *rest) in enumerate((a_job, b_job)):
            if amax is None:
                amax = fresh[i:i + 1]
                amax_into(x, amax)
            jobs.append((x, None, amax, *rest))
        a_job, b_job = jobs
    return cast_transpose_pair(a_job, b_job, fp8_dtype, current)
