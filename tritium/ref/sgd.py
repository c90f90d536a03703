"""Pure-PyTorch twin of `tritium.kernels.sgd`: one SGD step (torch.optim.SGD semantics) over a
list of tensors. The CPU path and the test oracle; bit for bit equal to the kernel (same fp32
ops in the same order; see `tritium.ref.adam` for why and for the weight read/write rules,
which are shared).

Per element, fp32 (w = master, or the param itself); `hp` = fp32 [lr, momentum,
1 - dampening, weight_decay]:
    d = grad
    weight decay on (and not wd_after_momentum):  d = d + w * wd
    momentum on:
        first step of this buffer:  buf = d             (torch.optim.SGD: no dampening then)
        otherwise:                  buf = buf * momentum + d * (1 - dampening)
        d = d + buf * momentum  (nesterov)   or   d = buf
    weight decay on and wd_after_momentum:  d = d + w * wd
    w = w - d * lr
The momentum buffer is fp32. Then the weight is stored as in `tritium.ref.adam.store_weight`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .adam import Fp8Meta, weight_in_place, store_weight

LR, MOMENTUM, OMD, WD = range(4)
NUM_HP = 4


def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             momentum_buffers: Optional[Sequence[torch.Tensor]],
             masters: Optional[Sequence[torch.Tensor]], fp8_meta: Optional[Sequence[Fp8Meta]],
             hp: torch.Tensor, *, weight_decay: bool, wd_after_momentum: bool, nesterov: bool,
             first: bool, cache: Optional[dict] = None) -> None:
    """One SGD step in place. momentum_buffers: fp32 tensors, or None for momentum 0 (with
    first=True their old contents are ignored and overwritten). See the module docstring."""
    lr, mom, omd, wd = (hp[i:i + 1] for i in range(NUM_HP))
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        p = p.view(-1)
        master = None if masters is None else masters[i].view(-1)
        w = weight_in_place(p, master, None)   # updated in place where it is fp32 state
        d = grads[i].reshape(-1).to(torch.float32, copy=True)
        if weight_decay and not wd_after_momentum:
            d += w * wd
        if momentum_buffers is not None:
            buf = momentum_buffers[i].view(-1)
            if first:
                buf.copy_(d)
            else:
                buf.mul_(mom).add_(d * omd)
            if nesterov:
                d += buf * mom
            else:
                d.copy_(buf)
        if weight_decay and wd_after_momentum:
            d += w * wd
        w.sub_(d.mul_(lr))
        store_weight(p, master, None, None if fp8_meta is None else fp8_meta[i], w)


__all__ = ["NUM_HP", "sgd_step"]
