"""The layer-norm parameters that LayerNormLinear and LayerNormMLP put in front of their GEMMs.

`normalization` is "LayerNorm" (params `layer_norm_weight`, `layer_norm_bias`) or "RMSNorm"
(`layer_norm_weight` only); with zero_centered_gamma the weight starts at 0 and (1 + weight)
is used. `apply_norm` runs the functional norm on any leading dims.
"""
from __future__ import annotations

import torch

from ..functional.norm import layer_norm, rms_norm

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def register_norm_params(module: torch.nn.Module, hidden: int, normalization: str,
                         zero_centered_gamma: bool, dtype: torch.dtype,
                         device: torch.device) -> None:
    check_normalization(normalization)
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = torch.nn.Parameter(init(hidden, dtype=dtype, device=device))
    bias = torch.zeros(hidden, dtype=dtype, device=device) if normalization == "LayerNorm" else None
    module.layer_norm_bias = None if bias is None else torch.nn.Parameter(bias)


def reset_norm_params(module: torch.nn.Module, zero_centered_gamma: bool) -> None:
    with torch.no_grad():
        module.layer_norm_weight.fill_(0.0 if zero_centered_gamma else 1.0)
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.zero_()


def apply_norm(module: torch.nn.Module, inp: torch.Tensor, normalization: str, eps: float,
               zero_centered_gamma: bool) -> torch.Tensor:
    if normalization == "LayerNorm":
        return layer_norm(inp, module.layer_norm_weight, module.layer_norm_bias, eps,
                          zero_centered_gamma)
    return rms_norm(inp, module.layer_norm_weight, eps, zero_centered_gamma)
