"""TE's view of the FP8 state: `FP8GlobalStateManager`, the capability queries, the default recipe.

Frameworks built on TE (Megatron-style training loops, activation-recompute helpers, test suites)
ask `transformer_engine.pytorch.fp8.FP8GlobalStateManager` whether FP8 is on, with which recipe
and group, and save/restore the autocast state around recompute. tritium's state lives in
`fp8/autocast.py` (a thread-local stack of autocast entries) and `fp8/model_init.py` (the
fp8_model_init stack): every method here READS those, nothing here is a second copy, so the
answers can never disagree with what the modules do.

Semantics kept from TE: inside nested autocasts the innermost one answers; outside any,
`is_fp8_enabled()` is False, `get_fp8_recipe()` is the default recipe and `get_fp8_group()` None;
`is_first_fp8_module()` is True once per outermost autocast (then False); `reset()` drops all
open autocast / fp8_model_init state of the calling thread (TE's is per process; tritium's
autocast state is per thread, as torch.autocast's). Deliberately absent (they act on TE's global
amax buffers, which tritium does not have: each module's scaling state is registered with the
autocast region instead): `add_fp8_tensors_to_global_buffer`, `reduce_and_update_fp8_tensors`,
`autocast_enter` / `autocast_exit`, the recompute meta copies, the global weight-update skip
tensor. They raise, naming the tritium way; TE's other internal helpers (fp8_meta key names,
buffer keys) do not exist.

Capability queries (`is_fp8_available(return_reason=False)`, ...) follow TE's signatures; what
"available" means here is in `tritium/_device.py` (a recipe tritium implements runs everywhere,
emulated where there are no FP8 tensor cores, and the reason says so).
"""
from __future__ import annotations

from typing import Union

import torch

from .. import _device
import sys

from . import autocast as _  # noqa: F401  (the submodule; the package's `autocast` is the function)
from . import model_init as _  # noqa: F401,F811
from .recipe import DelayedScaling, Recipe

_autocast = sys.modules[__package__ + ".autocast"]
_model_init = sys.modules[__package__ + ".model_init"]


def _answer(result: tuple[bool, str], return_reason: bool) -> Union[bool, tuple[bool, str]]:
    return result if return_reason else result[0]


def is_fp8_available(return_reason: bool = False):
    """Delayed and per-tensor current scaling (TE's `is_fp8_available`)."""
    return _answer(_device.fp8_recipe_support(), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False):
    """Float8BlockScaling (native on Hopper, compute capability 9.0)."""
    return _answer(_device.block_recipe_support("Float8BlockScaling", "FP8 block scaling", (9, 0)),
                   return_reason)


def is_mxfp8_available(return_reason: bool = False):
    """MXFP8BlockScaling (native on Blackwell, compute capability 10.0)."""
    return _answer(_device.block_recipe_support("MXFP8BlockScaling", "MXFP8", (10, 0)),
                   return_reason)


def is_nvfp4_available(return_reason: bool = False):
    """NVFP4 is a Blackwell (FP4 tensor core) format that tritium does not implement."""
    return _answer((False, "NVFP4 is not implemented in tritium (a Blackwell FP4 format; "
                           "tritium targets Hopper)"), return_reason)


def is_bf16_available(return_reason: bool = False):
    """bfloat16 compute on the current device (TE's `is_bf16_available`)."""
    return _answer(_device.bf16_support(), return_reason)


def get_device_compute_capability() -> tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) without a GPU (TE needs one)."""
    return _device.device_compute_capability()


def get_cudnn_version() -> tuple[int, int, int]:
    """cuDNN (major, minor, patch) that torch loads; (0, 0, 0) without cuDNN."""
    return _device.cudnn_version()


def get_default_recipe() -> Recipe:
    """The recipe `fp8_autocast()` uses when none is given: DelayedScaling() (TE's Hopper
    default; TE picks MXFP8 on Blackwell, which tritium does not target)."""
    return DelayedScaling()


def _no_global_buffers(name: str, instead: str):
    def method(cls, *args, **kwargs):
        raise NotImplementedError(
            f"FP8GlobalStateManager.{name} is not provided by tritium: it has no global amax "
            f"buffers (each module's scaling state is registered with its autocast region). "
            f"{instead} See docs/porting.md.")
    method.__name__ = name
    return classmethod(method)


class FP8GlobalStateManager:
    """TE's `FP8GlobalStateManager`, answering from tritium's autocast / fp8_model_init state."""

    @classmethod
    def reset(cls) -> None:
        """Drop every open autocast and fp8_model_init of this thread (for tests that stopped
        inside one)."""
        _autocast.reset()
        _model_init.reset()

    # ------------------------------------------------------------------ autocast
    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return _autocast.is_fp8_enabled()

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        state = _autocast.current()
        return state is not None and state.calibrating

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The innermost autocast's recipe; outside any, an enabled fp8_model_init's (TE sets
        it too); else the default recipe."""
        state = _autocast.current()
        if state is not None:
            return state.recipe
        config = _model_init.fp8_params_config()
        return config[0] if config is not None else get_default_recipe()

    @classmethod
    def get_fp8_group(cls):
        state = _autocast.current()
        return None if state is None else state.group

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True the first time it is asked inside an outermost autocast, then False."""
        state = _autocast.current()
        if state is None or not state.region.first_module_query:
            return False
        state.region.first_module_query = False
        return True

    @classmethod
    def get_autocast_state(cls) -> tuple:
        """An opaque snapshot of this thread's autocast state, for `set_autocast_state`."""
        return _autocast.snapshot()

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        if not (isinstance(state, tuple) and len(state) == 2):
            raise TypeError("set_autocast_state: pass what get_autocast_state() returned")
        _autocast.restore(state)

    get_fp8_autocast_state = get_autocast_state   # TE 1.x / early 2.x names
    set_fp8_autocast_state = set_autocast_state

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """True while make_graphed_callables captures, or while a CUDA graph capture is under way
        on the current stream."""
        if _autocast._state.graph_capturing:
            return True
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------ fp8_model_init
    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Inside an enabled fp8_model_init / quantized_model_init."""
        return _model_init.fp8_params_config() is not None

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        config = _model_init.fp8_params_config()
        return config is not None and config[1]

    # ------------------------------------------------------------------ capabilities
    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        return is_fp8_available(return_reason=True)

    @classmethod
    def is_mxfp8_available(cls) -> tuple[bool, str]:
        return is_mxfp8_available(return_reason=True)

    @classmethod
    def is_fp8_block_scaling_available(cls) -> tuple[bool, str]:
        return is_fp8_block_scaling_available(return_reason=True)

    @classmethod
    def is_nvfp4_available(cls) -> tuple[bool, str]:
        return is_nvfp4_available(return_reason=True)

    # ------------------------------------------------------------------ TE internals, absent
    add_fp8_tensors_to_global_buffer = _no_global_buffers(
        "add_fp8_tensors_to_global_buffer", "tritium modules register themselves when they run "
        "inside fp8_autocast.")
    reduce_and_update_fp8_tensors = _no_global_buffers(
        "reduce_and_update_fp8_tensors", "Forward scales update when the outermost fp8_autocast "
        "exits, backward scales after the backward of its first FP8 module.")
    autocast_enter = _no_global_buffers("autocast_enter", "Use `with tritium.fp8_autocast(...)`.")
    autocast_exit = _no_global_buffers("autocast_exit", "Use `with tritium.fp8_autocast(...)`.")
    copy_forward_fp8_meta_tensors_for_recompute = _no_global_buffers(
        "copy_forward_fp8_meta_tensors_for_recompute", "A recompute inside tritium's modules "
        "(LayerNormMLP(checkpoint=True)) uses the forward's scales frozen by the module.")
    get_old_fp8_meta_tensors_for_recompute = _no_global_buffers(
        "get_old_fp8_meta_tensors_for_recompute", "Recompute scales are handled by the module.")
    restore_fp8_meta_tensors = _no_global_buffers(
        "restore_fp8_meta_tensors", "Recompute scales are handled by the module.")
    set_skip_fp8_weight_update_tensor = _no_global_buffers(
        "set_skip_fp8_weight_update_tensor", "The weight-cast skip flag is per graphed callable: "
        "make_graphed_callables(fp8_weight_caching=True) and is_first_microbatch= at each call.")
    get_skip_fp8_weight_update_tensor = _no_global_buffers(
        "get_skip_fp8_weight_update_tensor", "See make_graphed_callables(fp8_weight_caching=True).")


get_default_fp8_recipe = get_default_recipe  # TE's older name


def check_fp8_support() -> tuple[bool, str]:
    """TE's older name (`transformer_engine.pytorch.fp8.check_fp8_support`)."""
    return is_fp8_available(return_reason=True)


__all__ = ["FP8GlobalStateManager", "is_fp8_available", "is_mxfp8_available",
           "is_fp8_block_scaling_available", "is_nvfp4_available", "is_bf16_available",
           "get_device_compute_capability", "get_cudnn_version", "get_default_recipe",
           "get_default_fp8_recipe",
           "check_fp8_support"]
