"""`tritium.recipe`, as TE's `transformer_engine.common.recipe`."""
from .fp8.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,  # noqa: F401
                         Format, MMParams, MXFP8BlockScaling, QParams, Recipe)

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
           "Format", "Recipe", "MMParams", "QParams"]
