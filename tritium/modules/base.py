"""What every FP8-capable module shares: its FP8Meta, the per-call FP8 plan, checkpoints.

`FP8Module._fp8_plan(device)` reads the active fp8_autocast, makes the module's scaling states
match the recipe, registers them with the autocast region, and returns the `FP8Plan` for this
call, or None when neither FP8 nor calibration is on. The FP8 state goes into checkpoints through
get_extra_state/set_extra_state as tensors and plain values only.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fp8.autocast import current as current_autocast
from ..fp8.scaling import FP8Meta
from ..functional.linear import FP8Plan, WeightCache


class FP8Module(torch.nn.Module):
    def __init__(self, num_fwd_slots: int, num_bwd_slots: int):
        super().__init__()
        self.fp8_meta = FP8Meta(num_fwd_slots, num_bwd_slots)
        self._weight_cache = WeightCache()

    def _fp8_plan(self, device: torch.device, is_first_microbatch: Optional[bool]) -> Optional[FP8Plan]:
        state = current_autocast()
        if state is None or not (state.enabled or state.calibrating):
            return None
        meta = self.fp8_meta
        meta.prepare(state.recipe, device)
        first = state.region.register(meta.fwd, meta.bwd, state.recipe, state.group)
        if not state.enabled and meta.fwd is None:  # calibrating needs a delayed-scaling state
            return None
        return FP8Plan(recipe=state.recipe, fwd=meta.fwd, bwd=meta.bwd,
                       compute_in_fp8=state.enabled, region=state.region if first else None,
                       weight_cache=self._weight_cache, is_first_microbatch=is_first_microbatch)

    def get_extra_state(self):
        return self.fp8_meta.extra_state()

    def set_extra_state(self, state) -> None:
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        self.fp8_meta.load_extra_state(state, device)
        self._weight_cache.entry = None
