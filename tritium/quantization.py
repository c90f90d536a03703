"""`tritium.quantization`, as TE 2.x's `transformer_engine.pytorch.quantization`: the autocast
contexts, the capability queries, the default recipe and `FP8GlobalStateManager`, in one import
path (they live in `tritium/fp8/`)."""
from .fp8.autocast import autocast, fp8_autocast  # noqa: F401
from .fp8.global_state import (FP8GlobalStateManager, check_fp8_support,  # noqa: F401
                               get_default_recipe, is_fp8_available,
                               is_fp8_block_scaling_available, is_mxfp8_available,
                               is_nvfp4_available)
from .fp8.model_init import fp8_model_init, quantized_model_init  # noqa: F401

__all__ = ["autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init",
           "FP8GlobalStateManager", "check_fp8_support", "get_default_recipe", "is_fp8_available",
           "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available"]
