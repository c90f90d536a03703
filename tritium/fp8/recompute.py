"""FP8 state under activation recomputation (`tritium.distributed.checkpoint`).

A checkpointed function runs twice: the forward (its activations dropped) and, in backward, the
recompute. FP8 must see the recompute as the same forward, not a new one:
  * it uses the scales the forward used (the live ones update when the outermost fp8_autocast
    exits, before backward): each FP8 module's forward scales are copied the first time it runs
    inside the forward scope (`FrozenScales`) and the recompute reads the copy;
  * it records no amax (the forward did) and updates no scale (the region's forward update
    already ran; the backward update runs once, after the backward of the region's first
    module, which may be the recomputed one);
  * a weight cast cached by the forward (is_first_microbatch=True) is reused, not redone;
  * it runs under the fp8_autocast state that was active in the forward (recipe, amax group,
    region), re-entered without its exit-time update.
Modules ask `current()` for the active scope; outside a checkpoint it is None and costs nothing.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from .autocast import _state as _autocast_state
from .scaling import ScalingState


class FrozenScales:
    """A forward state's scales copied at one moment, recording nothing: what a recomputed
    forward must use, since the live scales update at autocast exit."""

    def __init__(self, state: ScalingState):
        self.scale = state.scale.detach().clone()
        self.fp8_dtype = state.fp8_dtype

    def scale_slot(self, i: int) -> torch.Tensor:
        return self.scale[i:i + 1]

    def amax_slot(self, i: int):
        return None


class RecomputeScope:
    """One checkpointed call: the frozen scales of the FP8 modules that ran in its forward."""

    def __init__(self, autocast_state, drops_saved_tensors: bool = False):
        self.autocast_state = autocast_state   # fp8_autocast state active at the forward
        self.frozen: dict[int, FrozenScales] = {}
        self.recomputing = False
        # torch's non-reentrant checkpoint: the forward runs with grad and its saved tensors
        # are dropped and recomputed (the reentrant one runs its forward without grad)
        self.drops_saved_tensors = drops_saved_tensors

    def forward_scales(self, state: Optional[ScalingState]):
        """The forward scales a module uses now: live (copied once) in the forward, the copy in
        the recompute."""
        if state is None:
            return None
        if self.recomputing:
            frozen = self.frozen.get(id(state))
            return frozen if frozen is not None else FrozenScales(state)
        self.frozen.setdefault(id(state), FrozenScales(state))
        return state


class _Local(threading.local):
    def __init__(self):
        self.scope: Optional[RecomputeScope] = None


_local = _Local()


def current() -> Optional[RecomputeScope]:
    return _local.scope


def drops_saved_tensors() -> bool:
    """Inside a non-reentrant checkpoint (its forward or its recompute): what an autograd
    Function keeps for backward must be saved tensors, which the checkpoint drops after the
    forward and recomputes, not attributes of ctx, which would stay alive."""
    scope = _local.scope
    return scope is not None and scope.drops_saved_tensors


@contextlib.contextmanager
def scope(s: RecomputeScope, recomputing: bool):
    """Run the forward (recomputing=False) or the recompute of a checkpointed call in `s`; the
    recompute re-enters the forward's fp8_autocast state."""
    before = _local.scope
    s.recomputing = recomputing
    _local.scope = s
    stack = _autocast_state.stack
    pushed = recomputing and s.autocast_state is not None
    if pushed:
        stack.append(s.autocast_state)
    try:
        yield
    finally:
        if pushed:
            stack.pop()
        _local.scope = before


__all__ = ["FrozenScales", "RecomputeScope", "current", "drops_saved_tensors", "scope"]
