"""FP8 core: formats, recipes, scaling state, Float8Tensor and fp8_autocast."""
from . import recipe
from .autocast import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from .formats import E4M3, E5M2, Format
from .recipe import DelayedScaling, Float8CurrentScaling
from .scaling import FP8Meta, ScalingState
from .tensor import Float8Tensor
from .block_tensor import Float8BlockTensor
from .formats import DType
from .global_state import (FP8GlobalStateManager, check_fp8_support, get_default_fp8_recipe,
                           get_default_recipe, is_fp8_available, is_fp8_block_scaling_available,
                           is_mxfp8_available, is_nvfp4_available)
from .model_init import fp8_model_init, quantized_model_init
from .quantized_tensor import QuantizedTensor
from .quantizer import Float8CurrentScalingQuantizer, Float8Quantizer, Quantizer

__all__ = ["recipe", "autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled", "E4M3",
           "E5M2", "Format", "DelayedScaling", "Float8CurrentScaling", "FP8Meta", "ScalingState",
           "Float8Tensor", "Float8BlockTensor", "DType", "FP8GlobalStateManager",
           "check_fp8_support",
           "get_default_recipe", "get_default_fp8_recipe", "fp8_model_init", "quantized_model_init",
           "is_fp8_available", "is_fp8_block_scaling_available",
           "is_mxfp8_available", "is_nvfp4_available", "QuantizedTensor", "Quantizer",
           "Float8Quantizer", "Float8CurrentScalingQuantizer"]
