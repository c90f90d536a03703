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

Fused FP8 cast (`fp8_cast=CastSpec`, used by LayerNormLinear / LayerNormMLP under delayed
scaling, see `tritium.functional.fused_cast`): the forward writes the next GEMM's fp8 input and
returns it as a Float8Tensor (plus the high-precision output with `return_hp`, for
return_layernorm_output). The backward is unchanged: it receives a plain gradient (the GEMM's
dgrad; summed with the high-precision output's gradient when both arrive).
With `fp8_cast=BlockCastSpec` (Float8BlockScaling) the forward writes the next GEMM's 1x128
blocks (`tritium.kernels.norm_block_cast`) and returns them on a zero-stride carrier
(`fused_cast.block_carrier`), plus the high-precision output with `return_hp`; the block
Linear takes the carrier's blocks instead of quantizing.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..fp8 import block as block_ops
from ..ops import norm as ops_norm
from ..ref import norm as ref_norm
from ._apply import fast_apply
from .fused_cast import BlockCastSpec, CastSpec, block_carrier, carrier_outputs, from_carrier, \
    wrap_fp8

_MAX_HIDDEN = ops_norm.MAX_HIDDEN


def _impl(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_norm
    if t.shape[-1] <= _MAX_HIDDEN and _device.use_triton(t):
        return _device.kernel_module("norm")
    return ref_norm


def _impl_fp8(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_norm
    if t.shape[-1] <= _MAX_HIDDEN and _device.use_triton(t):
        return _device.kernel_module("norm_cast")
    return ref_norm


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as 2D [rows, hidden] (2D t itself: a view op costs host time on every call)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    return t if len(shape) == 2 else t.view(shape)


def _outputs(ctx, x, y, fp8_out, cast: Optional[CastSpec], return_hp: bool):
    """y, or the Float8Tensor (and y) of a fused cast."""
    if cast is None:
        return _shaped(y, x.shape)
    data, data_t, scale_inv = fp8_out
    if torch.compiler.is_compiling():  # no Float8Tensor output in a traced Function
        if return_hp:
            raise NotImplementedError(
                "tritium: a fused FP8 norm with return_hp=True under torch.compile; call it "
                "without fp8_cast (the GEMM then casts its input) or outside the compiled region")
        return carrier_outputs(ctx, x.shape, x.dtype, data, data_t, scale_inv)
    out = wrap_fp8(data, data_t, scale_inv, cast.fp8_dtype, x.dtype, x.shape)
    if not return_hp:
        return out
    ctx.set_materialize_grads(False)  # d(out) + 0 would turn a -0.0 gradient into +0.0
    return out, _shaped(y, x.shape)


def _block_forward(ctx, x, x2d, weight, bias, eps, zero_centered_gamma, is_rms,
                   cast: BlockCastSpec, return_hp: bool):
    """The fused norm + 1x128 block casts: (carrier[, y]); saves what the backward reads."""
    y, bq, mean, rstd = block_ops.norm_fwd_blocks(
        x2d, weight, bias, eps, zero_centered_gamma, is_rms, cast.fp8_dtype,
        columnwise=cast.columnwise, write_hp=return_hp, power_2_scale=cast.power_2_scale,
        amax_epsilon=cast.amax_epsilon)
    ctx.save_for_backward(x2d, weight, *(() if is_rms else (mean,)), rstd)
    carrier = block_carrier(bq, x.shape, x.dtype)
    if not return_hp:
        return carrier
    ctx.set_materialize_grads(False)  # d(out) + 0 would turn a -0.0 gradient into +0.0
    return carrier, y.view(x.shape)


def _grad(ctx, grads):
    """The one gradient of the norm's output (fused with return_hp: two outputs, summed; a
    compiled fused norm: the carrier's, the fp8 outputs take none)."""
    if getattr(ctx, "carrier", False):
        return grads[0]
    given = [g for g in grads if g is not None]
    if not given:
        return None
    return given[0] if len(given) == 1 else given[0] + given[1]


def _fp8_result(out, cast: Optional[CastSpec], x):
    """The Float8Tensor of a compiled fused norm (see fused_cast.carrier_outputs)."""
    if cast is None or not torch.compiler.is_compiling():
        return out
    return from_carrier(out, cast.fp8_dtype, x.shape)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma, cast=None, return_hp=False):
        x2d = _rows(x)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.x_shape, ctx.bias = x.shape, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if isinstance(cast, BlockCastSpec):
            return _block_forward(ctx, x, x2d, weight, bias, eps, zero_centered_gamma, False,
                                  cast, return_hp)
        fp8_out = None
        if cast is None:
            y, mean, rstd = _impl(x2d).layernorm_fwd(x2d, weight, bias, eps, zero_centered_gamma)
        else:
            y, *fp8_out, mean, rstd = _impl_fp8(x2d).layernorm_fwd_fp8(
                x2d, weight, bias, eps, zero_centered_gamma, cast.scale, cast.amax,
                cast.fp8_dtype, write_transpose=cast.write_transpose, write_hp=return_hp)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        return _outputs(ctx, x, y, fp8_out, cast, return_hp)

    @staticmethod
    def backward(ctx, *grads):
        dy = _grad(ctx, grads)
        if dy is None:
            return None, None, None, None, None, None, None
        x2d, weight, mean, rstd = ctx.saved_tensors
        dy2d = _rows(dy)
        need_db = ctx.bias and ctx.needs_input_grad[2]
        dx, dw, db = _impl(dy2d).layernorm_bwd(dy2d, x2d, weight, mean, rstd,
                                               ctx.zero_centered_gamma, need_bias_grad=need_db)
        if db is not None and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        return (_shaped(dx, ctx.x_shape), dw if ctx.needs_input_grad[1] else None, db, None, None,
                None, None)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, cast=None, return_hp=False):
        x2d = _rows(x)
        ctx.zero_centered_gamma, ctx.x_shape = zero_centered_gamma, x.shape
        if isinstance(cast, BlockCastSpec):
            return _block_forward(ctx, x, x2d, weight, None, eps, zero_centered_gamma, True,
                                  cast, return_hp)
        fp8_out = None
        if cast is None:
            y, rstd = _impl(x2d).rmsnorm_fwd(x2d, weight, eps, zero_centered_gamma)
        else:
            y, *fp8_out, rstd = _impl_fp8(x2d).rmsnorm_fwd_fp8(
                x2d, weight, eps, zero_centered_gamma, cast.scale, cast.amax, cast.fp8_dtype,
                write_transpose=cast.write_transpose, write_hp=return_hp)
        ctx.save_for_backward(x2d, weight, rstd)
        return _outputs(ctx, x, y, fp8_out, cast, return_hp)

    @staticmethod
    def backward(ctx, *grads):
        dy = _grad(ctx, grads)
        if dy is None:
            return None, None, None, None, None, None
        x2d, weight, rstd = ctx.saved_tensors
        dy2d = _rows(dy)
        dx, dw = _impl(dy2d).rmsnorm_bwd(dy2d, x2d, weight, rstd, ctx.zero_centered_gamma)
        return (_shaped(dx, ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None, None,
                None, None)


_apply_layer_norm = fast_apply(_LayerNormFunction)
_apply_rms_norm = fast_apply(_RMSNormFunction)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               eps: float = 1e-5, zero_centered_gamma: bool = False, *,
               fp8_cast: Optional[CastSpec] = None, return_hp: bool = False):
    """LayerNorm over the last dim of x: ((x - mean) * rstd) * gamma + bias, in fp32, rounded
    once to x.dtype. gamma = weight, or 1 + weight with zero_centered_gamma. bias may be None.
    With `fp8_cast` the output is a Float8Tensor written by the fused kernel (and with
    `return_hp`, the pair (Float8Tensor, high-precision output))."""
    out = _apply_layer_norm(x, weight, bias, float(eps), bool(zero_centered_gamma),
                            fp8_cast, bool(return_hp))
    return _fp8_result(out, fp8_cast, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
             zero_centered_gamma: bool = False, *, fp8_cast: Optional[CastSpec] = None,
             return_hp: bool = False):
    """RMSNorm over the last dim of x: (x * rsqrt(mean(x^2) + eps)) * gamma, in fp32, rounded
    once to x.dtype. gamma = weight, or 1 + weight with zero_centered_gamma. `fp8_cast`,
    `return_hp`: as for layer_norm."""
    out = _apply_rms_norm(x, weight, float(eps), bool(zero_centered_gamma), fp8_cast,
                          bool(return_hp))
    return _fp8_result(out, fp8_cast, x)


__all__ = ["layer_norm", "rms_norm"]
