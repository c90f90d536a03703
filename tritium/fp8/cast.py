"""Per-call choice between a Triton cast kernel and its pure-PyTorch twin, plus the
recipe-level helper `quantize_2d` that every FP8 module uses to cast a GEMM operand.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..ref import cast as ref_cast


def _impl(t: torch.Tensor):
    if _device.use_triton(t):
        from ..kernels import cast as kernel_cast
        return kernel_cast
    return ref_cast


def cast_transpose(x, scale, amax, fp8_dtype, **kwargs):
    return _impl(x).cast_transpose(x, scale, amax, fp8_dtype, **kwargs)


def amax_into(x: torch.Tensor, amax: torch.Tensor) -> None:
    _impl(x).amax_into(x, amax)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _impl(data).dequantize(data, scale_inv, out_dtype)


def quantize_2d(x: torch.Tensor, fp8_dtype: torch.dtype, *, scale: Optional[torch.Tensor],
                amax: Optional[torch.Tensor], current: Optional[tuple], pad_rows_to: int = 16,
                write_data: bool = True, write_transpose: bool = False):
    """Cast a 2D GEMM operand. Delayed scaling: `scale` and `amax` are the state's slot views
    (amax may be None for a cast that must not record, e.g. a cached weight). Current scaling:
    `current=(amax_epsilon, power_2_scale)`; the amax is measured first, then the cast reads it.
    """
    if current is not None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        amax_into(x, amax)
        scale = None
    return cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                          write_data=write_data, write_transpose=write_transpose, current=current)
