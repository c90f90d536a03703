"""tritium.attention.cp: context-parallel attention (a sequence split over the ranks of a group).

    out = context_parallel_attention(q, k, v, cp_group, qkv_format="bshd",
                                     attn_mask_type="causal", cp_comm_type="p2p")

q, k, v are this rank's local part of the sequence in the load-balanced layout (layout.py:
rank r holds chunks r and 2cp-1-r of 2cp; `shard` makes it), in sbhd or bshd, GQA allowed;
out is the local part of the full-sequence attention output, shaped like
`dot_product_attention`'s. Strategies: "p2p" (p2p.py, KV ring overlapped with compute) and
"all_gather" (all_gather.py). `DotProductAttention(cp_group=...)` /
`set_context_parallel_group` call this from the module.

Precision (merge.py): fp32_accumulation=True (default) merges out/lse and accumulates dq, dk,
dv in fp32 and casts once; mode picks what each block returns:
  "exact"  partials in fp32: CP error == single-device error (docs/context_parallel.md). On
           CUDA fp16/bf16 with head dim 64/128 the blocks run tritium's Triton flash attention
           (16-bit in, fp32 out; `_use_kernel`); otherwise on fp32 copies (the reference on
           CPU, the fp32 mem-efficient kernel on CUDA, or the backend forced to torch/efficient)
  "fp32_partials"  as exact, but the kernel rounds P and dS once to 16 bits inside a block
           (cuDNN's and the speed mode's precision; exact splits them into a head and a tail):
           fp32 partials at the fused kernels' product precision. Where the kernel does not run
           (CPU, fp32 inputs, other head dims, dropout) it is exact.
  "fast"   blocks on the fused 16-bit backends (cuDNN / flash), one bf16 rounding per block
  "auto"   exact where it costs nothing (the block backend is the fp32 reference anyway, or the
           inputs are fp32), else fast.
Supported: self-attention with equal local q/kv lengths, attn_mask_type no_mask / causal
(causal_bottom_right is the same thing here), dropout (not bit-equal to a single-device run).
Clear errors for: thd, padding / arbitrary masks, sliding windows, a local length that is odd
(global length not divisible by 2*cp), cp_global_ranks that disagree with cp_group.

torch.compile: `context_parallel_attention` is wrapped in `torch.compiler.disable`, so a compiled
model with context parallelism has exactly one graph break per attention call, here, and the
ring (host-side schedule, P2P sends and receives, per-block backend choice) runs eagerly as it
does without compile. Everything around it (projections, RoPE, the MLP) still compiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import backends as B
from .. import masks as M
from ..backends import format_out
from ..dot_product_attention import _backend_name, dot_product_attention, prepare
from .layout import chunk_ids, gather_unshard, positions, resolve_group, shard, unshard
from .merge import Precision

COMM_TYPES = ("p2p", "all_gather")
MODES = ("auto", "exact", "fp32_partials", "fast")
_WHERE = "context parallel attention"


@dataclass(frozen=True)
class CPConfig:
    group: object
    ranks: tuple
    rank: int
    size: int
    causal: bool
    scale: float
    dropout: float
    backend: str
    precision: Precision


def _check_mask(mask_type: str, window_size, attention_mask):
    mt = M.parse_mask_type(mask_type)
    if mt not in ("no_mask", "causal", "causal_bottom_right"):
        raise NotImplementedError(
            f"{_WHERE}: attn_mask_type={mt!r} is not supported with context parallelism "
            "(padding and arbitrary masks are not built); use 'causal' or 'no_mask'")
    left, right = M.normalize_window(window_size, mt)
    if left >= 0 or (right >= 0 and not M.is_causal(mt)):
        raise NotImplementedError(f"{_WHERE}: window_size={window_size!r}: sliding windows are "
                                  "not supported with context parallelism")
    if attention_mask is not None:
        raise ValueError(f"{_WHERE}: attention_mask must be None with attn_mask_type={mt!r}")
    return M.is_causal(mt)


def _resolve_mode(mode: str, q, k, v, args, backend: str) -> str:
    """-> "exact", "fp32_partials" or "fast" ("auto": exact where the block backend computes
    in fp32 anyway, else fast)."""
    if mode not in MODES:
        raise ValueError(f"{_WHERE}: mode={mode!r} must be one of {MODES}")
    if mode != "auto":
        return mode
    if q.dtype in (torch.float32, torch.float64):
        return "exact"
    return "exact" if B.choose_cached(q, k, v, args, backend).name == "torch" else "fast"


def _use_kernel(q, k, v, dropout: float, backend: str) -> bool:
    """Exact blocks on the Triton flash kernel? CUDA fp16/bf16, head dim 64 or 128 (d_v ==
    d_qk), no dropout, triton importable, the block backend not forced to torch/efficient
    (those keep the old fp32-copy path) and TRITIUM_FORCE_REF unset."""
    from ..._env import force_ref
    if (not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or dropout > 0.0
            or backend in ("torch", "efficient") or force_ref()
            or q.shape[-1] not in (64, 128)):
        return False
    try:
        from ...kernels import flash_attention as FA
    except ImportError:
        return False
    return FA.supported(q, k, v)


@torch.compiler.disable(reason="context-parallel attention runs eagerly (one graph break)")
def context_parallel_attention(query_layer, key_layer, value_layer, cp_group,
                               cp_global_ranks: Optional[Sequence[int]] = None, *,
                               cp_comm_type: str = "p2p", qkv_format: str = "sbhd",
                               attn_mask_type: str = "causal", attention_mask=None,
                               window_size=None, softmax_scale: Optional[float] = None,
                               dropout_p: float = 0.0, backend: str = "auto",
                               mode: str = "auto", fp32_accumulation: bool = True,
                               cu_seqlens_q=None, cu_seqlens_kv=None, **_unused):
    """Local attention output of a context-parallel group (see the module note)."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"{_WHERE}: cp_comm_type={cp_comm_type!r} must be one of {COMM_TYPES}")
    if qkv_format == "thd" or cu_seqlens_q is not None or cu_seqlens_kv is not None:
        raise NotImplementedError(f"{_WHERE}: qkv_format='thd' (packed sequences, cu_seqlens) "
                                  "is not supported with context parallelism; use sbhd or bshd")
    causal = _check_mask(attn_mask_type, window_size, attention_mask)
    size, rank, ranks = resolve_group(cp_group, cp_global_ranks, _WHERE)
    q, k, v, args = prepare(query_layer, key_layer, value_layer, qkv_format=qkv_format,
                            attn_mask_type="causal" if causal else "no_mask",
                            softmax_scale=softmax_scale, dropout_p=dropout_p, where=_WHERE)
    if args.sq != args.sk:
        raise ValueError(f"{_WHERE}: local query length {args.sq} != key/value length "
                         f"{args.sk}; context parallelism splits one sequence for q, k and v")
    if args.sq % 2:
        raise ValueError(f"{_WHERE}: local sequence length {args.sq} is odd: the global length "
                         f"({args.sq} * cp_size {size}) must be divisible by 2 * cp_size = "
                         f"{2 * size} (load-balanced layout, tritium.attention.cp.shard)")
    name = _backend_name(backend)
    if size == 1:
        return dot_product_attention(query_layer, key_layer, value_layer, qkv_format=qkv_format,
                                     attn_mask_type="causal" if causal else "no_mask",
                                     softmax_scale=softmax_scale, dropout_p=dropout_p,
                                     backend=name)
    mode = _resolve_mode(mode, q, k, v, args, name)
    exact = mode != "fast"
    cfg = CPConfig(group=cp_group, ranks=tuple(ranks), rank=rank, size=size, causal=causal,
                   scale=args.scale, dropout=args.dropout, backend=name,
                   precision=Precision(exact=exact, fp32_accumulation=bool(fp32_accumulation),
                                       kernel=exact and _use_kernel(q, k, v, args.dropout,
                                                                    name),
                                       split=mode != "fp32_partials"))
    if cp_comm_type == "p2p":
        from .p2p import RingAttention as Fn
    else:
        from .all_gather import AllGatherAttention as Fn
    return format_out(Fn.apply(q, k, v, cfg), qkv_format)


__all__ = ["context_parallel_attention", "shard", "unshard", "positions", "gather_unshard",
           "chunk_ids", "resolve_group", "COMM_TYPES", "MODES", "CPConfig", "Precision"]
