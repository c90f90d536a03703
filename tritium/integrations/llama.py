"""Llama-style weights <-> tritium.LayerNormMLP and tritium.TransformerLayer.

A Llama MLP block is `down_proj(silu(gate_proj(h)) * up_proj(h))` with `h = RMSNorm(x)`.
LayerNormMLP(hidden, ffn, bias=False, normalization="RMSNorm", activation="swiglu") computes the
same thing with one fused fc1: its FIRST F rows are gate_proj (they go through SiLU) and its
SECOND F rows are up_proj (they multiply). `load_llama_mlp` writes that layout (and the norm
weight, turned into 1 + w form when zero_centered_gamma), `llama_mlp_weights` reads it back.
Arguments may be tensors or modules with a `.weight` (nn.Linear, HF LlamaRMSNorm, ...).

A whole decoder layer: `load_llama_decoder_layer(layer, q_proj=..., k_proj=..., v_proj=...,
o_proj=..., input_layernorm=..., gate_proj=..., up_proj=..., down_proj=...,
post_attention_layernorm=...)` (or `**hf_llama_layer_weights(hf_decoder_layer)`) fills a
TransformerLayer built with RMSNorm, swiglu, bias=False and fuse_qkv_params=True, in the QKV
layout its qkv_weight_interleaved flag says (docs/porting.md).

Tensor-parallel modules (tp_size > 1, set_parallel_mode=True) take the FULL weights too and
keep this rank's shard of each (the module's `_tp_layout`: gate and up, and q, k and v of a
non-interleaved QKV, sharded per block); norm weights are replicated. Reading weights back
(`llama_mlp_weights`) needs a tp_size=1 module.
"""
from __future__ import annotations

import torch

from ..distributed.tensor_parallel import shard_tensor
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


def _copy_full(module, name: str, full: torch.Tensor) -> None:
    """Copy `full` into module.<name>, or this rank's shard of it for a TP-sharded param."""
    layout = module._tp_layout().get(name)
    if layout is not None:
        dim, blocks = layout
        rank = module.tp.rank(type(module).__name__)
        full = shard_tensor(full, dim, blocks, module.tp.size, rank)
    getattr(module, name).copy_(full)


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
        _copy_full(mlp, "fc1_weight", torch.cat([gate, up]))
        _copy_full(mlp, "fc2_weight", down)
        mlp.layer_norm_weight.copy_(norm - 1 if mlp.zero_centered_gamma else norm)
    mlp._clear_weight_caches()


def llama_mlp_weights(mlp) -> dict:
    """The Llama names for `mlp`'s weights: gate_proj, up_proj, down_proj, norm_weight."""
    _check_module(mlp)
    if mlp.tp.size > 1:
        raise NotImplementedError("llama_mlp_weights reads a whole MLP: this one holds a "
                                  f"tensor-parallel shard (tp_size={mlp.tp.size}); gather it "
                                  "first (tensor_parallel.gather_full_state_dict)")
    f = mlp.ffn_hidden_size
    w = mlp.fc1_weight.detach()
    norm = mlp.layer_norm_weight.detach()
    return {"gate_proj": w[:f].clone(), "up_proj": w[f:].clone(),
            "down_proj": mlp.fc2_weight.detach().clone(),
            "norm_weight": (norm + 1) if mlp.zero_centered_gamma else norm.clone()}


def hf_llama_layer_weights(hf_layer) -> dict:
    """The keyword arguments of load_llama_decoder_layer from an HF LlamaDecoderLayer."""
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    return dict(q_proj=attn.q_proj, k_proj=attn.k_proj, v_proj=attn.v_proj, o_proj=attn.o_proj,
                input_layernorm=hf_layer.input_layernorm, gate_proj=mlp.gate_proj,
                up_proj=mlp.up_proj, down_proj=mlp.down_proj,
                post_attention_layernorm=hf_layer.post_attention_layernorm)


def load_llama_decoder_layer(layer, *, q_proj, k_proj, v_proj, o_proj, input_layernorm,
                             gate_proj, up_proj, down_proj, post_attention_layernorm) -> None:
    """Copy one Llama decoder layer's weights into a tritium TransformerLayer (all shapes are
    checked before anything is written)."""
    attn = layer.self_attention
    if not (attn.input_layernorm and attn.fuse_qkv_params and attn.attention_type == "self"):
        raise ValueError("build the TransformerLayer with fuse_qkv_params=True (one fused QKV "
                         "weight) and without output_layernorm to load Llama weights into it")
    qkv = attn.layernorm_qkv
    if qkv.normalization != "RMSNorm" or qkv.use_bias:
        raise ValueError("a Llama layer uses RMSNorm and no bias: build the TransformerLayer "
                         "with normalization=\"RMSNorm\", bias=False")
    h, g, d = attn.num_attention_heads, attn.num_gqa_groups, attn.hidden_size_per_attention_head
    hidden = attn.hidden_size
    q, k, v = (_tensor(n, t) for n, t in (("q_proj", q_proj), ("k_proj", k_proj),
                                          ("v_proj", v_proj)))
    o, norm = _tensor("o_proj", o_proj), _tensor("input_layernorm", input_layernorm)
    for name, t, shape in (("q_proj", q, (h * d, hidden)), ("k_proj", k, (g * d, hidden)),
                           ("v_proj", v, (g * d, hidden)), ("o_proj", o, (hidden, h * d)),
                           ("input_layernorm", norm, (hidden,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for "
                             f"hidden_size={hidden}, heads={h}, gqa_groups={g}, head_dim={d}")
    if attn.qkv_weight_interleaved:  # per KV group: its query heads, its key head, its value head
        fused = torch.cat([q.view(g, h // g, d, hidden), k.view(g, 1, d, hidden),
                           v.view(g, 1, d, hidden)], dim=1).reshape(-1, hidden)
    else:
        fused = torch.cat([q, k, v])
    mlp_weights = dict(gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj,
                       norm_weight=post_attention_layernorm)
    load_llama_mlp(layer.layernorm_mlp, **mlp_weights)  # checks its shapes before writing
    with torch.no_grad():
        _copy_full(qkv, "weight", fused)
        qkv.layer_norm_weight.copy_(norm - 1 if qkv.zero_centered_gamma else norm)
        _copy_full(attn.proj, "weight", o)
    qkv._clear_weight_caches()
    attn.proj._clear_weight_caches()
