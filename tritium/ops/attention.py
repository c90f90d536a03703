"""torch.library custom ops for tritium's Triton flash attention, so torch.compile can trace it.

    torch.ops.tritium.flash_attn_fwd(q, k, v, causal, scale, split=True) -> (out, lse)
    torch.ops.tritium.flash_attn_bwd(dout, q, k, v, out, lse, causal, scale, split=True)
        -> (dq, dk, dv)
    torch.ops.tritium.flash_attn_fp8_fwd(q8, k8, v8, descale, causal, scale, out_dtype,
        o8_scale, o8_amax, seq_first, keep_hp) -> (out, lse, out8)   (FP8 attention's forward,
        fp8_mha's E4M3 out beside it; its backward is flash_attn_bwd on dequantized inputs)

Same contract as `tritium.kernels.flash_attention` (bshd q/k/v, GQA, top-left causal or no
mask; out fp32 [b, s_q, h, d], lse fp32 [b, h, s_q]; fp32 gradients; the backward takes any
(out, lse) pair of the same softmax rows). Each op runs the Triton launcher where
`_device.use_triton` says so (CUDA, or CPU under TRITON_INTERPRET=1) and its pure-PyTorch twin
in `tritium.ref.flash_attention` otherwise, so CPU tests trace the same op. The fake (meta)
implementations only allocate the outputs: Dynamo / AOTAutograd never run a kernel to learn a
shape. `flash_attn_fwd` is differentiable (`register_autograd` calls `flash_attn_bwd`; the
gradients are returned in the inputs' dtype), so a compiled model may use it directly.

Registration happens when this module is imported. Nothing imports it eagerly: the attention
code (attention/cp/merge.py) imports it only when it runs under torch.compile, and its eager
path keeps calling the launchers directly (no dispatcher hop, unchanged speed).
Deliberately not here: autotuning, dropout, windows or padding (the kernel has none).
"""
from typing import Optional

import torch

from .. import _device
from ..ref import flash_attention as _ref


def _wide(q: torch.Tensor) -> torch.dtype:
    """Result dtype: fp32, fp64 for fp64 inputs (the twin's rule; the kernel takes no fp64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _impl(q: torch.Tensor):
    if _device.use_triton(q):
        from ..kernels import flash_attention as kernel
        return kernel
    return _ref


@torch.library.custom_op("tritium::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float, split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(q).flash_attention_fwd(q, k, v, causal, scale, split)


@flash_attn_fwd.register_fake
def _(q, k, v, causal, scale, split=True):
    b, s_q, h, d = q.shape
    return (q.new_empty((b, s_q, h, d), dtype=_wide(q)),
            q.new_empty((b, h, s_q), dtype=_wide(q)))


@torch.library.custom_op("tritium::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   split: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl(q).flash_attention_bwd(dout, q, k, v, out, lse, causal, scale, split)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, scale, split=True):
    return tuple(x.new_empty(x.shape, dtype=_wide(q)) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, split = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale, ctx.split = causal, scale, split


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.split)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("tritium::flash_attn_fp8_fwd", mutates_args=("o8_amax",))
def flash_attn_fp8_fwd(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                       descale: torch.Tensor, causal: bool, scale: float,
                       out_dtype: torch.dtype, o8_scale: Optional[torch.Tensor],
                       o8_amax: Optional[torch.Tensor], seq_first: bool, keep_hp: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 forward (kernels.flash_attention.flash_attention_fp8_fwd, no band) -> (out in
    out_dtype, lse, out8). With o8_scale (fp8_mha) out8 is the E4M3 out (o8_amax
    max-recorded, seq_first its memory order) and out is empty unless keep_hp; without it out8
    is empty. Not differentiable: FP8 attention's Function owns its backward."""
    fp8_out = None
    if o8_scale is not None:
        from ..kernels.flash_attention import FP8Out
        fp8_out = FP8Out(o8_scale, o8_amax, seq_first, keep_hp)
    # the twin (CPU) quantizes P against the exact row max, the kernel its running one
    res = _impl(q8).flash_attention_fp8_fwd(q8, k8, v8, descale, causal, scale,
                                            out_dtype=out_dtype, fp8_out=fp8_out)
    out, lse = res[0], res[1]
    out8 = res[2] if fp8_out is not None else q8.new_empty(0)
    return (out if out is not None else q8.new_empty(0, dtype=out_dtype)), lse, out8


@flash_attn_fp8_fwd.register_fake
def _(q8, k8, v8, descale, causal, scale, out_dtype, o8_scale, o8_amax, seq_first, keep_hp):
    b, s_q, h, d = q8.shape
    hp = o8_scale is None or keep_hp
    out = q8.new_empty((b, s_q, h, d) if hp else (0,), dtype=out_dtype)
    lse = q8.new_empty((b, h, s_q), dtype=torch.float32)
    if o8_scale is None:
        return out, lse, q8.new_empty(0)
    out8 = (q8.new_empty((s_q, b, h, d)).transpose(0, 1) if seq_first
            else q8.new_empty((b, s_q, h, d)))
    return out, lse, out8


__all__ = ["flash_attn_fwd", "flash_attn_bwd", "flash_attn_fp8_fwd"]
