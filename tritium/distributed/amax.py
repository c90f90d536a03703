"""Amax reduction for delayed scaling: one MAX all-reduce of every amax in a group of states.

Each rank concatenates row 0 of all its amax histories (in the same module order on every rank),
all-reduces the buffer with MAX over the amax group, and copies the slices back, so every rank
derives the same scales. Does nothing when torch.distributed is not initialized or the group has
one rank.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def group_world_size(group) -> int:
    """The size of `group` (None: the default group), 1 without torch.distributed. A
    ProcessGroup's own size() where one is given: no Python layers per call."""
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def reduce_amax_rows(histories: Sequence[torch.Tensor], group=None) -> None:
    """All-reduce (MAX) row 0 of every [L, n] history in one collective, in place."""
    if not histories or group_world_size(group) <= 1:
        return
    rows = [h[0] for h in histories]
    flat = torch.cat(rows)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    for row, part in zip(rows, torch.split(flat, [r.numel() for r in rows])):
        row.copy_(part)
