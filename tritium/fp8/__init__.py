"""FP8 core: formats, recipes, scaling state, Float8Tensor and fp8_autocast."""
from . import recipe
from .autocast import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from .formats import E4M3, E5M2, Format
from .recipe import DelayedScaling, Float8CurrentScaling
from .scaling import FP8Meta, ScalingState
from .tensor import Float8Tensor

__all__ = ["recipe", "autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled", "E4M3",
           "E5M2", "Format", "DelayedScaling", "Float8CurrentScaling", "FP8Meta", "ScalingState",
           "Float8Tensor"]
