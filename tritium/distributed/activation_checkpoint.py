"""`checkpoint`: TE's activation recomputation, FP8-aware (te.distributed.checkpoint).

    out = checkpoint(block, x, distribute_saved_activations=False, get_rng_state_tracker=None,
                     tp_group=None, use_reentrant=True, **kwargs)

runs `block(x, **kwargs)` without keeping its activations and runs it again in backward. What
that takes beyond torch.utils.checkpoint (see tritium/fp8/recompute.py): the recompute uses the
forward's FP8 scales (a frozen copy), records no amax and updates no scale, reuses the weight
casts the forward cached, and runs under the forward's fp8_autocast state (recipe, amax group,
region, so the region's backward scale update still runs once). RNG: the default CPU and CUDA
generators and, with `get_rng_state_tracker`, the tracker's named states are replayed, so
dropout draws the same masks.

use_reentrant=True (TE's default) is an autograd Function that saves only the inputs;
use_reentrant=False is torch's non-reentrant checkpoint with the FP8 scope as its context_fn.
distribute_saved_activations (reentrant only): the first argument is kept as this rank's
1/tp_size share (flattened) and all-gathered over tp_group before the recompute (Megatron's
memory saving when that input is replicated over the TP group).
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from ..fp8 import recompute
from ..fp8.autocast import current as current_autocast
from .tensor_parallel import all_gather_dim0, resolve_group


def _rng_states():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


@contextlib.contextmanager
def _tracker_replay(tracker, states):
    """Inside: the tracker's states as they were at the forward; after: as before the block."""
    if tracker is None:
        yield
        return
    before = tracker().get_states()
    tracker().set_states(states)
    try:
        yield
    finally:
        tracker().set_states(before)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, kwargs, tracker, group, distribute, *args):
        ctx.run, ctx.kwargs, ctx.tracker, ctx.group = run, kwargs, tracker, group
        ctx.rng = _rng_states()
        ctx.tracker_states = None if tracker is None else tracker().get_states()
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        ctx.amp = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.scope = recompute.RecomputeScope(current_autocast())
        with torch.no_grad(), recompute.scope(ctx.scope, recomputing=False):
            outputs = run(*args, **kwargs)
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.distributed = None
        if distribute and tensors:
            first = tensors[0]
            ctx.distributed = (first.shape, first.requires_grad)
            n, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            tensors[0] = first.detach().reshape(-1).chunk(n)[r].clone()
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        tensors = list(ctx.saved_tensors)
        if ctx.distributed is not None:
            shape, req = ctx.distributed
            tensors[0] = all_gather_dim0(tensors[0], ctx.group).view(shape).requires_grad_(req)
        leaves = iter([t.detach().requires_grad_(t.requires_grad) for t in tensors])
        args = [next(leaves) if t else o for t, o in zip(ctx.is_tensor, ctx.others)]
        current = _rng_states()
        _set_rng_states(ctx.rng)
        dev, amp_on, amp_dtype = ctx.amp
        try:
            with torch.enable_grad(), recompute.scope(ctx.scope, recomputing=True), \
                    _tracker_replay(ctx.tracker, ctx.tracker_states), \
                    torch.autocast(dev, dtype=amp_dtype, enabled=amp_on):
                outputs = ctx.run(*args, **ctx.kwargs)
        finally:
            _set_rng_states(current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, None, None, None, None) + input_grads


def _non_reentrant_contexts(scope, tracker):
    states = None if tracker is None else tracker().get_states()

    @contextlib.contextmanager
    def recompute_ctx():
        with recompute.scope(scope, recomputing=True), _tracker_replay(tracker, states):
            yield
    return recompute.scope(scope, recomputing=False), recompute_ctx()


def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True, **kwargs):
    """TE's `transformer_engine.pytorch.distributed.checkpoint` (see the module docstring)."""
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("checkpoint: get_rng_state_tracker must be a function returning the "
                        "CudaRNGStatesTracker (as TE takes it), not the tracker itself")
    group = resolve_group(tp_group, "checkpoint")
    if distribute_saved_activations:
        if not use_reentrant:
            raise ValueError("checkpoint: distribute_saved_activations needs use_reentrant=True")
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("checkpoint: distribute_saved_activations needs torch.distributed "
                               "initialized and tp_group")
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        n = torch.distributed.get_world_size(group)
        if first is not None and first.numel() % n:
            raise ValueError(f"checkpoint: distribute_saved_activations splits the first input "
                             f"({tuple(first.shape)}, {first.numel()} elements) into tp_size={n} "
                             "equal parts; its size must be divisible by tp_size")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if use_reentrant:
        return _Checkpoint.apply(function, kwargs, get_rng_state_tracker, group,
                                 distribute_saved_activations, *args)
    scope = recompute.RecomputeScope(current_autocast(), drops_saved_tensors=True)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: _non_reentrant_contexts(scope, get_rng_state_tracker), **kwargs)


__all__ = ["checkpoint"]
