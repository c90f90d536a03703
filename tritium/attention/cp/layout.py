"""Context-parallel layout: the load-balanced sharding of a sequence, and the CP group checks.

Layout (TE's, DESIGN.md section 6). A sequence of S tokens is cut into 2*cp equal chunks of
c = S / (2*cp) tokens; rank r holds chunks r and 2cp-1-r, concatenated, so its local sequence
is L = 2c tokens: [chunk r | chunk 2cp-1-r]. With a causal mask every rank then does the same
amount of work (an early chunk paired with a late one). The same layout is used for no_mask.

    shard(x, cp_size, cp_rank, seq_dim)      full -> this rank's local part (a copy)
    unshard(parts, seq_dim)                  [local part of rank 0, 1, ...] -> full
    positions(S, cp_size, cp_rank)           global position ids of the local tokens
    gather_unshard(x_local, group, seq_dim)  all_gather + unshard (for checks and metrics)

Apply these to inputs, labels and position ids alike. RoPE: `apply_rotary_pos_emb(...,
cp_size=, cp_rank=)` maps local tokens to these global positions itself. thd (packed
sequences) is not handled here: each sequence would need its own split.

`resolve_group` checks a cp_group / cp_global_ranks pair and returns (size, rank, ranks): the
global ranks in group-rank order, which the p2p ring needs (P2POp takes global ranks).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _check_split(s: int, cp_size: int, what: str = "sequence length") -> int:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if s % (2 * cp_size):
        raise ValueError(f"context parallelism: the {what} {s} is not divisible by 2 * cp_size "
                         f"= {2 * cp_size} (load balancing cuts it into 2*cp equal chunks); pad "
                         f"the sequence to a multiple of {2 * cp_size}")
    return s // (2 * cp_size)


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices rank cp_rank holds, in local order."""
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence: chunks r and 2cp-1-r of 2cp along seq_dim."""
    s = x.shape[seq_dim]
    _check_split(s, cp_size)
    first, second = chunk_ids(cp_size, cp_rank)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def unshard(parts: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's local part (given in cp-rank order)."""
    n = len(parts)
    if n < 1:
        raise ValueError("unshard needs the local parts of every rank (a non-empty list)")
    if any(p.shape != parts[0].shape for p in parts):
        raise ValueError("unshard: the local parts differ in shape: "
                         f"{[tuple(p.shape) for p in parts]}")
    if parts[0].shape[seq_dim] % 2:
        raise ValueError(f"unshard: a local part has {parts[0].shape[seq_dim]} tokens along "
                         f"dim {seq_dim}; the load-balanced layout needs an even number")
    halves = [p.chunk(2, dim=seq_dim) for p in parts]
    order = [halves[j][0] for j in range(n)] + [halves[n - 1 - j][1] for j in range(n)]
    return torch.cat(order, dim=seq_dim)


def positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """int64 global positions of this rank's local tokens (position ids for a full sequence of
    seq_len tokens)."""
    return shard(torch.arange(seq_len, device=device), cp_size, cp_rank, 0)


def gather_unshard(x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """all_gather every rank's local part and unshard it (not differentiable)."""
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard(parts, seq_dim)


def resolve_group(cp_group, cp_global_ranks: Optional[Sequence[int]] = None,
                  where: str = "context parallelism") -> tuple[int, int, list]:
    """-> (cp_size, cp_rank, global ranks in group order). cp_group None means no CP."""
    if cp_group is None:
        if cp_global_ranks is not None and len(list(cp_global_ranks)) > 1:
            raise ValueError(f"{where}: cp_global_ranks={list(cp_global_ranks)} was given "
                             "without a cp_group; pass the process group too")
        return 1, 0, [0]
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{where}: cp_group was given but torch.distributed is not "
                           "initialized (call torch.distributed.init_process_group first)")
    try:
        ranks = list(dist.get_process_group_ranks(cp_group))
    except Exception as exc:  # not a ProcessGroup, or not one this process belongs to
        raise TypeError(f"{where}: cp_group must be a torch.distributed ProcessGroup this rank "
                        f"belongs to, got {type(cp_group).__name__} ({exc})") from None
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"{where}: this process (global rank {me}) is not in cp_group "
                         f"{ranks}")
    if cp_global_ranks is not None:
        given = [int(r) for r in cp_global_ranks]
        if given != ranks:
            raise ValueError(f"{where}: cp_global_ranks={given} does not match cp_group, whose "
                             f"global ranks in group order are {ranks}; pass "
                             "torch.distributed.get_process_group_ranks(cp_group)")
    return len(ranks), ranks.index(me), ranks


__all__ = ["shard", "unshard", "positions", "gather_unshard", "chunk_ids", "resolve_group"]
