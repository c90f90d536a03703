"""Thin nn.Modules: they own parameters and FP8 state; forward is one functional call."""
from .base import FP8Module
from .linear import Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["FP8Module", "Linear", "LayerNorm", "RMSNorm"]
