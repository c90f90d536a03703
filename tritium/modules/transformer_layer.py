"""tritium.TransformerLayer: TE's transformer block (`self_attention` + `layernorm_mlp`).

    pre-LN (default):  x = h + drop(attn(norm(h)));  out = x + drop(mlp(norm(x)))
    apply_residual_connection_post_layernorm: the residuals are the norms' outputs instead
    output_layernorm (post-LN): attention without an input norm, and `layernorm(out)` at the end
    parallel_attention_mlp: out = h + drop(attn(norm(h))) + drop(mlp(norm(h)))
where attn is the MultiheadAttention (`self_attention`, its norm fused into `layernorm_qkv`)
and mlp the LayerNormMLP (`layernorm_mlp`, its norm inside). `drop` is hidden_dropout, applied
to the sub-block output (bias included) before the residual add.

TE's defaults are kept for drop-in parity (bias on, LayerNorm, gelu, dropouts 0.1, sbhd,
causal, fuse_qkv_params=False, qkv_weight_interleaved=True); docs/porting.md lists what a
Llama port overrides (RMSNorm, swiglu, bias=False, dropouts 0, GQA, RoPE through
`rotary_pos_emb`, and fuse_qkv_params=True with qkv_weight_interleaved=False for copy-free q/k/v).

Tensor parallelism: tp_group / tp_size / sequence_parallel / set_parallel_mode /
get_rng_state_tracker go to both sub-blocks, as in TE (tp_size > 1 needs set_parallel_mode=True:
QKV and fc1 column-parallel, proj and fc2 row-parallel).
Under sequence parallelism hidden_states and the output are this rank's dim-0 rows (the
sequence for sbhd); the residual adds and hidden dropout run on them (dropout in the RNG
tracker's fork when one is given: other tokens, another mask).

Not built: decoder layers (layer_type="decoder", cross-attention inside the block), drop_path,
inference KV caches.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .._device import default_device
from ..distributed.tensor_parallel import TPConfig
from .layernorm_mlp import LayerNormMLP
from .multihead_attention import MultiheadAttention
from .norm import LayerNorm, RMSNorm


class TransformerLayer(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal", window_size=None, tp_group=None,
                 tp_size: int = 1, params_dtype: Optional[torch.dtype] = None,
                 get_rng_state_tracker=None, fuse_wgrad_accumulation: bool = False,
                 seq_length=None, micro_batch_size=None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, parallel_attention_mlp: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 device: Union[str, torch.device, None] = "cuda", attn_input_format: str = "sbhd",
                 name: Optional[str] = None, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(f"TransformerLayer got unsupported arguments {sorted(unsupported)}")
        if layer_type != "encoder":
            raise NotImplementedError(f"layer_type={layer_type!r} is not built yet: only "
                                      "'encoder' (self-attention + MLP)")
        if drop_path_rate:
            raise NotImplementedError("drop_path_rate is not built yet: use 0.0")
        if parallel_attention_mlp and (output_layernorm or apply_residual_connection_post_layernorm):
            raise ValueError("parallel_attention_mlp cannot be combined with output_layernorm or "
                             "apply_residual_connection_post_layernorm (TE forbids it too)")
        device = default_device(device)
        self.tp = TPConfig.make("TransformerLayer", tp_group, tp_size, sequence_parallel)
        self.sequence_parallel = self.tp.sequence_parallel
        self.get_rng_state_tracker = get_rng_state_tracker
        tp_args = dict(tp_group=self.tp.group, tp_size=self.tp.size,
                       sequence_parallel=sequence_parallel)
        self.hidden_dropout = float(hidden_dropout)
        self.output_layernorm = output_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.post_ln_residual = apply_residual_connection_post_layernorm
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.attn_input_format = attn_input_format
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels=kv_channels,
            attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon,
            init_method=init_method, output_layer_init_method=output_layer_init_method,
            layer_number=layer_number, attn_mask_type=self_attn_mask_type,
            window_size=window_size, num_gqa_groups=num_gqa_groups, **tp_args,
            set_parallel_mode=set_parallel_mode, get_rng_state_tracker=get_rng_state_tracker,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, params_dtype=params_dtype,
            return_bias=bias, return_layernorm_output=apply_residual_connection_post_layernorm,
            input_layernorm=not output_layernorm, attention_type="self",
            fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
            normalization=normalization, device=device, qkv_format=attn_input_format)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, bias=bias,
            normalization=normalization, activation=activation, return_bias=bias,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            zero_centered_gamma=zero_centered_gamma, params_dtype=params_dtype, device=device,
            init_method=init_method, output_layer_init_method=output_layer_init_method,
            set_parallel_mode=set_parallel_mode, get_rng_state_tracker=get_rng_state_tracker,
            **tp_args)
        if output_layernorm:
            norm_cls = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_cls(hidden_size, eps=layernorm_epsilon,
                                      zero_centered_gamma=zero_centered_gamma,
                                      params_dtype=params_dtype, device=device)

    def _sp_norm_spec(self):
        """The output norm runs on this rank's rows under SP: its grads are all-reduced."""
        if self.output_layernorm and self.sequence_parallel:
            self.layernorm._sp_spec = self.tp.spec("TransformerLayer", "row")

    def set_tensor_parallel_group(self, tp_group) -> None:
        """The TP group of the attention and the MLP (its size must be tp_size)."""
        self.tp.set_group("TransformerLayer", tp_group)
        self.self_attention.set_tensor_parallel_group(tp_group)
        self.layernorm_mlp.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism for the self-attention's core attention (TE's method)."""
        self.self_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                       cp_comm_type)

    def _dropout_add(self, out, bias, residual):
        if bias is not None:
            out = out + bias
        if self.hidden_dropout and self.training:
            # under sequence parallelism each rank holds other tokens: its own mask (tracker)
            tracker = self.get_rng_state_tracker
            fork = self.sequence_parallel and tracker is not None
            with tracker().fork() if fork else contextlib.nullcontext():
                out = F.dropout(out, p=self.hidden_dropout, training=True)
        return residual + out

    @staticmethod
    def _unpack(result, with_bias: bool, with_ln: bool):
        """(out, bias or None, layernorm output or None) from a sub-block's return value."""
        items = list(result) if isinstance(result, tuple) else [result]
        out = items.pop(0)
        bias = items.pop(0) if with_bias else None
        ln_out = items.pop(0) if with_ln else None
        return out, bias, ln_out

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None, window_size=None,
                encoder_output=None, enc_dec_attn_mask=None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                fast_zero_fill: bool = True):
        if encoder_output is not None or inference_params is not None or alibi_slopes is not None:
            raise NotImplementedError("encoder_output, inference_params and alibi_slopes are not "
                                      "built yet (encoder layers without KV caches only)")
        with_bias = self.layernorm_mlp.use_bias
        self._sp_norm_spec()
        attn = self.self_attention(
            hidden_states, attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type or self.self_attn_mask_type,
            window_size=window_size if window_size is not None else self.window_size,
            is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention, rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        attn_out, attn_bias, attn_ln = self._unpack(attn, with_bias, self.post_ln_residual)
        residual = attn_ln if self.post_ln_residual else hidden_states
        if self.parallel_attention_mlp:
            mlp = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
            mlp_out, mlp_bias, _ = self._unpack(mlp, with_bias, False)
            x = self._dropout_add(attn_out, attn_bias, hidden_states)
            return self._dropout_add(mlp_out, mlp_bias, x)
        x = self._dropout_add(attn_out, attn_bias, residual)
        mlp = self.layernorm_mlp(x, is_first_microbatch=is_first_microbatch)
        mlp_out, mlp_bias, mlp_ln = self._unpack(mlp, with_bias, self.post_ln_residual)
        out = self._dropout_add(mlp_out, mlp_bias, mlp_ln if self.post_ln_residual else x)
        if self.output_layernorm:
            out = self.layernorm(out)
        return out
