"""`parallel_cross_entropy` (TE's name and signature) and the shared per-chunk cross-entropy step.

parallel_cross_entropy(inp, target, label_smoothing=0.0, reduce_loss=False,
dist_process_group=None, ignore_idx=-100), as TE 2.x:
  * inp: logits (B, SQ, V) or (SQ, B, V) (any leading dims; last dim contiguous), fp32, bf16 or
    fp16; target: integer class ids shaped like inp without its last dim.
  * the loss is fp32, per token (shaped like target) unless reduce_loss, which gives the mean
    over the tokens whose target is not ignore_idx (torch's `reduction="mean"`; NaN when every
    token is ignored, as torch). Ignored tokens have loss 0 and gradient 0.
  * label_smoothing: torch's definition, (1 - eps) one-hot + eps uniform over the V classes.
  * dist_process_group (vocab-parallel logits, Megatron's layout): every rank of the group holds
    the logits of all tokens for one contiguous slice of V_local = V / world classes, rank r
    the classes [r V_local, (r + 1) V_local); all ranks pass the same targets (global ids). The
    result equals the unsharded loss: the per-row max is all-reduced (MAX), then the rescaled
    sum of exponentials, the target's logit and the sum of the logits (SUM), two collectives
    per call, [T] and [3, T] fp32. Slices must all have the same size (not checked).
Gradient. The kernel writes the gradient in the same launch as the loss (`tritium.kernels.
cross_entropy`), into a new buffer shaped like inp, in inp's dtype: TE writes it over the
logits; tritium leaves the caller's logits intact (one more logits-sized buffer; the memory-lean
path is `linear_cross_entropy`, which never materializes the logits). The backward multiplies
that buffer by grad_output in place, so the graph can be back-propagated once (as TE).

`ce_chunk` is the step both public functions use: loss, lse and (optionally) the gradient of a
2D block of logits, vocab-parallel when a group of size > 1 is given.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _device
from ..ops import cross_entropy as ops_ce
from ..ref import cross_entropy as ref_ce

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_ce
    if _device.use_triton(t):
        from ..kernels import cross_entropy as kernel_ce
        return kernel_ce
    return ref_ce


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def ce_chunk(x: torch.Tensor, target: torch.Tensor, grad: Optional[torch.Tensor],
             scale: torch.Tensor, ignore_index: int, label_smoothing: float,
             lse_square_scale: float, group=None):
    """(loss [T], lse [T]) fp32 of logits x [T, V_local], the gradient (times `scale`, [1] or
    [T] fp32) written into `grad` (may be x) when given. With a group of size > 1, x is this
    rank's contiguous vocab slice and everything is the unsharded result."""
    impl = _impl(x)
    world = group_size(group)
    if world == 1:
        return impl.ce_fused(x, target, grad, scale, ignore_index, label_smoothing,
                             lse_square_scale)
    v = x.shape[1]
    start, vocab = dist.get_rank(group) * v, v * world
    stats = impl.ce_stats(x, target, start)
    m = stats[0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    rest = torch.stack([stats[1] * torch.exp(stats[0] - m), stats[2], stats[3]])
    dist.all_reduce(rest, op=dist.ReduceOp.SUM, group=group)
    loss, lse = ref_ce.ce_loss(torch.cat([m[None], rest]), target, ignore_index, vocab,
                               label_smoothing, lse_square_scale)
    if grad is not None:
        impl.ce_grad(x, target, lse, grad, scale, ignore_index, start, vocab, label_smoothing,
                     lse_square_scale)
    return loss, lse


def ce_grad_only(x, target, lse, grad, scale, ignore_index, label_smoothing, lse_square_scale,
                 group=None) -> None:
    """The gradient of a block of logits from a known (global) lse, e.g. in a recompute."""
    world = group_size(group)
    v = x.shape[1]
    start = dist.get_rank(group) * v if world > 1 else 0
    _impl(x).ce_grad(x, target, lse, grad, scale, ignore_index, start, v * world,
                     label_smoothing, lse_square_scale)


def check_common(name: str, target: torch.Tensor, lead_shape, label_smoothing,
                 lse_square_scale=0.0) -> None:
    if not isinstance(target, torch.Tensor) or target.is_floating_point() \
            or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"{name}: target must be an integer tensor of class ids, got "
                        f"{getattr(target, 'dtype', type(target).__name__)}")
    if tuple(target.shape) != tuple(lead_shape):
        raise ValueError(f"{name}: target has shape {tuple(target.shape)}, expected "
                         f"{tuple(lead_shape)} (one class id per token)")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1), got {label_smoothing}")
    if float(lse_square_scale) < 0.0:
        raise ValueError(f"{name}: lse_square_scale (z-loss weight) must be >= 0, got "
                         f"{lse_square_scale}")


def valid_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of non-ignored targets, fp32 [1], on the device (no host sync)."""
    return (target != ignore_index).sum().float().reshape(1)


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, target, label_smoothing, reduce_loss, group, ignore_idx):
        v = inp.shape[-1]
        x = inp.reshape(-1, v)
        if x.shape[0] and x.stride(1) != 1:
            x = x.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()
        grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        n = valid_count(t, ignore_idx)
        scale = 1.0 / n.clamp(min=1.0) if reduce_loss else torch.ones(1, device=x.device)
        loss, _ = ce_chunk(x, t, grad, scale, ignore_idx, label_smoothing, 0.0, group)
        ctx.grad, ctx.reduce, ctx.shape = grad, reduce_loss, inp.shape
        if reduce_loss:
            return loss.sum() / n.reshape(())   # a new tensor, not a view: FSDP2 warns on view outputs
        return loss.reshape(target.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("parallel_cross_entropy: backward through the same graph twice; "
                               "its gradient buffer is consumed by the first backward")
        ctx.grad = None
        g = grad_output.float() if ctx.reduce else grad_output.reshape(-1, 1).float()
        grad.mul_(g)
        return grad.view(ctx.shape), None, None, None, None, None


def parallel_cross_entropy(inp: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                           reduce_loss: bool = False, dist_process_group=None,
                           ignore_idx: int = -100) -> torch.Tensor:
    """Cross-entropy of logits `inp` (..., V) against class ids `target` (...), TE's
    `parallel_cross_entropy` (see the module docstring)."""
    if not isinstance(inp, torch.Tensor) or inp.dim() < 2:
        raise ValueError("parallel_cross_entropy: inp must be logits (B, SQ, V) or (SQ, B, V), "
                         f"got {getattr(inp, 'shape', type(inp).__name__)}")
    if inp.dtype not in _DTYPES:
        raise TypeError(f"parallel_cross_entropy: inp must be float32, bfloat16 or float16, got "
                        f"{inp.dtype}")
    check_common("parallel_cross_entropy", target, inp.shape[:-1], label_smoothing)
    if target.device != inp.device:
        raise ValueError(f"parallel_cross_entropy: target is on {target.device} but inp on "
                         f"{inp.device}; move it with target.to(inp.device)")
    return _ParallelCrossEntropy.apply(inp, target, float(label_smoothing), bool(reduce_loss),
                                       dist_process_group, int(ignore_idx))


__all__ = ["parallel_cross_entropy", "ce_chunk", "ce_grad_only"]
