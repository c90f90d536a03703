"""fp8_model_init / quantized_model_init: build modules whose GEMM weights are FP8 only.

Inside `with fp8_model_init(enabled=True, recipe=DelayedScaling()):` the FP8-capable modules
(Linear, LayerNormLinear, LayerNormMLP and what is built from them) turn each GEMM weight into a
`Float8Tensor` Parameter after initialising it in high precision. The module keeps no
high-precision copy: forward feeds the fp8 data straight to the GEMM (no cast), and an optimizer
with master weights (tritium.optimizers.FusedAdam(master_weights=True)) writes new fp8 data after
each step.

How a weight param is tied to its module (the contract the optimizer relies on):
  * `p._scale`  the module's forward scale slot of that weight (a view into its delayed-scaling
                state: read it, never write it); forward scales update at autocast exit as usual.
  * `p._amax`   row 0 of that slot's amax history: whoever writes new fp8 data (the optimizer)
                max-accumulates the new values' amax there, so the next update sees it.
  * `p._transpose` the fp8 transpose (dgrad needs it): whoever writes `_data` calls
                `p.data_written()` (refreshes it), readers call `p.transpose_data()`.
  * `p._scale_inv` written with the data as the exactly rounded 1/scale.

Decisions where TE is silent or differs:
  * The first scale comes from the initial weight's own amax (fp8_max / amax / 2^margin, as a
    current-scaling cast would pick), and that amax is recorded in history row 0. TE starts at
    scale 1, which flushes an init of std 0.02 to E4M3 subnormals; that is why TE needs
    `preserve_high_precision_init_val` to seed master weights. We keep the option (it stores the
    high-precision init on the CPU, read by `p.get_high_precision_init_val()` and dropped by
    `p.clear_high_precision_init_val()` or by loading a state dict into the module: the loaded
    weight replaces the init), but it is rarely needed.
  * Delayed scaling: the param's scale lives in the module's state (above). Current scaling
    (Float8CurrentScaling): each FP8 param owns its scale (`p._scale`, fp32 [1], not tied to
    any module state; `p._amax` None) and is marked `p._current_scaling = (amax_epsilon,
    power_2_scale)`. Its first scale comes from the initial weight's amax; after every
    optimizer step (and set_master_param) the optimizer recomputes the scale from the new
    master's amax and rewrites the fp8 data with it, so the data is always "current" (see
    `tritium/optimizers/_common.py`).
  * Float8BlockScaling: each GEMM weight becomes a `Float8BlockTensor` (fp8/block_tensor.py):
    128x128 blocks (w_block_scaling_dim=2, the default) or 1x128 tiles (=1), with the recipe's
    fp8_quant_fwd_weight QParams, rowwise and columnwise forms both kept. The block-scaled Linear
    reads them as they are; after every optimizer step (and set_master_param) the optimizer
    requantizes every block from the new fp32 master (`p.requantize_(master)`), so the bits are
    those the same recipe makes from a high-precision weight equal to the master.
    MXFP8BlockScaling and other recipes raise. FP8 params run under any fp8_autocast recipe:
    the fp8 data carries its own scale_inv (a block param under another recipe, or under a block
    recipe of another weight form, is dequantized and cast like a high-precision weight).
  * parameters_split is not supported with FP8 params yet (clear error).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe


class _ModelInitState(threading.local):
    def __init__(self):
        self.stack: list[tuple[Recipe, bool]] = []


_state = _ModelInitState()


def fp8_params_config() -> Optional[tuple[Recipe, bool]]:
    """(recipe, preserve_high_precision_init_val) of the innermost enabled fp8_model_init."""
    return _state.stack[-1] if _state.stack and _state.stack[-1] is not None else None


def reset() -> None:
    """Forget every open fp8_model_init of this thread (FP8GlobalStateManager.reset())."""
    _state.stack.clear()


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """Modules built inside hold their GEMM weights as FP8 params only (Float8Tensor, or
    Float8BlockTensor under Float8BlockScaling)."""
    if recipe is None:
        recipe = DelayedScaling()
    if enabled and not isinstance(recipe, (DelayedScaling, Float8CurrentScaling,
                                           Float8BlockScaling)):
        raise NotImplementedError(
            f"fp8_model_init(recipe={type(recipe).__name__}) is not supported; pass "
            "recipe.DelayedScaling(), recipe.Float8CurrentScaling() or "
            "recipe.Float8BlockScaling()")
    _state.stack.append((recipe, bool(preserve_high_precision_init_val)) if enabled else None)
    try:
        yield
    finally:
        _state.stack.pop()


quantized_model_init = fp8_model_init
