"""fp8_autocast / autocast: where FP8 is on, with which recipe, and when scales update.

The outermost `fp8_autocast` opens an `FP8Region`. Every FP8 module that runs inside registers
its forward and backward scaling states there (once per state). When the outermost context
exits with grad enabled, the region all-reduces (MAX) the forward amaxes over the amax group in
one collective and updates every forward scale. The backward states update after the backward
of the region's first FP8 module (which in a sequential model runs last), through
`FP8Region.backward_done()`, called from that module's autograd Function.

This thread-local stack is THE autocast state: `tritium.fp8.global_state.FP8GlobalStateManager`
(TE's view of it) reads it and keeps no copy; `snapshot()` / `restore()` save and put back the
whole stack (TE's get/set_autocast_state, used around activation recompute).

Calibration (`enabled=False, calibrating=True`) runs in high precision but records amaxes and
updates scales the same way, so FP8 can be switched on later with good scales.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional

import torch

from .recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                     Recipe)
from .scaling import ScalingState, update_states


class FP8Region:
    """The modules that ran inside one outermost autocast, and their pending updates."""

    def __init__(self):
        # keyed by the states themselves (identity hash; no id(), which torch.compile cannot
        # carry across the graph)
        self.fwd: dict[ScalingState, tuple[object, bool]] = {}
        self.bwd: dict[ScalingState, tuple[object, bool]] = {}
        self._bwd_updated = False
        self._first: Optional[ScalingState] = None
        # TE's FP8GlobalStateManager.is_first_fp8_module(): True once per outermost autocast.
        self.first_module_query = True

    def register(self, fwd: Optional[ScalingState], bwd: Optional[ScalingState], recipe: Recipe,
                 group, again: bool = False) -> bool:
        """Record a module's states; True when it is the first FP8 module of the region (with
        `again`, a recomputed forward: True when it is that module again)."""
        key = fwd if fwd is not None else bwd
        first = self._first is None
        if first:
            self._first = key
        elif again:
            first = key is self._first
        reduce = bool(getattr(recipe, "reduce_amax", False))
        for table, state in ((self.fwd, fwd), (self.bwd, bwd)):
            if state is not None:
                table.setdefault(state, (group, reduce))
        return first

    def register_forward(self, fwd: ScalingState, recipe: Recipe, group) -> None:
        """Record a forward-only state (FP8 attention's q/k/v scales): it updates at exit like
        the modules' forward states and never claims the region's backward update."""
        self.fwd.setdefault(fwd, (group, bool(getattr(recipe, "reduce_amax", False))))

    @staticmethod
    def _update(table) -> None:
        batches: dict[tuple, tuple[object, bool, list[ScalingState]]] = {}
        for state, (group, reduce) in table.items():
            batches.setdefault((group, reduce), (group, reduce, []))[2].append(state)
        for group, reduce, states in batches.values():
            update_states(states, group, reduce)

    def forward_done(self) -> None:
        self._update(self.fwd)

    def backward_done(self) -> None:
        if not self._bwd_updated:
            self._bwd_updated = True
            self._update(self.bwd)


@dataclasses.dataclass(frozen=True)
class AutocastState:
    enabled: bool
    calibrating: bool
    recipe: Recipe
    group: object
    region: FP8Region


class _ThreadState(threading.local):
    """Each thread has its own autocast stack (as torch.autocast does)."""

    def __init__(self):
        self.stack: list[AutocastState] = []
        self.graph_capturing = False  # set by make_graphed_callables while it captures


_state = _ThreadState()


def current() -> Optional[AutocastState]:
    """The innermost active autocast state, or None outside any fp8_autocast."""
    stack = _state.stack
    return stack[-1] if stack else None


def snapshot() -> tuple:
    """The whole autocast state of this thread, to hand back to `restore`."""
    return (tuple(_state.stack), _state.graph_capturing)


def restore(saved: tuple) -> None:
    """Put back a `snapshot()` (the stack entries, not copies: regions stay shared)."""
    stack, capturing = saved
    _state.stack[:] = list(stack)
    _state.graph_capturing = bool(capturing)


def reset() -> None:
    """Forget every open autocast of this thread (TE's FP8GlobalStateManager.reset())."""
    _state.stack.clear()
    _state.graph_capturing = False


def is_fp8_enabled() -> bool:
    state = current()
    return state is not None and state.enabled


def get_fp8_recipe() -> Recipe:
    state = current()
    return state.recipe if state is not None else DelayedScaling()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None):
    """Run FP8-capable modules in FP8 inside this context (TE's `fp8_autocast`)."""
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                   MXFP8BlockScaling)):
        raise TypeError("fp8_recipe must be recipe.DelayedScaling, Float8CurrentScaling, "
                        f"Float8BlockScaling or MXFP8BlockScaling, got {type(fp8_recipe).__name__}")
    if fp8_group is not None and not _is_process_group(fp8_group):
        raise TypeError("fp8_group must be a torch.distributed ProcessGroup (or None for the "
                        f"default group), got {type(fp8_group).__name__}")
    stack = _state.stack
    outermost = not stack
    region = FP8Region() if outermost else stack[-1].region
    entry = AutocastState(bool(enabled), bool(calibrating), fp8_recipe, fp8_group, region)
    stack.append(entry)
    try:
        yield
    finally:
        if stack and stack[-1] is entry:  # not after FP8GlobalStateManager.reset()
            stack.pop()
    if outermost and torch.is_grad_enabled():
        region.forward_done()


def _is_process_group(group) -> bool:
    try:
        import torch.distributed as dist
        return isinstance(group, dist.ProcessGroup)
    except Exception:  # pragma: no cover
        return False


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None):
    """TE's newer name for fp8_autocast (recipe=, amax_reduction_group=)."""
    return fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                        fp8_group=amax_reduction_group)
