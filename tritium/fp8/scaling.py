"""Delayed-scaling state: per module and direction, `scale` fp32 [n] and `amax_history` [L, n].

A module owns an `FP8Meta` with a forward `ScalingState` (slots: its forward GEMM operands, e.g.
input and weight) and a backward one (grad_output). Casts max-accumulate their amax into row 0
(`amax_slot(i)`) and read their scale from `scale_slot(i)`: both are views made once, so kernels
read device memory and the host never syncs. `update_states` applies the delayed-scaling rule
(written in `tritium.ref.scaling`) to a list of states after one MAX all-reduce of their row 0s,
in one launch for all of them where they share the kernel's constants.

FP8Meta.extra_state() / load_extra_state() turn the state into tensors and plain values only
(the recipe as a dict), so `torch.load(weights_only=True)` reads checkpoints that hold it.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from .. import _device, _env
from ..distributed.amax import group_world_size, reduce_amax_rows
from ..ops import scaling as ops_scaling
from ..ref import scaling as ref_scaling
from .formats import fp8_max
from .recipe import DelayedScaling, Recipe, recipe_from_dict


class ScalingState:
    """amax_history [L, n] and scale [n] for one module and one direction."""

    def __init__(self, num_slots: int, fp8_dtype: torch.dtype, recipe: DelayedScaling,
                 device: torch.device):
        self.fp8_dtype = fp8_dtype
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, num_slots, dtype=torch.float32,
                                        device=device)
        self.scale = torch.ones(num_slots, dtype=torch.float32, device=device)
        self._make_views()

    def _make_views(self):
        # Static inputs for torch.compile (what torch._dynamo.mark_static_address(t) sets,
        # without importing dynamo): the compiled step updates these buffers in place, which
        # CUDA graphs (mode="reduce-overhead") allow only for inputs at fixed addresses.
        for t in (self.amax_history, self.scale):
            t._dynamo_static_input_type = "unguarded"
        n = self.scale.numel()
        self._amax_views = [self.amax_history[0, i:i + 1] for i in range(n)]
        self._amax_row = self.amax_history[0]  # what update_states all-reduces
        self._scale_views = [self.scale[i:i + 1] for i in range(n)]
        self._update_fn, self._update_for = None, None
        self._fused = None  # see _prepared

    @property
    def num_slots(self) -> int:
        return self.scale.numel()

    # The slot views are made once (host time). A compiled graph makes its own views of the
    # buffers instead (one graph input per buffer, no aliased inputs), and reads a scale through
    # `read_scale`, an op the partitioner cannot recompute: the scale changes in place when
    # fp8_autocast exits, so a backward that recomputed a cast from it would be wrong.
    def amax_slot(self, i: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.amax_history[0, i:i + 1]
        return self._amax_views[i]

    def scale_slot(self, i: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return ops_scaling.read_scale(self.scale)[i:i + 1]  # one read per state (CSE)
        return self._scale_views[i]

    def resize_history(self, length: int) -> None:
        """A new [length, n] history keeping row 0 (the amax being gathered) and the newest
        min(old, new) - 1 finished amaxes. Each update rolls row 0 to the end, so the newest
        finished amax is the last row and the order is kept by aligning the ends."""
        old = self.amax_history
        new = torch.zeros(length, old.shape[1], dtype=old.dtype, device=old.device)
        new[0] = old[0]
        keep = min(length, old.shape[0]) - 1
        if keep > 0:
            new[length - keep:] = old[old.shape[0] - keep:]
        self.amax_history = new
        self._make_views()

    def update(self) -> None:
        """The delayed-scaling rule, in place (see tritium.ref.scaling)."""
        if torch.compiler.is_compiling():  # the custom op: no cached launch closure in a graph
            if self.recipe.uses_callables:
                return self._update_with_callables()
            return ops_scaling.delayed_scaling_update(
                self.amax_history, self.scale, fp8_max(self.fp8_dtype), self.recipe.margin,
                self.recipe.amax_compute_algo)
        # The update is prepared once per recipe, history and FORCE_REF setting: it runs for
        # every state twice a step, and choosing the implementation each time is host time.
        key = (self.recipe, _env.force_ref())
        if self._update_for != key:
            self._update_fn, self._update_for = self._prepare_update(), key
        self._update_fn()

    def _prepare_update(self):
        recipe, limit = self.recipe, fp8_max(self.fp8_dtype)
        if recipe.uses_callables:
            return self._update_with_callables
        args = (self.amax_history, self.scale, limit, recipe.margin, recipe.amax_compute_algo)
        if _device.use_triton(self.scale):
            from ..kernels import scaling as kernel_scaling
            if self.amax_history.shape[0] <= kernel_scaling.MAX_HISTORY:
                return kernel_scaling.prepared_update(*args)
        return functools.partial(ref_scaling.delayed_scaling_update, *args)

    def _update_with_callables(self) -> None:
        recipe, limit = self.recipe, fp8_max(self.fp8_dtype)
        algo = recipe.amax_compute_algo
        if callable(algo):
            amax = algo(self.amax_history)
        elif algo == "max":
            amax = self.amax_history.amax(dim=0)
        else:
            amax = self.amax_history[0].clone()
        if recipe.scaling_factor_compute_algo is not None:
            new_scale = recipe.scaling_factor_compute_algo(amax, self.scale, limit, recipe)
        else:
            new_scale = ref_scaling.compute_scale(amax, self.scale, limit, recipe.margin)
        ref_scaling.roll_history(self.amax_history, self.scale, new_scale)


def update_states(states: list[ScalingState], group=None, reduce: bool = True) -> None:
    """One MAX all-reduce of all row 0s (when asked and world > 1), then each state's update:
    all in one launch where they share a kernel's constants (see `_prepared`)."""
    if not states:
        return
    if torch.compiler.is_compiling():  # the graph's own views of the buffers, state by state
        if reduce:
            reduce_amax_rows([s.amax_history for s in states], group)
        for s in states:
            s.update()
        return
    _, fused, rows, flat, parts, _ = _prepared(states)
    if reduce and group_world_size(group) > 1:
        if flat is None:  # (CUDA graph capture: no buffer kept)
            reduce_amax_rows([s.amax_history for s in states], group)
        else:  # into the kept buffer, reduced, copied back in one call through its kept views
            torch.cat(rows, out=flat)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            torch._foreach_copy_(rows, parts)
    if fused is not None:
        return fused()
    for s in states:
        s.update()


def _prepared(states: list[ScalingState]) -> tuple:
    """(sig, fused update, row 0s, reduction buffer, its views per state, refs) of `states`.
    An fp8_autocast region updates the same states every step, so this is made once and kept
    on the first state, keyed by the identities of the states and their tensors (the entry
    holds those objects, so their ids stay theirs) and by the recipes' values.
    The fused update is all `states` as one prepared launch
    (`kernels.scaling.prepared_update_many`), or None where they need more than one (one
    state, callables, several fp8 dtypes, margins, algorithms or history lengths, several
    devices, the reference path) or a table cannot be uploaded now (CUDA graph capture). The
    reduction buffer (None while capturing: made per call then) takes the row 0s for the
    amax all-reduce."""
    head = states[0]
    sig = [_env.force_ref()]
    for s in states:
        sig += (id(s), id(s.amax_history), id(s.scale), s.recipe)  # recipes: by value
    cached = head._fused
    if cached is not None and cached[0] == sig:
        return cached
    fn = None
    r0, dev = head.recipe, head.scale.device
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    consts = (head.fp8_dtype, r0.margin, r0.amax_compute_algo, head.amax_history.shape[0])
    if len(states) > 1 and all(
            not s.recipe.uses_callables and s.scale.device == dev and
            (s.fp8_dtype, s.recipe.margin, s.recipe.amax_compute_algo,
             s.amax_history.shape[0]) == consts for s in states) and _device.use_triton(head.scale):
        from ..kernels import scaling as kernel_scaling
        if consts[3] <= kernel_scaling.MAX_HISTORY and not capturing:
            fn = kernel_scaling.prepared_update_many(
                [s.amax_history for s in states], [s.scale for s in states],
                fp8_max(head.fp8_dtype), r0.margin, r0.amax_compute_algo)
    rows = [s._amax_row for s in states]
    flat = parts = None
    if not capturing and all(r.device == dev for r in rows):
        sizes = [r.numel() for r in rows]
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
        parts = flat.split(sizes)
    head._fused = (sig, fn, rows, flat, parts, [(s, s.amax_history, s.scale) for s in states])
    return head._fused


class FP8Meta:
    """A module's FP8 scaling states: `fwd` (num_fwd slots) and `bwd` (num_bwd slots)."""

    def __init__(self, num_fwd: int, num_bwd: int):
        self.num_fwd, self.num_bwd = num_fwd, num_bwd
        self.recipe: Optional[Recipe] = None
        self._prepared_for: Optional[torch.device] = None
        self.fwd: Optional[ScalingState] = None
        self.bwd: Optional[ScalingState] = None

    def prepare(self, recipe: Recipe, device: torch.device) -> None:
        """Make the states match `recipe` (create, or resize the history, keeping scales)."""
        if recipe is self.recipe and device == self._prepared_for:
            return  # the common case, every step: nothing to check again
        if self._needs_new_tensors(recipe, device):
            self._make_states(recipe, device)
        self.recipe, self._prepared_for = recipe, device
        for state in (self.fwd, self.bwd):
            if state is not None and isinstance(recipe, DelayedScaling):
                state.recipe = recipe

    def _needs_new_tensors(self, recipe: Recipe, device: torch.device) -> bool:
        if not isinstance(recipe, DelayedScaling):
            return False
        fmt = recipe.fp8_format
        return any(state is None or state.fp8_dtype != dtype or state.scale.device != device
                   or state.amax_history.shape[0] != recipe.amax_history_len
                   for state, dtype in ((self.fwd, fmt.forward_dtype),
                                        (self.bwd, fmt.backward_dtype)))

    @torch.compiler.disable
    def _make_states(self, recipe: DelayedScaling, device: torch.device) -> None:
        # Eager even under torch.compile: the state tensors must live outside any graph (a
        # graph's own tensors cannot take the compiled backward's in-place updates). That costs
        # a graph break on a module's first call under a recipe; `tritium.prepare_fp8` before
        # compiling avoids it (docs/compile.md).
        fmt = recipe.fp8_format
        for name, n, dtype in (("fwd", self.num_fwd, fmt.forward_dtype),
                               ("bwd", self.num_bwd, fmt.backward_dtype)):
            state = getattr(self, name)
            if state is None or state.fp8_dtype != dtype or state.scale.device != device:
                setattr(self, name, ScalingState(n, dtype, recipe, device))
            elif state.amax_history.shape[0] != recipe.amax_history_len:
                state.resize_history(recipe.amax_history_len)

    # --- checkpoints -------------------------------------------------------------------------
    def extra_state(self) -> Optional[dict]:
        if self.recipe is None:
            return None
        out = {"version": 1, "recipe": self.recipe.to_dict()}
        for name in ("fwd", "bwd"):
            state = getattr(self, name)
            if state is not None:
                out[f"{name}_scale"] = state.scale.detach().clone()
                out[f"{name}_amax_history"] = state.amax_history.detach().clone()
        return out

    def load_extra_state(self, values, device: torch.device) -> None:
        """Validate everything first, then apply: a bad checkpoint changes nothing."""
        if values is None:
            return
        if not isinstance(values, dict) or values.get("version") != 1 or "recipe" not in values:
            raise ValueError("FP8 extra_state must be a dict with version 1 and a recipe "
                             f"(as written by get_extra_state), got {type(values).__name__}")
        recipe = recipe_from_dict(values["recipe"])
        staged = {}
        if isinstance(recipe, DelayedScaling):
            for name, n in (("fwd", self.num_fwd), ("bwd", self.num_bwd)):
                scale, hist = values.get(f"{name}_scale"), values.get(f"{name}_amax_history")
                if not (isinstance(scale, torch.Tensor) and isinstance(hist, torch.Tensor)):
                    raise ValueError(f"FP8 extra_state lacks {name}_scale / {name}_amax_history")
                if scale.shape != (n,) or hist.shape != (recipe.amax_history_len, n) or \
                        scale.dtype != torch.float32 or hist.dtype != torch.float32:
                    raise ValueError(
                        f"FP8 extra_state {name}: expected scale [{n}] and amax_history "
                        f"[{recipe.amax_history_len}, {n}] in float32, got {tuple(scale.shape)} "
                        f"{scale.dtype} and {tuple(hist.shape)} {hist.dtype}; was it saved from "
                        "a module of another kind?")
                staged[name] = (scale, hist)
        self.prepare(recipe, device)
        for name, (scale, hist) in staged.items():
            state = getattr(self, name)
            state.scale.copy_(scale)
            state.amax_history.copy_(hist)
