"""LayerNorm and RMSNorm as autograd Functions, and the functional API.

`layer_norm(x, weight, bias, eps, zero_centered_gamma)` and
`rms_norm(x, weight, eps, zero_centered_gamma)` take x of any shape [..., hidden], flatten it to
2D for the kernels and give the result x's shape and dtype (weight and bias may have another
dtype; their gradients come back in their own dtypes). Each call picks the Triton kernels
(`tritium.kernels.norm`) or their PyTorch twins (`tritium.ref.norm`) like `tritium.fp8.cast`
does: kernels on CUDA tensors (and on CPU under TRITON_INTERPRET=1), the twins otherwise, and the
twins too for rows longer than the kernels' MAX_HIDDEN.

Forward saves x (2D view), weight, and the fp32 per-row mean/rstd: backward reads them and
recomputes nothing but the normalized row. The math (fp32, one rounding at the end) is stated
in `tritium/ref/norm.py`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..ref import norm as ref_norm

_MAX_HIDDEN = 65536  # == tritium.kernels.norm.MAX_HIDDEN (not imported: it would import triton)


def _impl(t: torch.Tensor):
    if t.shape[-1] <= _MAX_HIDDEN and _device.use_triton(t):
        from ..kernels import norm as kernel_norm
        return kernel_norm
    return ref_norm


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):
        x2d = x.reshape(-1, x.shape[-1])
        y, mean, rstd = _impl(x2d).layernorm_fwd(x2d, weight, bias, eps, zero_centered_gamma)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.x_shape, ctx.bias = x.shape, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape)
        need_db = ctx.bias and ctx.needs_input_grad[2]
        dx, dw, db = _impl(dy2d).layernorm_bwd(dy2d, x2d, weight, mean, rstd,
                                               ctx.zero_centered_gamma, need_bias_grad=need_db)
        if db is not None and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        return (dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, db, None, None)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        x2d = x.reshape(-1, x.shape[-1])
        y, rstd = _impl(x2d).rmsnorm_fwd(x2d, weight, eps, zero_centered_gamma)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.zero_centered_gamma, ctx.x_shape = zero_centered_gamma, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape)
        dx, dw = _impl(dy2d).rmsnorm_bwd(dy2d, x2d, weight, rstd, ctx.zero_centered_gamma)
        return dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               eps: float = 1e-5, zero_centered_gamma: bool = False) -> torch.Tensor:
    """LayerNorm over the last dim of x: ((x - mean) * rstd) * gamma + bias, in fp32, rounded
    once to x.dtype. gamma = weight, or 1 + weight with zero_centered_gamma. bias may be None."""
    return _LayerNormFunction.apply(x, weight, bias, float(eps), bool(zero_centered_gamma))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
             zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x: (x * rsqrt(mean(x^2) + eps)) * gamma, in fp32, rounded
    once to x.dtype. gamma = weight, or 1 + weight with zero_centered_gamma."""
    return _RMSNormFunction.apply(x, weight, float(eps), bool(zero_centered_gamma))


__all__ = ["layer_norm", "rms_norm"]
