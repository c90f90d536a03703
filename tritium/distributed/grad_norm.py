"""`clip_grad_norm_`: the global L2 gradient-norm clip of a model trained with TE-style tensor
parallelism, FSDP2, or both.

torch.nn.utils.clip_grad_norm_ is right for FSDP2 alone (DTensor gradients), not under TE-style
tensor parallelism: a TP rank holds its shard of each sharded weight as a plain tensor (the
modules' `_tp_layout` says which ones) and a whole copy of every replicated one (norms,
embeddings, lm_head, row-parallel biases). torch's clip on each TP rank would see only its own
shards: the TP ranks would compute different norms, scale by different factors, and their
replicated weights would drift apart. Here the model's norm is

    ||g||^2 = sum over the TP group of the shards' squares + the replicated squares (once)

so the shards' local sum of squares is all-reduced over the TP group and the replicated sum is
not. An FSDP2 gradient (a DTensor sharded over a 1D "dp" mesh, also on a 2D mesh's dp dim)
contributes its local shard and the total is then all-reduced over that mesh. Every rank ends
with the same norm and scales each local gradient by min(1, max_norm / (norm + 1e-6)),
torch's rule, in one foreach multiply. Sums are fp32 (fp64 for fp64 gradients).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .tensor_parallel import _sharded_params


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


def _dp_group(grads: list) -> Optional[dist.ProcessGroup]:
    """The group FSDP2 shards these gradients over (None: no DTensor gradient)."""
    meshes = {id(g.device_mesh): g for g in grads if hasattr(g, "device_mesh")}
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError("clip_grad_norm_: the gradients are DTensors on different meshes; "
                         "shard every module of the model over one mesh (fully_shard(mesh=...))")
    g = next(iter(meshes.values()))
    if g.device_mesh.ndim != 1 or not all(p.is_shard() for p in g.placements):
        raise NotImplementedError(
            f"clip_grad_norm_: DTensor gradients on a {g.device_mesh.ndim}-D mesh with "
            f"placements {g.placements}; only FSDP2's Shard placements over one mesh dim are "
            "supported (use torch.nn.utils.clip_grad_norm_ for other DTensor layouts)")
    return g.device_mesh.get_group()


def clip_grad_norm_(model: torch.nn.Module, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of `model`'s parameters in place so that their global L2 norm is at
    most `max_norm` (module note); returns the norm before clipping, the same on every rank."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"clip_grad_norm_: pass the model (an nn.Module, whose modules say which "
                        f"parameters are TP shards), got {type(model).__name__}")
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"clip_grad_norm_: norm_type={norm_type}; only the L2 norm "
                                  "(norm_type=2.0) is supported")
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    sharded = _sharded_params(model)
    groups = {id(tp.group): tp for _, _, tp in sharded.values() if tp.size > 1}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the model's TP modules use different tp_groups; one "
                         "norm needs one TP group")
    tp = next(iter(groups.values()), None)
    tp_group = tp.active_group("clip_grad_norm_") if tp is not None else None
    shard_grads, replicated_grads = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (shard_grads if name in sharded else replicated_grads).append(p.grad)
    grads = shard_grads + replicated_grads
    if not grads:
        return torch.zeros(())
    dp_group = _dp_group(grads)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = _local(grads[0]).device

    def squares(gs):
        if not gs:
            return torch.zeros((), dtype=acc, device=device)
        norms = torch._foreach_norm([_local(g) for g in gs], 2.0)
        return torch.stack([n.to(acc) for n in norms]).square().sum()
    total = squares(shard_grads)
    if tp_group is not None:
        dist.all_reduce(total, group=tp_group)
    total = total + squares(replicated_grads)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([_local(g) for g in grads], coef)   # fp32 factor, as torch's clip
    return norm


__all__ = ["clip_grad_norm_"]
