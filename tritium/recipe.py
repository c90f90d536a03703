"""`tritium.recipe`, as TE's `transformer_engine.common.recipe`."""
from .fp8.recipe import (DelayedScaling, Float8CurrentScaling, Format, MMParams,  # noqa: F401
                         QParams, Recipe)

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format", "Recipe", "MMParams", "QParams"]
