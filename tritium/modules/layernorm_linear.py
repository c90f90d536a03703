"""tritium.LayerNormLinear: a norm (LayerNorm or RMSNorm) followed by a Linear, TE's names.

Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `weight`, `bias` (or the
`<part>_weight` / `<part>_bias` of parameters_split). Everything a Linear does (FP8 under
fp8_autocast, weight caching, main_grad, return_bias) applies to the GEMM; the norm runs in fp32
math with one rounding to the input's dtype. With return_layernorm_output the norm's output is
returned too: (out, ln_out), or (out, bias, ln_out) with return_bias.

Under fp8_autocast with DelayedScaling the norm writes the GEMM's fp8 input itself (norm + cast +
amax + transpose in one kernel, bit-identical to norm then cast; `tritium.functional.fused_cast`
says when it applies); the high-precision norm output is then written only for
return_layernorm_output. Under Float8BlockScaling the norm writes the GEMM's 1x128 input
blocks instead (rowwise, and columnwise when wgrad needs them; `kernels.norm_block_cast`,
bit-identical to norm then the Linear's quantize_blocks), also column-parallel, and under
sequence parallelism where the GEMM all-gathers fp8 blocks (each rank's token count a multiple
of 128: functional/block_sp.py; the norm's blocks of this rank's rows are gathered as they
are). Not where sequence parallelism gathers high precision (a 1x128 tile along the tokens
would span the ranks' rows), nor row-parallel. Other recipes, calibration and high precision:
norm, then the GEMM.

Tensor parallelism: as Linear (usually parallel_mode="column"). Under sequence parallelism the
norm runs on this rank's rows, its output (in fp8 when fused) is all-gathered before the GEMM,
ln_out (return_layernorm_output) is the local rows, and the norm's replicated parameters get
their gradients all-reduced over the TP group.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..functional.block_sp import norm_fusable_under_sp
from ..functional.fused_cast import block_norm_spec, fusable_state
from ._norm_params import norm_cast_spec, norm_then_gemm_input, register_norm_params, \
    reset_norm_params
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
        tp = self.tp.spec(type(self).__name__, self.parallel_mode)
        cast, state = None, fusable_state(inp)
        if state is not None:
            if not self._fp8_dims_ok:  # set once Linear.forward has checked (eager)
                self._check_fp8_dims()
            # under sequence parallelism the transpose is made after the fp8 gather
            need_t = torch.is_grad_enabled() and (self.fuse_wgrad_accumulation or any(
                w.requires_grad for w in self._parts("weight"))) and not self.sequence_parallel
            cast = norm_cast_spec(self, state.recipe, inp.device, need_t)
        elif tp is None or (tp.mode == "column" and (not tp.sequence_parallel
                                                     or norm_fusable_under_sp(inp))):
            # Float8BlockScaling: the norm writes the blocks (under sequence parallelism where
            # they are all-gathered as fp8 blocks: see the module note)
            wgrad = self.fuse_wgrad_accumulation or any(w.requires_grad
                                                        for w in self._parts("weight"))
            cast = block_norm_spec(inp, torch.is_grad_enabled() and wgrad)
            if cast is not None and not self._fp8_dims_ok:
                self._check_fp8_dims()
        gemm_in, ln_out = norm_then_gemm_input(self, inp, cast, self.return_layernorm_output, tp)
        out = super().forward(gemm_in, is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, ln_out) if self.return_bias else (out, ln_out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}"
