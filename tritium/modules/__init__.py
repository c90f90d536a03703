"""Thin nn.Modules: they own parameters and FP8 state; forward is one functional call."""
from .base import FP8Module
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .moe import MoE, MoEConfig
from .multihead_attention import MultiheadAttention
from .norm import LayerNorm, RMSNorm
from .transformer_layer import TransformerLayer

__all__ = ["FP8Module", "LayerNormLinear", "LayerNormMLP", "Linear", "LayerNorm", "RMSNorm",
           "MultiheadAttention", "TransformerLayer"]
__all__ += ["GroupedLinear", "MoE", "MoEConfig"]
