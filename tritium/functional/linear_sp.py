"""Sequence parallelism under FP8 for the Linear Function (functional/linear.py): this rank's
rows are cast with the one scale every TP rank uses, then their fp8 bytes are all-gathered
(half of a bf16 gather); the transpose wgrad needs is made after the gather, never sent. The
forward gathers a column-parallel GEMM's input, the backward a row-parallel GEMM's grad.
One scale: under DelayedScaling the shared scale slot (amaxes recorded locally, MAX-reduced at
the update over an fp8_group that must contain the TP group: checked once per group pair);
under Float8CurrentScaling the local amaxes MAX-reduced first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..distributed.tensor_parallel import all_gather_dim0
from ..fp8.autocast import current as current_autocast
from ..fp8.cast import amax_into, transpose_fp8
from ..fp8.recipe import Float8CurrentScaling
from ..fp8.tensor import Float8Tensor
from .fused_cast import pad16

if TYPE_CHECKING:
    from .fp8_plan import FP8Plan


_one_scale_checked: set = set()


def _check_one_scale(plan: "FP8Plan", group) -> None:
    """The gathered rows are read with this rank's scale_inv, so under delayed scaling every TP
    rank must hold the same scale: amaxes reduced over a group that holds the TP group."""
    amax_group = None if current_autocast() is None else current_autocast().group
    key = (id(group), id(amax_group), plan.recipe.reduce_amax)
    if key in _one_scale_checked:
        return
    tp_ranks = set(dist.get_process_group_ranks(group))
    amax_ranks = set(dist.get_process_group_ranks(amax_group or dist.group.WORLD))
    if not plan.recipe.reduce_amax or not tp_ranks <= amax_ranks:
        raise ValueError(
            "sequence_parallel under DelayedScaling all-gathers fp8 rows that every TP rank "
            "must have cast with one scale: use a recipe with reduce_amax=True and an fp8_group "
            f"(fp8_autocast) that contains the TP group's ranks {sorted(tp_ranks)}")
    _one_scale_checked.add(key)


def gathered_fp8(plan: "FP8Plan", x2d, group, need_transpose: bool, backward: bool = False):
    """Sequence parallelism under FP8: this rank's rows cast with the one scale every rank
    uses (delayed: the shared scale slot, amax recorded locally and MAX-reduced at the update;
    current: the local amaxes MAX-reduced first), then the fp8 bytes all-gathered; the
    transpose wgrad needs is made after the gather. The forward gathers a column GEMM's input
    (forward state, input slot), the backward a row GEMM's grad (backward state, grad slot).
    Returns (x8 [Tp, K], x8^T, scale_inv): the same fp8 values as casting the gathered rows."""
    fmt = plan.recipe.fp8_format
    fp8_dtype = fmt.backward_dtype if backward else fmt.forward_dtype
    state, slot = (plan.bwd, plan.grad_slot) if backward else (plan.fwd, plan.input_slot)
    if isinstance(x2d, Float8Tensor):  # a fused norm wrote it with the shared scale
        local, x_si = x2d._data.reshape(-1, x2d.shape[-1]), x2d._scale_inv
    elif isinstance(plan.recipe, Float8CurrentScaling):
        amax = torch.zeros(1, dtype=torch.float32, device=x2d.device)
        amax_into(x2d, amax)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        local, _, x_si = plan.quantize(x2d, None, slot, fp8_dtype, pad_rows_to=1,
                                       tensor_amax=amax)
    else:
        _check_one_scale(plan, group)
        local, _, x_si = plan.quantize(x2d, state, slot, fp8_dtype, pad_rows_to=1)
    full = all_gather_dim0(local, group)
    tokens, k = full.shape
    if tokens % 16:
        full = torch.cat([full, full.new_zeros(pad16(tokens) - tokens, k)])
    return full, (transpose_fp8(full) if need_transpose else None), x_si


__all__ = ["gathered_fp8"]
