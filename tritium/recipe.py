"""`tritium.recipe`, as TE's `transformer_engine.common.recipe`."""
from .fp8.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: F401

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format"]
