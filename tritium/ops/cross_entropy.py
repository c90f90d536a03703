"""Custom ops behind `tritium.functional.cross_entropy`, and the namespace with
`tritium.ref.cross_entropy`'s kernel-backed names (ce_stats, ce_grad, ce_fused; ce_loss is plain
PyTorch and traced as is).

Ops (tritium::...), what they write in place:
  ce_stats                 nothing ([4, T] fp32 statistics)
  ce_grad / ce_grad_in_x   grad / x (the gradient written over the logits: grad is x)
  ce_fused / ce_fused_in_x grad when given / x
The "_in_x" ops exist because the eager functions may be given the logits themselves as the
gradient buffer (`linear_cross_entropy`), and an op must not take one tensor both as a read-only
and a written argument; the namespace picks them when `grad is x`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _device
from ..ref import cross_entropy as ref_ce
from ._common import fresh, tritium_op


def _impl(t: Tensor):
    if _device.use_triton(t):
        from ..kernels import cross_entropy as kernel_ce
        return kernel_ce
    return ref_ce


@tritium_op("tritium::ce_stats", mutates_args=())
def _stats(x: Tensor, target: Tensor, vocab_start: int) -> Tensor:
    return fresh((_impl(x).ce_stats(x, target, vocab_start),), (x, target))[0]


@_stats.register_fake
def _(x, target, vocab_start):
    return x.new_empty((4, x.shape[0]), dtype=torch.float32)


def ce_stats(x: Tensor, target: Tensor, vocab_start: int = 0) -> Tensor:
    return torch.ops.tritium.ce_stats(x, target, vocab_start)


@tritium_op("tritium::ce_grad", mutates_args=("grad",))
def _grad(x: Tensor, target: Tensor, lse: Tensor, grad: Tensor, scale: Tensor, ignore_index: int,
          vocab_start: int, vocab_size: int, label_smoothing: float,
          lse_square_scale: float) -> None:
    _impl(x).ce_grad(x, target, lse, grad, scale, ignore_index, vocab_start, vocab_size,
                     label_smoothing, lse_square_scale)


@tritium_op("tritium::ce_grad_in_x", mutates_args=("x",))
def _grad_in_x(x: Tensor, target: Tensor, lse: Tensor, scale: Tensor, ignore_index: int,
               vocab_start: int, vocab_size: int, label_smoothing: float,
               lse_square_scale: float) -> None:
    _impl(x).ce_grad(x, target, lse, x, scale, ignore_index, vocab_start, vocab_size,
                     label_smoothing, lse_square_scale)


@_grad.register_fake
def _(x, target, lse, grad, scale, ignore_index, vocab_start, vocab_size, label_smoothing,
      lse_square_scale):
    return None


@_grad_in_x.register_fake
def _(x, target, lse, scale, ignore_index, vocab_start, vocab_size, label_smoothing,
      lse_square_scale):
    return None


def ce_grad(x: Tensor, target: Tensor, lse: Tensor, grad: Tensor, scale: Tensor,
            ignore_index: int, vocab_start: int, vocab_size: int, label_smoothing: float,
            lse_square_scale: float) -> None:
    if grad is x:
        torch.ops.tritium.ce_grad_in_x(x, target, lse, scale, ignore_index, vocab_start,
                                       vocab_size, label_smoothing, lse_square_scale)
    else:
        torch.ops.tritium.ce_grad(x, target, lse, grad, scale, ignore_index, vocab_start,
                                  vocab_size, label_smoothing, lse_square_scale)


@tritium_op("tritium::ce_fused", mutates_args=("grad",))
def _fused(x: Tensor, target: Tensor, grad: Optional[Tensor], scale: Tensor, ignore_index: int,
           label_smoothing: float, lse_square_scale: float) -> tuple[Tensor, Tensor]:
    return fresh(_impl(x).ce_fused(x, target, grad, scale, ignore_index, label_smoothing,
                                   lse_square_scale), (x, target, grad, scale))


@tritium_op("tritium::ce_fused_in_x", mutates_args=("x",))
def _fused_in_x(x: Tensor, target: Tensor, scale: Tensor, ignore_index: int,
                label_smoothing: float, lse_square_scale: float) -> tuple[Tensor, Tensor]:
    return fresh(_impl(x).ce_fused(x, target, x, scale, ignore_index, label_smoothing,
                                   lse_square_scale), (x, target, scale))


def _fake_loss_lse(x):
    return (x.new_empty((x.shape[0],), dtype=torch.float32),
            x.new_empty((x.shape[0],), dtype=torch.float32))


@_fused.register_fake
def _(x, target, grad, scale, ignore_index, label_smoothing, lse_square_scale):
    return _fake_loss_lse(x)


@_fused_in_x.register_fake
def _(x, target, scale, ignore_index, label_smoothing, lse_square_scale):
    return _fake_loss_lse(x)


def ce_fused(x: Tensor, target: Tensor, grad: Optional[Tensor], scale: Tensor, ignore_index: int,
             label_smoothing: float, lse_square_scale: float):
    if grad is x:
        return torch.ops.tritium.ce_fused_in_x(x, target, scale, ignore_index, label_smoothing,
                                               lse_square_scale)
    return torch.ops.tritium.ce_fused(x, target, grad, scale, ignore_index, label_smoothing,
                                      lse_square_scale)


ce_loss = ref_ce.ce_loss  # plain PyTorch on both paths

__all__ = ["ce_stats", "ce_grad", "ce_loss", "ce_fused"]
