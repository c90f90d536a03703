"""TE's activation functions with autograd: `activation(x, kind)` for any leading dims.

Plain kinds (gelu = tanh approximation, qgelu, relu, srelu, silu) map [..., F] -> [..., F];
gated kinds (geglu, qgeglu, reglu, sreglu, swiglu, glu) map [..., 2F] -> [..., F] with the FIRST
half of the last dim through the activation and the SECOND half multiplying:
swiglu(x) = silu(x[..., :F]) * x[..., F:] (TE's order; a Llama port puts gate_proj first).
Math in fp32, one rounding to x.dtype; formulas in `tritium.ref.activation`.

Each call picks the Triton kernel (CUDA tensors, or CPU under TRITON_INTERPRET=1) or its
pure-PyTorch twin. Backward recomputes the activation from the saved input (no extra forward
output is kept) in one elementwise pass. Double backward is not supported.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .. import _device
from ..ref import activation as ref_activation
from ..ref.activation import ACTIVATIONS, GATED

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(t: torch.Tensor):
    if _device.use_triton(t):
        from ..kernels import activation as kernel_activation
        return kernel_activation
    return ref_activation


def _validate(x: torch.Tensor, kind: str) -> None:
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown activation {kind!r}; valid activations: "
                         f"{', '.join(ACTIVATIONS)}")
    if x.dim() == 0:
        raise ValueError(f"activation {kind!r} needs a tensor with at least one dim, got a scalar")
    if x.dtype not in _DTYPES:
        raise ValueError(f"activation {kind!r} supports float32, bfloat16 and float16 inputs, "
                         f"got {x.dtype}")
    if kind in GATED and x.shape[-1] % 2:
        raise ValueError(f"gated activation {kind!r} splits the last dim into two halves "
                         f"[act input, multiplier], so it must be even; got shape {tuple(x.shape)}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] (a view where possible; reshape(-1, n) fails for n == 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str) -> torch.Tensor:
        x2 = _rows(x)
        y = _impl(x2).activation_fwd(x2, kind)
        ctx.save_for_backward(x)
        ctx.kind = kind
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        x2, dy2 = _rows(x), _rows(dy)
        dx = _impl(x2).activation_bwd(dy2, x2, ctx.kind)
        return dx.view(x.shape), None


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """TE activation `kind` of x [..., F] (plain) or [..., 2F] (gated) -> [..., F]."""
    _validate(x, kind)
    return _Activation.apply(x, kind)


__all__ = ["ACTIVATIONS", "GATED", "activation"]
