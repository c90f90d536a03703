"""tritium.LayerNormLinear: a norm (LayerNorm or RMSNorm) followed by a Linear, TE's names.

Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `weight`, `bias` (or the
`<part>_weight` / `<part>_bias` of parameters_split). Everything a Linear does (FP8 under
fp8_autocast, weight caching, main_grad, return_bias) applies to the GEMM; the norm runs in fp32
math with one rounding to the input's dtype. With return_layernorm_output the norm's output is
returned too: (out, ln_out), or (out, bias, ln_out) with return_bias.

Not fused yet: the norm writes its high-precision output and the GEMM's cast reads it (the
fused norm + FP8 cast kernel is the next step for speed).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._norm_params import apply_norm, register_norm_params, reset_norm_params
from .linear import Linear


class LayerNormLinear(Linear):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, **linear_kwargs):
        self.normalization, self.eps = normalization, float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        super().__init__(in_features, out_features, **linear_kwargs)
        weight = self._parts("weight")[0]
        register_norm_params(self, in_features, normalization, zero_centered_gamma, weight.dtype,
                             weight.device)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "layer_norm_weight"):
            reset_norm_params(self, self.zero_centered_gamma)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self.layer_norm_weight)
        ln_out = apply_norm(self, inp, self.normalization, self.eps, self.zero_centered_gamma)
        out = super().forward(ln_out, is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, ln_out) if self.return_bias else (out, ln_out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}"
