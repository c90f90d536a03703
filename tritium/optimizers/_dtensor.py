"""DTensor params (FSDP2's `fully_shard`, torch tensor parallelism) in the fused optimizers.

The optimizers step every param on its LOCAL shard: at the plan stage each DTensor param and its
DTensor grad are unwrapped to their local tensors (`_local_tensor`: a plain tensor, or a tritium
Float8Tensor for FP8 params; a weight wrapper such as torchao's is taken off too: `local`), and those go into the same multi-tensor launches as plain params.
Adam and SGD are elementwise, so a shard's update is the unsharded update of its elements.

State (masters, moments, momentum buffers) is created from the local shard and kept as a
DTensor with the param's mesh, placements and global shape, as torch.optim does for DTensor
params: `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` then sees sharded
state with the param's layout and DCP reshards it on load (another world size). The kernels get
the state's local tensors. Our own `state_dict()` returns these DTensors as they are.

Checks (raised before anything runs or changes, naming the fix): a grad must be a DTensor on the
param's mesh with the param's placements (what FSDP2 and DTensor autograd produce); a param with
a Partial placement (pending reduction) is refused. A param group may mix DTensor and plain
params, and params on different meshes: each tensor is stepped on its own local data.
"""
from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor, Partial
except Exception:  # pragma: no cover - torch built without distributed
    DTensor = Partial = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local(t):
    """The tensor the optimizer steps: a DTensor's local tensor (a plain tensor or a
    Float8Tensor), with a weight wrapper taken off: tritium.distributed.fsdp's FP8-gather
    wrapper or another library's (torchao's float8 training weights), i.e. a tensor subclass
    with exactly one inner tensor of its own shape and dtype (beside others, such as torchao's
    precomputed scale). The kernels read raw pointers:
    a wrapper has no storage of its own."""
    if type(t) in _PLAIN:     # the common case, every param every step: no further look-ups
        return t
    if is_dtensor(t):
        t = t._local_tensor
        if type(t) in _PLAIN:
            return t
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return t
    names, _ = flatten(t)
    same = [x for x in (getattr(t, n) for n in names)
            if isinstance(x, torch.Tensor) and x.shape == t.shape and x.dtype == t.dtype]
    return same[0] if len(same) == 1 else t


def local_state(p, state: dict) -> dict:
    """p's state as the kernels take it (local tensors), the dict itself for a plain p."""
    return {k: local(v) for k, v in state.items()} if is_dtensor(p) else state


def like_param(p, t: torch.Tensor):
    """A state tensor `t` shaped like p's local shard, wrapped as a DTensor like p."""
    if not is_dtensor(p):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def check_dtensor_param(p, where: str) -> None:
    if is_dtensor(p) and any(isinstance(pl, Partial) for pl in p.placements):
        raise ValueError(f"{where}: a DTensor param with placements {p.placements} holds a "
                         "pending (Partial) reduction; redistribute it to Shard/Replicate "
                         "placements before giving it to the optimizer")


def local_grad(p, g, attr: str, where: str):
    """The grad's local tensor, after checking it matches the param's distribution."""
    if is_dtensor(p):
        if not is_dtensor(g):
            raise TypeError(f"{where}: the param is a DTensor but {attr} is a plain "
                            f"{type(g).__name__}; assign a DTensor grad on the param's mesh "
                            "(FSDP2 / DTensor autograd make one)")
        if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
            raise ValueError(f"{where}: {attr} is a DTensor on {g.device_mesh} with placements "
                             f"{g.placements}, the param on {p.device_mesh} with "
                             f"{p.placements}; redistribute the grad "
                             "(g.redistribute(p.device_mesh, p.placements))")
        return local(g._local_tensor)
    if is_dtensor(g):
        raise TypeError(f"{where}: {attr} is a DTensor but the param is a plain tensor; shard "
                        "the param too (fully_shard / distribute_tensor) or assign "
                        "g.full_tensor()")
    return g


def to_param_layout(p, t: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor in p's layout: resharded onto p's mesh and placements (DTensor p),
    or gathered (plain p). Collectives run here only when layouts differ."""
    if is_dtensor(p):
        if is_dtensor(t):
            if t.device_mesh == p.device_mesh and tuple(t.placements) == tuple(p.placements):
                return t
            return t.redistribute(p.device_mesh, p.placements)
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(t.to(local(p).device), p.device_mesh, p.placements)
    return t.full_tensor() if is_dtensor(t) else t
