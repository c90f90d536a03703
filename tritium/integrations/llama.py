"""Llama-style MLP weights <-> tritium.LayerNormMLP.

A Llama MLP block is `down_proj(silu(gate_proj(h)) * up_proj(h))` with `h = RMSNorm(x)`.
LayerNormMLP(hidden, ffn, bias=False, normalization="RMSNorm", activation="swiglu") computes the
same thing with one fused fc1: its FIRST F rows are gate_proj (they go through SiLU) and its
SECOND F rows are up_proj (they multiply). `load_llama_mlp` writes that layout (and the norm
weight, turned into 1 + w form when zero_centered_gamma), `llama_mlp_weights` reads it back.
Arguments may be tensors or modules with a `.weight` (nn.Linear, HF LlamaRMSNorm, ...).
"""
from __future__ import annotations

import torch

from ..functional.activation import GATED


def _tensor(name: str, value) -> torch.Tensor:
    value = getattr(value, "weight", value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or a module with .weight, got {type(value).__name__}")
    return value.detach()


def _check_module(mlp) -> None:
    if mlp.activation not in GATED:
        raise ValueError(f"a Llama MLP needs a gated activation (swiglu for SiLU); this "
                         f"LayerNormMLP has activation={mlp.activation!r}")
    if mlp.normalization != "RMSNorm":
        raise ValueError("a Llama MLP uses RMSNorm: build LayerNormMLP(normalization=\"RMSNorm\")")
    if mlp.fc1_bias is not None or mlp.fc2_bias is not None:
        raise ValueError("Llama's projections have no bias: build LayerNormMLP(bias=False)")


def load_llama_mlp(mlp, *, gate_proj, up_proj, down_proj, norm_weight) -> None:
    """Copy Llama MLP weights into `mlp` (shapes checked first; nothing changes on error)."""
    _check_module(mlp)
    h, f = mlp.hidden_size, mlp.ffn_hidden_size
    gate, up = _tensor("gate_proj", gate_proj), _tensor("up_proj", up_proj)
    down, norm = _tensor("down_proj", down_proj), _tensor("norm_weight", norm_weight)
    for name, t, shape in (("gate_proj", gate, (f, h)), ("up_proj", up, (f, h)),
                           ("down_proj", down, (h, f)), ("norm_weight", norm, (h,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for "
                             f"hidden_size={h}, ffn_hidden_size={f}")
    with torch.no_grad():
        mlp.fc1_weight[:f].copy_(gate)
        mlp.fc1_weight[f:].copy_(up)
        mlp.fc2_weight.copy_(down)
        mlp.layer_norm_weight.copy_(norm - 1 if mlp.zero_centered_gamma else norm)
    mlp._clear_weight_caches()


def llama_mlp_weights(mlp) -> dict:
    """The Llama names for `mlp`'s weights: gate_proj, up_proj, down_proj, norm_weight."""
    _check_module(mlp)
    f = mlp.ffn_hidden_size
    w = mlp.fc1_weight.detach()
    norm = mlp.layer_norm_weight.detach()
    return {"gate_proj": w[:f].clone(), "up_proj": w[f:].clone(),
            "down_proj": mlp.fc2_weight.detach().clone(),
            "norm_weight": (norm + 1) if mlp.zero_centered_gamma else norm.clone()}
