"""tritium.MultiheadAttention: QKV projection (optionally norm-fused), RoPE, DotProductAttention,
output projection; TE's names, arguments and parameter layout.

Submodules (TE's names):
  * self-attention: `layernorm_qkv` (a LayerNormLinear, input_layernorm=True) or `qkv` (Linear),
    output features (h + 2g) * d for h query heads, g KV groups, head dim d;
  * cross-attention: `layernorm_query` / `query_layer` and `key_value` (2g * d);
  * `core_attention` (DotProductAttention) and `proj` (Linear, h * d -> hidden).

QKV layout. fuse_qkv_params=True keeps one `weight`; else TE's parameters_split names
`query_weight`, `key_weight`, `value_weight` (and biases). The GEMM output is read as
  qkv_weight_interleaved=True (TE's default): per KV group, its h/g query heads, then its key
      head, then its value head: [..., g, h/g + 2, d];
  qkv_weight_interleaved=False: all queries, then all keys, then all values: [..., (h + 2g), d].
  With parameters_split the parts are concatenated [query | key | value], so the layout is the
  second one and the flag is ignored. The second layout gives q, k and v as
  views without a copy, which is why the Llama port and the benchmarks use it.

rotary_pos_emb (forward): freqs [s, 1, 1, rot_dim] from RotaryPositionEmbedding, or a pair
(q_freqs, k_freqs), applied to q and k after the split.

Tensor parallelism (tp_size > 1 with set_parallel_mode=True, TE's arguments): the
heads and the KV groups are split over the TP group (each divisible by tp_size), the QKV (and
query / key_value) projections are column-parallel and `proj` row-parallel; the core attention
runs on this rank's heads. Under sequence parallelism hidden_states is this rank's dim-0 rows;
the QKV GEMM all-gathers them, proj reduce-scatters. With get_rng_state_tracker, attention
dropout runs inside the tracker's fork (a different mask per TP rank: different heads).

Not built: inference KV caches, qk norms, alibi.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch
import torch.utils.checkpoint

from .._device import default_device
from ..distributed.activation_checkpoint import checkpoint
from ..distributed.tensor_parallel import TPConfig, divide
from ..attention import DotProductAttention, apply_rotary_pos_emb
from ..attention.fp8 import active as fp8_attention_active, check_saved_entry
from .layernorm_linear import LayerNormLinear
from .linear import Linear

ATTENTION_TYPES = ("self", "cross")


def _check_core_attention_state(module, state_dict, prefix, *_args) -> None:
    """Load pre-hook: a bad saved FP8 attention state raises before any submodule loads."""
    check_saved_entry(state_dict, prefix + "core_attention.")


class MultiheadAttention(torch.nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size=None, tp_group=None, tp_size: int = 1,
                 num_gqa_groups: Optional[int] = None, fuse_wgrad_accumulation: bool = False,
                 get_rng_state_tracker=None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", set_parallel_mode: bool = False,
                 fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, bias: bool = True,
                 normalization: str = "LayerNorm",
                 device: Union[str, torch.device, None] = "cuda", qkv_format: str = "sbhd",
                 name: Optional[str] = None, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(f"MultiheadAttention got unsupported arguments {sorted(unsupported)}")
        self.tp = TPConfig.make("MultiheadAttention", tp_group, tp_size, sequence_parallel)
        self.tp_size, self.sequence_parallel = self.tp.size, self.tp.sequence_parallel
        if self.tp.size > 1 and not set_parallel_mode:
            raise ValueError("MultiheadAttention: tp_size > 1 needs set_parallel_mode=True (QKV "
                             "column-parallel, proj row-parallel; pass it to "
                             "MultiheadAttention or TransformerLayer)")
        self.set_parallel_mode = set_parallel_mode
        self.get_rng_state_tracker = get_rng_state_tracker
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got "
                             f"{attention_type!r}")
        if num_attention_heads < 1 or hidden_size < 1:
            raise ValueError("hidden_size and num_attention_heads must be positive")
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"hidden_size={hidden_size} is not divisible by "
                                 f"num_attention_heads={num_attention_heads}; pass kv_channels")
            kv_channels = hidden_size // num_attention_heads
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if groups < 1 or num_attention_heads % groups:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be a multiple of "
                             f"num_gqa_groups={groups}")
        tp = self.tp.size
        self.num_attention_heads_per_partition = divide("MultiheadAttention",
                                                        "num_attention_heads",
                                                        num_attention_heads, tp)
        self.num_gqa_groups_per_partition = divide("MultiheadAttention", "num_gqa_groups",
                                                   groups, tp)
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.hidden_size_per_attention_head, self.num_gqa_groups = kv_channels, groups
        self.attention_type, self.input_layernorm = attention_type, input_layernorm
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.fuse_qkv_params = fuse_qkv_params
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        q_size, kv_size = num_attention_heads * kv_channels, groups * kv_channels
        device = default_device(device)
        tp_args = dict(tp_group=self.tp.group, tp_size=tp, sequence_parallel=sequence_parallel)
        common = dict(bias=bias, params_dtype=params_dtype, device=device,
                      init_method=init_method, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      parallel_mode="column" if set_parallel_mode else None,
                      get_rng_state_tracker=get_rng_state_tracker, **tp_args)
        norm = dict(eps=layernorm_epsilon, normalization=normalization,
                    zero_centered_gamma=zero_centered_gamma,
                    return_layernorm_output=return_layernorm_output)
        if attention_type == "self":
            split = None if fuse_qkv_params else {"query": q_size, "key": kv_size, "value": kv_size}
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(hidden_size, q_size + 2 * kv_size,
                                                     parameters_split=split, **norm, **common)
            else:
                self.qkv = Linear(hidden_size, q_size + 2 * kv_size, parameters_split=split,
                                  **common)
        else:
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(hidden_size, q_size, **norm, **common)
            else:
                self.query_layer = Linear(hidden_size, q_size, **common)
            split = None if fuse_qkv_params else {"key": kv_size, "value": kv_size}
            self.key_value = Linear(hidden_size, 2 * kv_size, parameters_split=split, **common)
        if fuse_qkv_params and not self.qkv_weight_interleaved:
            # [all q | all k | all v]: each part sharded on its own (interleaved rows are
            # grouped by KV group, so a contiguous chunk is already a whole set of groups)
            fused = self._qkv_layer() if attention_type == "self" else self.key_value
            fused._tp_blocks = ((q_size, kv_size, kv_size) if attention_type == "self"
                                else (kv_size, kv_size))
        self.core_attention = DotProductAttention(
            self.num_attention_heads_per_partition, kv_channels,
            num_gqa_groups=self.num_gqa_groups_per_partition,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, window_size=window_size, layer_number=layer_number,
            attention_type=attention_type)
        # a bad saved FP8 attention state raises before layernorm_qkv loads (attention/fp8.py)
        self.register_load_state_dict_pre_hook(_check_core_attention_state)
        self.proj = Linear(q_size, hidden_size, bias=bias, return_bias=return_bias,
                           params_dtype=params_dtype, device=device,
                           init_method=output_layer_init_method or init_method,
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                           parallel_mode="row" if set_parallel_mode else None,
                           get_rng_state_tracker=get_rng_state_tracker, **tp_args)

    def _qkv_layer(self):
        return self.layernorm_qkv if self.input_layernorm else self.qkv

    def _linears(self):
        return [m for m in self.children() if isinstance(m, Linear)]

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's method: the TP group of every projection (its size must be tp_size)."""
        self.tp.set_group("MultiheadAttention", tp_group)
        for m in self._linears():
            m.set_tensor_parallel_group(tp_group)

    # --- projections -----------------------------------------------------------------------
    def _project(self, layer, x, is_first_microbatch):
        """Run a (LayerNorm)Linear; returns (out, layernorm output or None)."""
        out = layer(x, is_first_microbatch=is_first_microbatch)
        if isinstance(layer, LayerNormLinear) and self.return_layernorm_output:
            return out[0], out[1]
        return out, None

    def _split_qkv(self, mixed: torch.Tensor):
        h, g = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition
        d = self.hidden_size_per_attention_head
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            grouped = mixed.view(*lead, g, h // g + 2, d)
            q, k, v = grouped.split([h // g, 1, 1], dim=-2)
            return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)
        q, k, v = mixed.split([h * d, g * d, g * d], dim=-1)
        return q.view(*lead, h, d), k.view(*lead, g, d), v.view(*lead, g, d)

    def _split_kv(self, mixed: torch.Tensor):
        g, d = self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            k, v = mixed.view(*lead, g, 2, d).unbind(-2)
            return k, v
        k, v = mixed.split([g * d, g * d], dim=-1)
        return k.view(*lead, g, d), v.view(*lead, g, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                encoder_output: Optional[torch.Tensor] = None, attn_mask_type: Optional[str] = None,
                window_size=None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                **unsupported):
        if unsupported:
            raise TypeError(f"MultiheadAttention.forward got unsupported arguments "
                            f"{sorted(unsupported)} (inference KV caches are not built)")
        ln_out = None
        if self.attention_type == "self":
            layer = self.layernorm_qkv if self.input_layernorm else self.qkv
            mixed, ln_out = self._project(layer, hidden_states, is_first_microbatch)
            q, k, v = self._split_qkv(mixed)
        else:
            if encoder_output is None:
                raise ValueError("cross-attention needs encoder_output (the keys' and values' "
                                 "source)")
            layer = self.layernorm_query if self.input_layernorm else self.query_layer
            q_out, ln_out = self._project(layer, hidden_states, is_first_microbatch)
            q = q_out.view(*q_out.shape[:-1], self.num_attention_heads_per_partition,
                           self.hidden_size_per_attention_head)
            k, v = self._split_kv(self.key_value(encoder_output,
                                                 is_first_microbatch=is_first_microbatch))
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, (tuple, list))
                                else (rotary_pos_emb, rotary_pos_emb))
            fmt = self.qkv_format
            # with context parallelism, local tokens sit at their load-balanced global positions
            cp = dict(cp_size=getattr(self.core_attention, "cp_size", 1),
                      cp_rank=getattr(self.core_attention, "cp_rank", 0))
            q = apply_rotary_pos_emb(q, q_freqs, tensor_format=fmt, cu_seqlens=cu_seqlens_q,
                                     **cp)
            k = apply_rotary_pos_emb(k, k_freqs, tensor_format=fmt, cu_seqlens=cu_seqlens_kv,
                                     **cp)
            if self.attention_type == "self" and torch.is_grad_enabled():
                # q and k are new tensors now; v, a view, would keep the whole fused QKV
                # output alive for attention's backward: its own copy frees the rest (q and k's
                # part of it, over 80% of the buffer for Llama-3's GQA) when the forward moves on
                v = v.clone()
        attn_kwargs = dict(attention_mask=attention_mask, qkv_format=self.qkv_format,
                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                           max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                           attn_mask_type=attn_mask_type or self.attn_mask_type,
                           window_size=window_size if window_size is not None else self.window_size,
                           core_attention_bias_type=core_attention_bias_type,
                           core_attention_bias=core_attention_bias)
        # dropout on this rank's heads: under TP a different mask per rank (the tracker's state)
        tracker = self.get_rng_state_tracker
        rng = (tracker().fork() if tracker is not None and self.training
               and self.core_attention.attention_dropout > 0 else contextlib.nullcontext())
        with rng:
            if checkpoint_core_attention and torch.is_grad_enabled():
                # FP8 attention (fp8_dpa): tritium's checkpoint, whose recompute reuses the
                # forward's scales under its autocast and records no amax (fp8/recompute.py)
                ckpt = checkpoint if fp8_attention_active() else torch.utils.checkpoint.checkpoint
                context = ckpt(
                    lambda q_, k_, v_: self.core_attention(q_, k_, v_, **attn_kwargs), q, k, v,
                    use_reentrant=False)
            else:
                context = self.core_attention(q, k, v, **attn_kwargs)
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        result = out if isinstance(out, tuple) else (out,)
        if self.return_layernorm_output:
            result = result + (ln_out,)
        return result if len(result) > 1 else result[0]

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism for the core attention (TE's method; see attention/cp/).
        Inputs are then this rank's load-balanced part of the sequence; RoPE follows it."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                       cp_comm_type)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_attention_heads}, "
                f"gqa_groups={self.num_gqa_groups}, head_dim={self.hidden_size_per_attention_head}, "
                f"attention_type={self.attention_type}, qkv_format={self.qkv_format}")
