"""Pure-PyTorch twins of `tritium.kernels.cast`: the CPU path and the test oracle.

Same names, signatures and results, bit for bit, as the Triton launchers:
  * values are scaled in fp32, clamped to +-fp8_max (NaN kept), then rounded to the fp8 dtype
    (round to nearest even). Clamping first matters: an overflowing e4m3 cast gives NaN on
    torch 2.11 and saturates on 2.13; the GPU instruction saturates. Clamped, all agree.
  * amax is max|x| of the unscaled input, max-accumulated into `amax` (row 0 of a history),
    NaN winning over inf winning over finite values, as the kernel's atomic max does.
  * scale_inv is the exactly rounded fp32 1/scale (IEEE division).
  * rows are zero-padded to a multiple of `pad_rows_to` (FP8 GEMMs need dims divisible by 16).
  * `skip` (int32 [1], CUDA graphs with weight caching): non-zero makes the cast a no-op that
    returns `out` untouched and records no amax. The kernel reads the flag on the device; this
    twin reads it on the host (it never runs inside a CUDA graph).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fp8.formats import FP32_MAX, fp8_max


def _nan_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # torch.maximum propagates NaN, which is what the kernel's integer atomic max does too.
    return torch.maximum(a, b)


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0,
                  power_2_scale: bool = False) -> torch.Tensor:
    """Float8CurrentScaling's scale from one amax ([1] fp32)."""
    a = amax.float()
    a = torch.where(a < amax_epsilon, torch.full_like(a, amax_epsilon), a)
    s = torch.full_like(a, fp8_max(fp8_dtype)) / a
    s = torch.where(s == float("inf"), torch.full_like(s, FP32_MAX), s)
    if power_2_scale:
        s = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    bad = (a == 0) | torch.isnan(a) | torch.isinf(a)
    return torch.where(bad, torch.ones_like(s), s)


def amax_into(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax[0] = max(amax[0], max|x|)."""
    if x.numel():
        amax.copy_(_nan_max(amax, x.detach().abs().amax().float().reshape(1)))


def amax_pair_into(x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor) -> None:
    """amax_into(x, amax[0:1]) and amax_into(y, amax[1:2]) (amax: [2] fp32; the kernel walks
    both tensors in one launch)."""
    amax_into(x, amax[0:1])
    amax_into(y, amax[1:2])


def cast_transpose(x: torch.Tensor, scale: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                   fp8_dtype: torch.dtype, *, pad_rows_to: int = 1, write_data: bool = True,
                   write_transpose: bool = False, current: Optional[tuple] = None,
                   skip: Optional[torch.Tensor] = None, out: Optional[tuple] = None):
    """Cast a 2D tensor to fp8, optionally with its transpose, in one pass.

    x: [M, N] fp32/bf16/fp16. scale: [1] fp32 (delayed scaling) or None with
    `current=(amax_epsilon, power_2_scale)`, in which case the scale is computed from `amax`
    (which must already hold max|x|, see `amax_into`) and amax is not updated.
    out: optional (data [Mp, N], data_t [N, Mp], scale_inv [1] fp32) to write into (an entry
    may be None where it is not written); skip: see the module docstring (needs `out`).
    Returns (data [Mp, N] or None, data_t [N, Mp] or None, scale_inv [1] fp32).
    """
    if skip is not None and bool(skip.reshape(-1)[0] != 0):
        return (out[0] if write_data else None, out[1] if write_transpose else None, out[2])
    m, n = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    if current is not None:
        scale = current_scale(amax, fp8_dtype, *current)
    elif amax is not None:
        amax_into(x, amax)
    limit = fp8_max(fp8_dtype)
    y = (x.float() * scale.float()).clamp(-limit, limit).to(fp8_dtype)
    if mp != m:
        y = torch.cat([y, torch.zeros(mp - m, n, dtype=fp8_dtype, device=x.device)])
    data = y if write_data else None
    data_t = y.t().contiguous() if write_transpose else None
    scale_inv = torch.ones_like(scale.float()) / scale.float()
    if out is not None:
        for dst, src in zip(out, (data, data_t, scale_inv)):
            if src is not None:
                dst.copy_(src)
        return (out[0] if write_data else None, out[1] if write_transpose else None, out[2])
    return data, data_t, scale_inv


def cast_transpose_pair(a_job: tuple, b_job: tuple, fp8_dtype: torch.dtype,
                        current: Optional[tuple] = None):
    """Two casts to one fp8 dtype (a GEMM's input and weight), which the kernel does in one
    launch. Each job is (x, scale, amax, pad_rows_to, write_data, write_transpose), meaning
    what `cast_transpose`'s arguments of those names mean; returns the two result triples."""
    return tuple(cast_transpose(x, scale, amax, fp8_dtype, pad_rows_to=pad, write_data=data,
                                write_transpose=t, current=current)
                 for x, scale, amax, pad, data, t in (a_job, b_job))


def transpose_fp8(data: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The transpose of a 2D fp8 tensor, contiguous: [M, N] -> [N, M] (into `out`, a contiguous
    [N, M] tensor of data's dtype, when given). Bytes are moved, never converted."""
    if out is None:
        return data.t().contiguous()
    out.copy_(data.t())
    return out


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale_inv.float()).to(out_dtype)
