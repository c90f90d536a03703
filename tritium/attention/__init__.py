"""tritium.attention: DotProductAttention, its backends (cuDNN / flash / mem-efficient through
torch's ATen ops, and a pure-PyTorch reference) and the choice between them.

    from tritium.attention import DotProductAttention, dot_product_attention, explain
    print(explain(q, k, v, qkv_format="bshd", attn_mask_type="causal"))

`attention_forward` / `attention_backward` (after `prepare`) are the block-level fwd/bwd pair a
context-parallel ring calls: fp32 log-sum-exp out, any merged (out, lse) pair back in; the
ring itself is `tritium.attention.cp` (`context_parallel_attention`, `cp.shard` / `cp.unshard`).
"""
from .backends import AttnArgs
from .dot_product_attention import (DotProductAttention, Explanation, attention_backward,
                                    attention_forward, dot_product_attention, explain, prepare)
from .masks import MASK_TYPES
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from . import cp
from .cp import context_parallel_attention

__all__ = ["DotProductAttention", "dot_product_attention", "attention_forward",
           "attention_backward", "prepare", "explain", "Explanation", "AttnArgs", "MASK_TYPES",
           "cp", "context_parallel_attention", "RotaryPositionEmbedding", "apply_rotary_pos_emb"]
