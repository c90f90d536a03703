"""Hugging Face Llama <-> tritium: `convert_llama(model)` and `to_hf_state_dict(model)`.

convert_llama(model) replaces, in place, every decoder layer `model.model.layers[i]` of a
transformers `LlamaForCausalLM` (or `LlamaModel`) by a `TritiumLlamaDecoderLayer`: a thin
wrapper around one te.TransformerLayer (RMSNorm, swiglu, bias=False, GQA, fuse_qkv_params=True,
qkv_weight_interleaved=False, bshd, the config's rms_norm_eps and head_dim) filled by
`integrations/llama.py:load_llama_decoder_layer`, and the final norm `model.model.norm` by a
te.RMSNorm with the same weight and eps (one fused kernel each way, where HF's runs ~10 eager
ops and keeps an fp32 copy of the last hidden states for backward; the state-dict key is
unchanged). Everything else (embeddings, rotary embedding, lm_head, loss, generation plumbing)
stays HF's, so the model keeps HF's forward signature (input_ids, attention_mask, labels, ...)
and outputs.

Weights. "Sharing" means the TransformerLayer's parameters ARE the model's parameters from now
on: q/k/v are copied once into the fused QKV weight and gate/up into fc1, and the HF q/k/v/o,
MLP and norm modules of each layer are dropped (so `model.parameters()` holds each weight once;
an optimizer built after the conversion trains the tritium weights). The conversion copies
values; it does not alias storage (a fused QKV weight cannot be a view of three tensors).
`to_hf_state_dict(model)` maps back to HF's key names, in HF's order, for `save_pretrained`-
style use or `LlamaForCausalLM.load_state_dict`.

The wrapper's call signature is HF's decoder-layer one: (hidden_states, attention_mask=None,
position_ids=None, past_key_values=None, use_cache=False, position_embeddings=(cos, sin),
**kwargs). It returns a tensor where the installed LlamaModel expects one (transformers >= 4.54,
which does `hidden_states = decoder_layer(...)`) and a 1-tuple where LlamaModel reads
`layer_outputs[0]` (older versions); `_layer_returns_tuple()` decides from LlamaModel's source.
  * RoPE: the angles are recomputed in fp32 from position_ids and the model's own
    `rotary_emb.inv_freq` exactly as HF does (so rope scaling types that only change inv_freq,
    e.g. "linear", "llama3", "dynamic", are covered); types with an attention_scaling != 1
    (yarn, longrope) are refused. Batch rows with different position_ids run one at a time.
  * Masks: None -> causal (HF's sdpa path without padding); a 4D bool mask (True = attend) or
    additive float mask (0 = attend) -> TE's "arbitrary" mask (True = masked out). Query rows
    with no visible key give 0 (TE's convention; HF gives garbage there, which it ignores). A
    forward with neither attention_mask nor position_ids (nor a cache) skips HF's mask code: the
    converted LlamaModel hands it a marker that means causal (`_mark_causal`), where HF's
    packed-sequence check of its own arange positions would cost a device sync per forward.
  * The causal-LM loss (`LlamaForCausalLM`, fused_cross_entropy=True, the default): in training
    mode, `model(input_ids, labels=labels)` computes HF's loss (labels shifted left and padded
    with -100, mean over non-ignored tokens, or the sum / num_items_in_batch when that is passed,
    `shift_labels` and `ignore_index` as HF's ForCausalLMLoss takes them) through
    `tritium.linear_cross_entropy` from the final hidden states and lm_head.weight, so no
    tokens x vocab logits tensor is ever made, and returns `logits=None` (as Liger's
    fused linear cross-entropy does). Without labels, or in eval mode, the forward is HF's own
    (logits returned, HF's loss when labels are given). Tied embeddings work: lm_head.weight is
    the embedding's Parameter, and both gradients accumulate into it. fp8_lm_head=True runs the
    lm_head GEMMs in FP8 inside an enabled fp8_autocast (per-chunk current scaling, see
    functional/linear_cross_entropy.py); off by default.
  * Tensor and sequence parallelism (`tp_group=` a ProcessGroup or a DeviceMesh such as
    mesh["tp"], `sequence_parallel=`): the TransformerLayers are built with that group and
    set_parallel_mode=True (QKV and fc1 column-parallel, proj and fc2 row-parallel) and load
    this rank's shards of the HF weights (q, k, v and gate, up sharded per block); the heads,
    the KV heads and intermediate_size must divide by the group's size. Embeddings, the final
    norm, the rotary embedding and lm_head stay whole and replicated: every TP rank computes
    them identically (same weights, same batch). Under sequence parallelism the decoder layers
    are built sbhd and run on this rank's chunk of the sequence, [s / tp, b, h] (SP splits
    dim 0; in bshd that is the batch, which one sequence per rank cannot split): the first
    layer transposes the embeddings to [s, b, h] and takes its chunk (backward: all-gather),
    the last all-gathers its output and transposes it back, the gather's backward keeping
    this rank's chunk of the gradient (every rank computed the whole gradient). So the HF parts
    see whole [b, s, h] tensors and get identical gradients on every TP rank; attention sees
    the whole sequence after the QKV all-gather, so the mask and RoPE angles stay whole. Batch
    rows with different position_ids are not supported there, nor is `output_hidden_states`
    (the middle layers' outputs are this rank's chunks), and `to_hf_state_dict` needs a
    tp_size=1 model.
  * Not supported (clear errors): KV caches (convert_llama sets config.use_cache = False; an
    explicit use_cache=True or past_key_values raises: generate(..., use_cache=False) works), flex-attention BlockMask, attention/MLP biases, activations other than SiLU,
    output_attentions (there are no attention weights to return).
"""
from __future__ import annotations

import inspect
import types
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.tensor_parallel import (gather_from_sequence_parallel_region, resolve_group,
                                           scatter_to_sequence_parallel_region)
from ..functional.linear_cross_entropy import linear_cross_entropy

from .llama import hf_llama_layer_weights, llama_mlp_weights, load_llama_decoder_layer

_HF_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight")


def _layer_returns_tuple() -> bool:
    """True where the installed LlamaModel reads `layer_outputs[0]` from each decoder layer."""
    from transformers.models.llama import modeling_llama
    try:
        return "layer_outputs[0]" in inspect.getsource(modeling_llama.LlamaModel.forward)
    except (OSError, TypeError):  # no source shipped: go by version (4.54 returns a tensor)
        import transformers
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        return (major, minor) < (4, 54)


def _check_config(config) -> None:
    problems = []
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("attention_bias/mlp_bias (tritium's Llama block has no biases)")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (only silu: swiglu)")
    if getattr(config, "pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={config.pretraining_tp} (use 1)")
    if problems:
        raise NotImplementedError("convert_llama cannot convert this config: " + "; ".join(problems))


def _te_mask(attention_mask: Optional[torch.Tensor]):
    """HF's 4D mask -> (TE mask or None, attn_mask_type)."""
    if attention_mask is None or _is_causal_marker(attention_mask):
        return None, "causal"
    if not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(f"attention_mask of type {type(attention_mask).__name__} (flex "
                                  "attention's BlockMask?) is not supported: load the model with "
                                  "attn_implementation='sdpa' or 'eager'")
    if attention_mask.dim() != 4:
        raise ValueError(f"expected HF's 4D attention mask [b, 1, q, kv], got shape "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return ~attention_mask, "arbitrary"
    return attention_mask != 0, "arbitrary"


# What the converted model hands HF's mask code when a forward has no attention_mask, no
# position_ids and no cache: a 4D tensor, which create_causal_mask returns as it is, so HF skips
# its packed-sequence check of position_ids (transformers' masking_utils: a host read of a
# device tensor, one sync per forward; without a mask or positions the positions are HF's own
# arange and cannot be packed). The layers read it as "causal, no padding". No HF mask has a
# zero dim ([b, 1, q, kv], each >= 1); it holds no memory.
_CAUSAL_MARKER_SHAPE = (0, 1, 0, 0)


def _is_causal_marker(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and \
        tuple(attention_mask.shape) == _CAUSAL_MARKER_SHAPE


def _mark_causal(module, args, kwargs):
    """LlamaModel forward pre-hook (kwargs): the causal marker in place of a missing mask,
    where HF would otherwise derive the mask from its own position_ids (above)."""
    if len(args) > 1 or any(kwargs.get(k) is not None for k in (
            "attention_mask", "position_ids", "cache", "past_key_values")) \
            or kwargs.get("use_cache"):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None:
        return None
    marker = torch.empty(_CAUSAL_MARKER_SHAPE, dtype=torch.bool, device=ids.device)
    return args, {**kwargs, "attention_mask": marker}


def _hf_capture_hook():
    """transformers' installer of its hidden-state capture hook (>= 4.54), or None."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return getattr(output_capturing, "install_output_capturing_hook", None) or \
        getattr(output_capturing, "install_output_capuring_hook", None)


def _capture_when_asked(module, args, kwargs):
    """LlamaModel forward pre-hook (kwargs): `output_hidden_states=True` under transformers
    >= 4.54 collects hidden states with forward hooks HF puts, when first asked, on modules of
    its own decoder-layer class, which a converted layer is not. Give the converted layers the
    same hook at the same moment (never before: a per-layer `compile(fullgraph=True)` cannot
    trace it, as it cannot HF's). Not under sequence parallelism (the middle layers' outputs
    are chunks)."""
    asked = kwargs.get("output_hidden_states")
    if asked is None:
        asked = getattr(module.config, "output_hidden_states", False)
    if asked and not getattr(module, "_tritium_captures", False):
        install = _hf_capture_hook()
        for layer in module.layers:
            if isinstance(layer, TritiumLlamaDecoderLayer) and layer._sp_group is None:
                install(layer, "hidden_states", 0)
        module._tritium_captures = True


def _hf_mask_syncs() -> bool:
    """Whether the installed transformers' mask code reads position_ids on the host."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def _version(t):
    """A tensor's in-place version; inference tensors have none: an object equal to nothing."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:
        return object()


class _LayerInputs:
    """(TE mask, mask type, RoPE angles) for one forward, made by its first decoder layer and
    reused by the others: they get the very same position_ids and mask tensors, so the mask
    conversion, the angles and the rows-equal check (a device sync for a batch of several
    position_ids rows) run once per forward instead of once per layer. Keyed on the identity
    and version of position_ids, the mask and inv_freq (strong references: no id reuse; the
    last forward's mask stays alive until the next forward)."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, wrapper, hidden_states, attention_mask, position_ids, shape=None):
        """shape: the (batch, sequence) attention sees (default: bshd hidden_states' own)."""
        b, s = hidden_states.shape[:2] if shape is None else shape
        if torch.compiler.is_compiling():  # each layer's graph makes its own (no shared cache,
            return _layer_inputs(wrapper, hidden_states, attention_mask, position_ids, b, s,
                                 sync=False)  # no device sync: docs/compile.md)
        inv_freq = wrapper._rotary_emb.inv_freq
        key = (position_ids, _version(position_ids), attention_mask, _version(attention_mask),
               inv_freq, _version(inv_freq), b, s, hidden_states.device)
        old = self.key
        if (old is not None and position_ids is not None and len(old) == len(key)
                and all(x is y or (not isinstance(x, torch.Tensor) and x == y)
                        for x, y in zip(old, key))):
            return self.value
        self.key = key
        self.value = _layer_inputs(wrapper, hidden_states, attention_mask, position_ids, b, s,
                                   sync=True)
        return self.value


def _layer_inputs(wrapper, hidden_states, attention_mask, position_ids, b, s, sync: bool):
    """(TE mask, mask type, RoPE angles). With several position_ids rows, `sync` checks on the
    host whether they are all equal (one table then); without it each row gets its table."""
    if position_ids is None:
        position_ids = torch.arange(s, device=hidden_states.device)[None]
    mask, mask_type = _te_mask(attention_mask)
    if position_ids.shape[0] == 1:
        return mask, mask_type, wrapper._freqs(position_ids.expand(b, s)[0])
    position_ids = position_ids.expand(b, s)
    if sync and bool((position_ids == position_ids[:1]).all()):  # a device sync, once
        return mask, mask_type, wrapper._freqs(position_ids[0])
    return mask, mask_type, [wrapper._freqs(position_ids[i]) for i in range(b)]


class TritiumLlamaDecoderLayer(torch.nn.Module):
    """HF LlamaDecoderLayer's call signature around a te.TransformerLayer (`self.layer`)."""

    def __init__(self, layer, rotary_emb, layer_idx: int, return_tuple: bool,
                 shared_inputs: Optional["_LayerInputs"] = None):
        super().__init__()
        self.layer = layer
        # Not a submodule: the rotary embedding belongs to LlamaModel (no duplicate state).
        object.__setattr__(self, "_rotary_emb", rotary_emb)
        self.layer_idx, self.return_tuple = layer_idx, return_tuple
        # One per converted model, shared by its layers (not state): every layer of a forward
        # gets the same position_ids and mask, so the first one prepares them for all.
        object.__setattr__(self, "_inputs", shared_inputs if shared_inputs is not None
                           else _LayerInputs())
        # sequence parallelism (convert_llama): the TP group, and whether this layer is the
        # first (scatters its input) or the last (gathers its output)
        self._sp_group, self.scatter_input, self.gather_output = None, False, False

    def _freqs(self, pos: torch.Tensor) -> torch.Tensor:
        """[s, 1, 1, d] angles for one row of position_ids, as HF's LlamaRotaryEmbedding."""
        inv_freq = self._rotary_emb.inv_freq.to(device=pos.device, dtype=torch.float32)
        freqs = pos[:, None].float() * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache: bool = False, position_embeddings=None,
                output_attentions: bool = False, **kwargs):
        if past_key_values is not None or kwargs.get("cache") is not None or use_cache:
            raise NotImplementedError("tritium decoder layers have no KV cache: call the model "
                                      "with use_cache=False (training, scoring)")
        if output_attentions:
            raise NotImplementedError("output_attentions: tritium's attention returns no weights")
        scaling = getattr(self._rotary_emb, "attention_scaling", 1.0)
        if scaling != 1.0:
            raise NotImplementedError(f"rope type with attention_scaling={scaling} (yarn, "
                                      "longrope) is not supported")
        group, shape = self._sp_group, None
        if group is not None:   # sbhd layers, this rank's chunk of the sequence (module note)
            if self.scatter_input:
                hidden_states = scatter_to_sequence_parallel_region(
                    hidden_states.transpose(0, 1).contiguous(), group)
            shape = (hidden_states.shape[1], hidden_states.shape[0] * dist.get_world_size(group))
        mask, mask_type, freqs = self._inputs.get(self, hidden_states, attention_mask,
                                                  position_ids, shape)
        if group is not None and isinstance(freqs, list):
            raise NotImplementedError("sequence parallelism needs one position_ids row for the "
                                      "whole batch (rows with different positions run one at "
                                      "a time, which a split sequence cannot do)")
        if not isinstance(freqs, list):
            out = self.layer(hidden_states, attention_mask=mask, self_attn_mask_type=mask_type,
                             rotary_pos_emb=freqs)
        else:  # each row its own angles
            rows = []
            for i, row_freqs in enumerate(freqs):
                m = None if mask is None else mask[i:i + 1] if mask.shape[0] > 1 else mask
                rows.append(self.layer(hidden_states[i:i + 1], attention_mask=m,
                                       self_attn_mask_type=mask_type, rotary_pos_emb=row_freqs))
            out = torch.cat(rows)
        if group is not None and self.gather_output:
            out = gather_from_sequence_parallel_region(out, group,
                                                       tensor_parallel_output_grad=False)
            # a copy even at batch 1 (where contiguous() would return the transposed view):
            # FSDP2 warns of view outputs, and an in-place op on one drops its backward hook
            out = out.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        return (out,) if self.return_tuple else out

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


def _llama_model(model):
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise TypeError(f"expected a transformers LlamaForCausalLM or LlamaModel, got "
                        f"{type(model).__name__}")
    if not hasattr(inner, "rotary_emb"):
        raise NotImplementedError("this transformers version keeps RoPE inside each attention "
                                  "layer (before 4.45): install transformers>=4.45")
    return inner


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                       past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                       logits_to_keep=0, **kwargs):
    """LlamaForCausalLM.forward with the loss through linear_cross_entropy (module note)."""
    shift_labels = kwargs.pop("shift_labels", None)
    if past_key_values is not None:  # only when given: transformers 5 renamed it `cache` and
        kwargs["past_key_values"] = past_key_values  # warns on every call that passes it
    if not self.training or (labels is None and shift_labels is None):
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids,
                                  inputs_embeds=inputs_embeds, labels=labels,
                                  use_cache=use_cache, logits_to_keep=logits_to_keep,
                                  **({} if shift_labels is None else
                                     {"shift_labels": shift_labels}), **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    return_dict = kwargs.pop("return_dict", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
    hidden = outputs[0]
    if shift_labels is None:  # tokens < n predict n, as HF's ForCausalLMLoss
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device),
                                ignore_index, "mean" if num_items is None else "sum",
                                bias=self.lm_head.bias, fp8=self._tritium_fp8_lm_head)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    # the model output's set fields under their own names (transformers 5 calls the cache
    # `cache` and warns on reads of `past_key_values`)
    kept = {k: v for k, v in outputs.items()
            if k in ("cache", "past_key_values", "hidden_states", "attentions")}
    out = CausalLMOutputWithPast(loss=loss, logits=None, **kept)
    return out.to_tuple() if return_dict is False else out


def _tp_size(config, tp_group, heads: int, groups: int) -> int:
    """The TP group's size, after checking that it divides what tensor parallelism splits."""
    if tp_group is None:
        return 1
    n = dist.get_world_size(tp_group)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                        ("intermediate_size", config.intermediate_size)):
        if value % n:
            raise ValueError(f"convert_llama: tp_group has {n} ranks but the config's "
                             f"{name}={value} is not divisible by {n}; use a tp_group whose "
                             f"size divides {name} (tensor parallelism splits it in equal "
                             "shards)")
    return n


def convert_llama(model, *, fused_cross_entropy: bool = True, fp8_lm_head: bool = False,
                  tp_group=None, sequence_parallel: bool = False):
    """Swap every decoder layer of an HF Llama model for a tritium TransformerLayer holding
    the same weights (this rank's shards with `tp_group`) and, for a LlamaForCausalLM, route
    the training loss through linear_cross_entropy (in place; returns the model). See the
    module note."""
    from tritium.modules.transformer_layer import TransformerLayer
    inner = _llama_model(model)
    config = model.config
    _check_config(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    group = resolve_group(tp_group, "convert_llama")
    tp = _tp_size(config, group, heads, groups)
    sp = tp > 1 and bool(sequence_parallel)
    tp_args = {} if tp == 1 else dict(tp_group=group, sequence_parallel=sp,
                                      set_parallel_mode=True)
    return_tuple = _layer_returns_tuple()
    shared = _LayerInputs()
    for i, hf_layer in enumerate(inner.layers):
        if isinstance(hf_layer, TritiumLlamaDecoderLayer):
            continue
        weight = hf_layer.self_attn.q_proj.weight
        layer = TransformerLayer(
            hidden, config.intermediate_size, heads, num_gqa_groups=groups, kv_channels=head_dim,
            layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0.0,
            attention_dropout=getattr(config, "attention_dropout", 0.0) or 0.0,
            normalization="RMSNorm", activation="swiglu", bias=False, fuse_qkv_params=True,
            qkv_weight_interleaved=False, attn_input_format="sbhd" if sp else "bshd",
            self_attn_mask_type="causal", layer_number=i + 1, params_dtype=weight.dtype,
            device=weight.device, **tp_args)
        load_llama_decoder_layer(layer, **hf_llama_layer_weights(hf_layer))
        layer.train(hf_layer.training)
        inner.layers[i] = TritiumLlamaDecoderLayer(layer, inner.rotary_emb, i, return_tuple,
                                                   shared)
    for i, wrapper in enumerate(inner.layers):
        wrapper._sp_group = group if sp else None
        wrapper.scatter_input, wrapper.gather_output = i == 0, i == len(inner.layers) - 1
    inner.norm = _final_norm(inner.norm, config)
    if _hf_mask_syncs() and not getattr(inner, "_tritium_marks_causal", False):
        inner.register_forward_pre_hook(_mark_causal, with_kwargs=True)
        inner._tritium_marks_causal = True
    if _hf_capture_hook() is not None and not getattr(inner, "_tritium_capture_hook", False):
        inner.register_forward_pre_hook(_capture_when_asked, with_kwargs=True)
        inner._tritium_capture_hook = True
    config.use_cache = False  # no KV cache: forward(...) then makes none by default
    if fused_cross_entropy and isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        fuse_cross_entropy(model, fp8_lm_head=fp8_lm_head)
    return model


def _final_norm(norm, config):
    """A te.RMSNorm holding HF's final norm's weight (the module itself if it is one already).
    Its input is the whole sequence (the last layer gathers it under sequence parallelism)."""
    from tritium.modules.norm import RMSNorm
    if isinstance(norm, RMSNorm):
        return norm
    weight = norm.weight
    new = RMSNorm(weight.shape[0], eps=getattr(norm, "variance_epsilon", config.rms_norm_eps),
                  params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        new.weight.copy_(weight)
    return new.train(norm.training)


def fuse_cross_entropy(model, *, fp8_lm_head: bool = False):
    """Route a causal LM's training loss (`model(input_ids, labels=...)` or `shift_labels=`)
    through linear_cross_entropy, keeping its decoder layers as they are (in place; returns the
    model). `convert_llama` does this by default; this alone is for a model whose layers stay
    HF's own (e.g. a torchao-converted baseline that should pay for the same loss)."""
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        raise TypeError(f"fuse_cross_entropy: model must be a causal LM with an nn.Linear "
                        f"lm_head (e.g. LlamaForCausalLM); {type(model).__name__} has none")
    model._tritium_fp8_lm_head = bool(fp8_lm_head)
    model.forward = types.MethodType(_causal_lm_forward, model)
    return model


def _layer_weights(wrapper: TritiumLlamaDecoderLayer) -> dict:
    """HF decoder-layer key -> tensor, from a wrapped TransformerLayer."""
    attn = wrapper.layer.self_attention
    qkv = attn.layernorm_qkv
    h, g, d = attn.num_attention_heads, attn.num_gqa_groups, attn.hidden_size_per_attention_head
    q, k, v = qkv.weight.detach().split([h * d, g * d, g * d])
    norm = qkv.layer_norm_weight.detach()
    mlp = llama_mlp_weights(wrapper.layer.layernorm_mlp)
    values = (q, k, v, attn.proj.weight.detach(), mlp["gate_proj"], mlp["up_proj"],
              mlp["down_proj"], norm + 1 if qkv.zero_centered_gamma else norm,
              mlp["norm_weight"])
    return {key: t.clone() for key, t in zip(_HF_LAYER_KEYS, values)}


def to_hf_state_dict(model) -> dict:
    """The state_dict the original HF model would have: HF key names, HF order, the same
    values (tritium's FP8 metadata is not part of it). Like state_dict(), entries outside the
    decoder layers are the model's own tensors; the layers' entries are new tensors (split out
    of the fused QKV and fc1 weights)."""
    inner = _llama_model(model)
    if any(isinstance(layer, TritiumLlamaDecoderLayer) and layer.layer.tp.size > 1
           for layer in inner.layers):
        raise NotImplementedError("to_hf_state_dict needs whole weights: this model's layers "
                                  "hold tensor-parallel shards. Gather them with "
                                  "tritium.distributed.tensor_parallel.gather_full_state_dict "
                                  "(tritium key names), or convert a tp_group=None copy")
    prefix = "model." if inner is not model else ""
    out = {}
    for key, value in model.state_dict().items():
        rest = key[len(prefix):] if key.startswith(prefix) else None
        if rest is None or not rest.startswith("layers."):
            out[key] = value
            continue
        idx = int(rest.split(".")[1])
        layer = inner.layers[idx]
        if not isinstance(layer, TritiumLlamaDecoderLayer):
            out[key] = value
            continue
        base = f"{prefix}layers.{idx}."
        if base + _HF_LAYER_KEYS[0] not in out:
            out.update({base + k: t for k, t in _layer_weights(layer).items()})
    return out
