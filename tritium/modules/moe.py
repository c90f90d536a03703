"""tritium.MoE: a mixture-of-experts MLP (router, permute, GroupedLinear experts, unpermute).

    x [..., H] --(optional norm)--> h --router (high precision)--> logits [T, E]
    probs, routing_map = fused_topk_with_score_function(logits, ...)        # config.router
    rows = moe_permute(h, routing_map)             # grouped expert by expert
    y    = experts_fc2(act(experts_fc1(rows, m_splits)), m_splits)           # GroupedLinear x2
    out  = moe_unpermute(y, row_id_map, merging_probs=probs)

Parameters: `layer_norm_weight` / `layer_norm_bias` (with `normalization`), `router_weight`
[E, H], `experts_fc1.weight{e}` [2F, H] for gated activations (gate rows [0, F), up rows
[F, 2F): TE's swiglu convention, the same as Mixtral's fused gate_up_proj) or [F, H],
`experts_fc2.weight{e}` [H, F]; no biases. Under fp8_autocast the expert GEMMs run in FP8
(each GroupedLinear with per-expert scales); the router, norm, activation and token movement
stay in high precision, as in TE/Megatron. `expert_bias` (config.router.expert_bias, sigmoid
scores only) is a float32 buffer of zeros that the training loop updates (aux-loss-free
balancing); it only steers the choice of experts.

Aux loss: with `aux_loss_coeff > 0`, each training forward with grad enabled stores the
switch-transformer load-balancing loss (TE's fused_moe_aux_loss, already times the coefficient)
in `self.aux_loss`; add it to the training loss. Otherwise `aux_loss` is None.

As TransformerLayer's MLP (documented composition, docs/moe.md): build the layer, then
`layer.layernorm_mlp = te.MoE(H, F, cfg, normalization=...)` with the layer's normalization
and eps; TransformerLayer calls it as it calls LayerNormMLP (`use_bias` is False, so nothing
extra is returned). return_layernorm_output (post-LN residuals) is not supported.

Not built: capacity factors / token dropping, expert parallelism, shared experts, FP8 for the
activation between the expert GEMMs (it is cast by experts_fc2's grouped cast).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .._device import default_device
from ..fp8.formats import HIGH_PRECISION_DTYPES
from ..functional.activation import ACTIVATIONS, GATED, activation as apply_activation
from ..functional.moe import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                              fused_topk_with_score_function, moe_permute, moe_unpermute)
from ._norm_params import apply_norm, register_norm_params, reset_norm_params
from .grouped_linear import GroupedLinear
from .linear import default_init


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How tokens are routed (TE's fused_topk_with_score_function arguments)."""

    num_experts: int
    topk: int = 2
    score_function: str = "softmax"     # "softmax" or "sigmoid"
    use_pre_softmax: bool = False       # softmax: softmax then top-k (else top-k, then softmax)
    num_groups: Optional[int] = None    # group-limited top-k (DeepSeek-V3)
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    expert_bias: bool = False           # sigmoid only: a bias that steers the choice
    aux_loss_coeff: float = 0.0

    def __post_init__(self):
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"MoEConfig: num_experts must be a positive int, got "
                             f"{self.num_experts!r}")
        if not isinstance(self.topk, int) or not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"MoEConfig: topk must be in [1, num_experts={self.num_experts}], "
                             f"got {self.topk!r}")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig: score_function must be 'softmax' or 'sigmoid', got "
                             f"{self.score_function!r}")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ValueError("MoEConfig: expert_bias needs score_function='sigmoid'")


class MoE(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, config: MoEConfig, *,
                 normalization: Optional[str] = None, eps: float = 1e-5,
                 zero_centered_gamma: bool = False, activation: str = "swiglu",
                 params_dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device, None] = "cuda",
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE: config must be a tritium.MoEConfig, got {type(config).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE: activation must be one of {ACTIVATIONS}, got {activation!r}")
        params_dtype = params_dtype or torch.get_default_dtype()
        if params_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"params_dtype must be one of {HIGH_PRECISION_DTYPES}, got "
                            f"{params_dtype}")
        device = default_device(device)
        self.hidden_size, self.ffn_hidden_size, self.config = hidden_size, ffn_hidden_size, config
        self.normalization, self.eps = normalization, float(eps)
        self.zero_centered_gamma, self.activation = zero_centered_gamma, activation
        self.use_bias = False  # what TransformerLayer asks an MLP
        self.init_method = init_method or default_init
        self.output_layer_init_method = output_layer_init_method or self.init_method
        if normalization is not None:
            register_norm_params(self, hidden_size, normalization, zero_centered_gamma,
                                 params_dtype, device)
        e = config.num_experts
        self.router_weight = torch.nn.Parameter(torch.empty(e, hidden_size, dtype=params_dtype,
                                                            device=device))
        fc1_rows = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        common = dict(bias=False, params_dtype=params_dtype, device=device)
        self.experts_fc1 = GroupedLinear(e, hidden_size, fc1_rows, init_method=self.init_method,
                                         **common)
        self.experts_fc2 = GroupedLinear(e, ffn_hidden_size, hidden_size,
                                         init_method=self.output_layer_init_method, **common)
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=device)
                             if config.expert_bias else None)
        self.aux_loss: Optional[torch.Tensor] = None
        self.reset_parameters(experts=False)

    def reset_parameters(self, experts: bool = True) -> None:
        if self.normalization is not None:
            reset_norm_params(self, self.zero_centered_gamma)
        with torch.no_grad():
            self.init_method(self.router_weight)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
        if experts:
            self.experts_fc1.reset_parameters()
            self.experts_fc2.reset_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        if not isinstance(inp, torch.Tensor) or inp.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE.forward: inp must be a tensor whose last dim is hidden_size="
                             f"{self.hidden_size}, got "
                             f"{tuple(inp.shape) if isinstance(inp, torch.Tensor) else inp!r}")
        cfg = self.config
        x = inp.reshape(-1, self.hidden_size)
        if self.normalization is not None:
            x = apply_norm(self, x, self.normalization, self.eps, self.zero_centered_gamma)
        logits = F.linear(x, self.router_weight.to(x.dtype))
        probs, routing_map = fused_topk_with_score_function(
            logits, cfg.topk, cfg.use_pre_softmax, cfg.num_groups, cfg.group_topk,
            cfg.scaling_factor, cfg.score_function, self.expert_bias)
        counts = routing_map.sum(0)
        tokens = x.shape[0]
        rows, row_id_map = moe_permute(x, routing_map, num_out_tokens=tokens * cfg.topk)
        # the host needs the row counts (as TE's does): read after the permutation is queued,
        # so the GPU runs it while the host waits instead of idling after the read
        m_splits = counts.tolist()
        h = self.experts_fc1(rows, m_splits, is_first_microbatch)
        h = apply_activation(h, self.activation)
        y = self.experts_fc2(h, m_splits, is_first_microbatch)
        out = moe_unpermute(y, row_id_map, merging_probs=probs)
        self.aux_loss = None
        if cfg.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux_map, scores = fused_compute_score_for_moe_aux_loss(logits, cfg.topk,
                                                                   cfg.score_function)
            self.aux_loss = fused_moe_aux_loss(scores, aux_map.sum(0), tokens, cfg.num_experts,
                                               cfg.topk, cfg.aux_loss_coeff)
        return out.view(*inp.shape[:-1], self.hidden_size)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.config.num_experts}, topk={self.config.topk}, "
                f"activation={self.activation}, normalization={self.normalization}")
