"""Hugging Face Mixtral / Qwen3-MoE -> tritium: `convert_moe(model)` swaps each sparse-MoE block
for a te.MoE.

convert_moe(model) replaces, in place, every `model.model.layers[i].mlp` that is a transformers
sparse-MoE block (`MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`: router `gate.weight`
[E, H], experts `gate_up_proj` [E, 2F, H] with gate rows first, `down_proj` [E, H, F]) by a
`te.MoE` with MoEConfig(num_experts, topk, softmax scores) and swiglu experts; dense MLP layers
(Qwen3-MoE's mlp_only_layers) are left alone. The te.MoE's parameters take the values:
router_weight = gate.weight, experts_fc1.weight{e} = gate_up_proj[e] (gate then up: TE's swiglu
order, no reshuffle), experts_fc2.weight{e} = down_proj[e]. Attention, norms, embeddings and the
head stay HF's, so the model keeps HF's forward signature and outputs.

Routing: Mixtral (and Qwen3-MoE with norm_topk_prob=True) takes the top-k of softmax(logits) and
renormalises them to sum to 1, which is the softmax over the chosen logits, i.e. TE's
use_pre_softmax=False (same function; the fp32 results agree to rounding); Qwen3-MoE with
norm_topk_prob=False keeps the top-k softmax values: use_pre_softmax=True. The te.MoE is built without a norm (HF's post_attention_layernorm
stays in front of it) and in the dtype and on the device of the HF weights.

Not supported (clear errors): router_jitter_noise > 0; output_router_logits=True (HF's aux loss
reads the router modules that are replaced: use te.MoE's own `aux_loss`, MoEConfig's
aux_loss_coeff, instead); activations other than SiLU.
"""
from __future__ import annotations

import torch

from ..modules.moe import MoE, MoEConfig


def _layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"convert_moe: expected a Mixtral / Qwen3-MoE model, got "
                        f"{type(model).__name__} (no .model.layers)")
    return inner, layers


def _check_config(config) -> None:
    if getattr(config, "router_jitter_noise", 0.0):
        raise NotImplementedError("convert_moe: router_jitter_noise > 0 is not supported; set "
                                  "config.router_jitter_noise = 0.0")
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError("convert_moe: output_router_logits=True is not supported (the "
                                  "HF router modules are replaced); set it False and use "
                                  "te.MoE's aux_loss (MoEConfig.aux_loss_coeff)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"convert_moe: hidden_act={config.hidden_act!r}: only silu "
                                  "(swiglu experts) is supported")


@torch.no_grad()
def moe_from_hf_block(block, config) -> MoE:
    """A te.MoE holding the values of one sparse-MoE block (Mixtral / Qwen3-MoE)."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    e, two_f, h = gate_up.shape
    renormalise = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises
    cfg = MoEConfig(num_experts=e, topk=config.num_experts_per_tok,
                    use_pre_softmax=not renormalise)
    moe = MoE(h, two_f // 2, cfg, activation="swiglu", params_dtype=gate_up.dtype,
              device=gate_up.device)
    moe.router_weight.copy_(block.gate.weight)
    for i in range(e):
        getattr(moe.experts_fc1, f"weight{i}").copy_(gate_up[i])
        getattr(moe.experts_fc2, f"weight{i}").copy_(down[i])
    return moe


def convert_moe(model):
    """Swap every layer's MixtralSparseMoeBlock for a te.MoE (in place); returns the model."""
    inner, layers = _layers(model)
    config = getattr(model, "config", getattr(inner, "config", None))
    _check_config(config)
    converted = 0
    for layer in layers:
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "experts") or not hasattr(block, "gate"):
            continue
        layer.mlp = moe_from_hf_block(block, config)
        converted += 1
    if not converted:
        raise TypeError("convert_moe: no sparse-MoE block (mlp.gate + mlp.experts) found")
    return model


def to_hf_moe_state_dict(model) -> dict:
    """The converted model's state dict under HF's key names (Mixtral / Qwen3-MoE)."""
    _, layers = _layers(model)
    prefix = "model.layers" if hasattr(model, "model") else "layers"
    converted = tuple(f"{prefix}.{i}.mlp." for i, layer in enumerate(layers)
                      if isinstance(getattr(layer, "mlp", None), MoE))
    out = {k: v for k, v in model.state_dict().items() if not k.startswith(converted)}
    for i, layer in enumerate(layers):
        moe = layer.mlp
        if not isinstance(moe, MoE):
            continue
        e = moe.config.num_experts
        out[f"{prefix}.{i}.mlp.gate.weight"] = moe.router_weight.detach()
        out[f"{prefix}.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [getattr(moe.experts_fc1, f"weight{j}").detach() for j in range(e)])
        out[f"{prefix}.{i}.mlp.experts.down_proj"] = torch.stack(
            [getattr(moe.experts_fc2, f"weight{j}").detach() for j in range(e)])
    return out


__all__ = ["convert_moe", "moe_from_hf_block", "to_hf_moe_state_dict"]
