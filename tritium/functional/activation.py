"""TE's activation functions with autograd: `activation(x, kind)` for any leading dims.

Plain kinds (gelu = tanh approximation, qgelu, relu, srelu, silu) map [..., F] -> [..., F];
gated kinds (geglu, qgeglu, reglu, sreglu, swiglu, glu) map [..., 2F] -> [..., F] with the FIRST
half of the last dim through the activation and the SECOND half multiplying:
swiglu(x) = silu(x[..., :F]) * x[..., F:] (TE's order; a Llama port puts gate_proj first).
Math in fp32, one rounding to x.dtype; formulas in `tritium.ref.activation`.

Each call picks the Triton kernel (CUDA tensors, or CPU under TRITON_INTERPRET=1) or its
pure-PyTorch twin. Backward recomputes the activation from the saved input (no extra forward
output is kept) in one elementwise pass. Double backward is not supported.

Fused FP8 casts (LayerNormMLP under delayed scaling, see `tritium.functional.fused_cast`):
with `fp8_out=CastSpec` the forward writes fc2's fp8 input directly and returns it as a
Float8Tensor (the high-precision activation is never materialized); with
`fp8_grad=GradCastSpec` the backward writes d(x) as fp8 data + transpose with fc1's grad scale
(recording its amax) and returns it as a Float8Tensor, which fc1's `_LinearFunction.backward`
uses without casting (autograd accepts a Float8Tensor as the gradient of a plain tensor; under
torch.compile the fp8 pieces travel as the gradients of fc1's `fused_cast.grad_carriers`).
With `fp8_out=BlockCastSpec` (Float8BlockScaling) the forward writes fc2's 1x128 blocks and
returns a carrier (`fused_cast.block_carrier`); with `fp8_grad=BlockGradCastSpec` the backward
writes fc1's 1x128 grad_output blocks and returns them on a carrier (or on the high-precision
d(x) when asked for it).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .. import _device
from ..fp8 import block as block_ops
from ..ops import activation as ops_activation
from ..ref import activation as ref_activation
from ..ref.activation import ACTIVATIONS, GATED
from ._apply import fast_apply
from .fused_cast import (BlockCastSpec, BlockGradCastSpec, CastSpec, GradCastSpec, block_carrier,
                         carrier_outputs, from_carrier, wrap_fp8)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_activation
    if _device.use_triton(t):
        return _device.kernel_module("activation")
    return ref_activation


def _impl_fp8(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_activation
    if _device.use_triton(t):
        return _device.kernel_module("act_cast")
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
    def forward(ctx, x: torch.Tensor, kind: str, fp8_out: Optional[CastSpec] = None,
                fp8_grad: Optional[GradCastSpec] = None, *grad_carriers) -> torch.Tensor:
        # grad_carriers (torch.compile): fc1's `fused_cast.grad_carriers`, whose gradients
        # are the fp8 pieces of the gradient written under fp8_grad
        x2 = _rows(x)
        ctx.save_for_backward(x)
        ctx.kind, ctx.fp8_grad, ctx.carried = kind, fp8_grad, len(grad_carriers) > 0
        f = x.shape[-1] // 2 if kind in GATED else x.shape[-1]
        shape = (*x.shape[:-1], f)
        if fp8_out is None:
            return _impl(x2).activation_fwd(x2, kind).view(shape)
        if isinstance(fp8_out, BlockCastSpec):
            bq = block_ops.activation_fwd_blocks(
                x2, kind, fp8_out.fp8_dtype, columnwise=fp8_out.columnwise,
                power_2_scale=fp8_out.power_2_scale, amax_epsilon=fp8_out.amax_epsilon)
            return block_carrier(bq, shape, x.dtype)
        data, data_t, scale_inv = _impl_fp8(x2).activation_fwd_fp8(
            x2, kind, fp8_out.scale, fp8_out.amax, fp8_out.fp8_dtype,
            write_transpose=fp8_out.write_transpose)
        if torch.compiler.is_compiling():  # no Float8Tensor output in a traced Function
            return carrier_outputs(ctx, shape, x.dtype, data, data_t, scale_inv)
        return wrap_fp8(data, data_t, scale_inv, fp8_out.fp8_dtype, x.dtype, shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor, *fp8_grads):  # fp8_grads: a carrier's other outputs
        (x,) = ctx.saved_tensors
        x2, dy2 = _rows(x), _rows(dy)
        g = ctx.fp8_grad
        if g is None:
            dx = _impl(x2).activation_bwd(dy2, x2, ctx.kind)
            return dx.view(x.shape), None, None, None
        if isinstance(g, BlockGradCastSpec):
            hp, bq = block_ops.activation_bwd_blocks(
                dy2, x2, ctx.kind, g.fp8_dtype, columnwise=g.columnwise, write_hp=g.write_hp,
                power_2_scale=g.power_2_scale, amax_epsilon=g.amax_epsilon)
            hp = None if hp is None else hp.view(x.shape)
            return block_carrier(bq, x.shape, x.dtype, hp), None, None, None
        state = g.state
        hp, data, data_t, scale_inv = _impl_fp8(x2).activation_bwd_fp8(
            dy2, x2, ctx.kind, state.scale_slot(g.slot), state.amax_slot(g.slot),
            state.fp8_dtype, write_hp=g.write_hp)
        hp = None if hp is None else hp.view(*x.shape)
        if ctx.carried:  # x's own gradient: d(x) when written (fc1's bias), else no memory
            hp = x.new_zeros(()).expand(x.shape) if hp is None else hp
            return hp, None, None, None, data, data_t, scale_inv
        return wrap_fp8(data, data_t, scale_inv, state.fp8_dtype, x.dtype, x.shape, hp), \
            None, None, None


_apply_activation = fast_apply(_Activation)


def activation(x: torch.Tensor, kind: str, *, fp8_out: Optional[CastSpec] = None,
               fp8_grad: Optional[GradCastSpec] = None,
               grad_carriers: Optional[tuple] = None) -> torch.Tensor:
    """TE activation `kind` of x [..., F] (plain) or [..., 2F] (gated) -> [..., F].
    `fp8_out` / `fp8_grad`: the fused FP8 casts of LayerNormMLP (module docstring).
    `grad_carriers`: under torch.compile, how a tensorwise `fp8_grad` reaches fc1 (the
    carriers `functional.linear.linear(..., fp8_grad_carriers=True)` returned beside x);
    without them the compiled backward writes d(x) in high precision and fc1 casts it."""
    _validate(x, kind)
    if not torch.compiler.is_compiling():
        return _apply_activation(x, kind, fp8_out, fp8_grad)
    # compiled: the fp8 output through a carrier, the fp8 gradient through fc1's carriers (a
    # Float8Tensor returned as a gradient crosses the traced graph as a plain tensor):
    # compile.md
    if grad_carriers is not None and isinstance(fp8_grad, GradCastSpec):
        out = _Activation.apply(x, kind, fp8_out, fp8_grad, *grad_carriers)
    else:
        out = _Activation.apply(x, kind, fp8_out, None)
    return out if fp8_out is None else from_carrier(out, fp8_out.fp8_dtype, out[0].shape)


__all__ = ["ACTIVATIONS", "GATED", "activation"]
