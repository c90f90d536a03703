"""Tensor and sequence parallelism (Megatron layout, TE's arguments): groups, collectives as
autograd Functions, and the helpers that shard a full state dict or gather one.

Layout (TP group of size p, rank r):
  * column-parallel weight [out, in] -> rows chunk r, [out/p, in]; bias [out/p]; output = the
    matching columns of the unsharded output. Input: replicated (its gradient all-reduced), or
    under sequence parallelism the local rows of dim 0, all-gathered before the GEMM (the
    gradient reduce-scattered back).
  * row-parallel weight [out, in] -> columns chunk r, [out, in/p]; bias [out] replicated, added
    once after the reduction. Output: all-reduced, or reduce-scattered along dim 0 under
    sequence parallelism.
  * a weight made of blocks that are sharded separately (gate and up of a gated fc1; q, k, v of
    a fused, non-interleaved QKV) keeps rank r's chunk of each block, stacked in block order.
Sequence parallelism splits dim 0 of the activations: the sequence for sbhd [s, b, h] and thd
[t, h]; for bshd [b, s, h] it is the batch (every op outside attention is token-wise, and
attention sees whole tensors after the column gather, so any dim-0 split is exact).

Everything is torch.distributed collectives (works on NCCL and gloo): FP8 payloads travel as
a uint8 view (gloo takes no fp8 dtypes). What this file does not do: overlap communication with
GEMMs (userbuffers), or FP8 reduce-scatters (a sum of FP8 values is not FP8).

State dicts: a block-scaled FP8 weight (Float8BlockTensor, fp8_model_init under
Float8BlockScaling) is sharded and gathered with its fp8 bytes and scales where every shard
holds whole 128-element blocks, and refused by block-FP8 shards that would cut them
(docs/block_scaling.md).

Groups: `tp_group` may be a ProcessGroup, a 1-D DeviceMesh (e.g. `mesh["tp"]`), or a DeviceMesh
with a dim named "tp". tp_size is then the group's size; tp_group=None with tp_size > 1 means
the default group, checked at the first forward (or give the group later through
`set_tensor_parallel_group`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from .amax import group_world_size

PARALLEL_MODES = (None, "column", "row")


# --------------------------------------------------------------------------- groups
def resolve_group(tp_group, owner: str):
    """A ProcessGroup (or None) from a ProcessGroup, a DeviceMesh or None."""
    if tp_group is None or isinstance(tp_group, dist.ProcessGroup):
        return tp_group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if isinstance(tp_group, DeviceMesh):
        if tp_group.ndim == 1:
            return tp_group.get_group()
        names = tp_group.mesh_dim_names or ()
        if "tp" in names:
            return tp_group.get_group("tp")
        raise ValueError(f"{owner}: tp_group is a {tp_group.ndim}-D DeviceMesh without a dim "
                         f"named 'tp' (dims {names}); pass its tensor-parallel dim, e.g. "
                         "mesh['tp']")
    raise TypeError(f"{owner}: tp_group must be a torch.distributed ProcessGroup, a DeviceMesh "
                    f"or None, got {type(tp_group).__name__}")


@dataclasses.dataclass
class TPConfig:
    """A module's tensor-parallel setting: size, group (None: the default group) and sequence
    parallelism (only meaningful with size > 1, as in TE)."""

    size: int = 1
    group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    _specs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def make(cls, owner: str, tp_group, tp_size, sequence_parallel: bool) -> "TPConfig":
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
        group = resolve_group(tp_group, owner)
        if group is not None:
            n = dist.get_world_size(group)
            if tp_size not in (1, n):
                raise ValueError(f"{owner}: tp_group has {n} ranks but tp_size={tp_size}; pass "
                                 f"tp_size={n} (or leave it out: it is taken from tp_group)")
            tp_size = n
        return cls(tp_size, group, bool(sequence_parallel) and tp_size > 1)

    def set_group(self, owner: str, tp_group) -> None:
        group = resolve_group(tp_group, owner)
        n = 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)
        if n != self.size:
            raise ValueError(f"{owner}.set_tensor_parallel_group: the group has {n} ranks but "
                             f"the module was built with tp_size={self.size} (its parameters "
                             "are shards of that size); build it with the group's size")
        self.group = group
        self._specs.clear()

    def active_group(self, owner: str):
        """The group the collectives use; checked here, before any collective runs."""
        if self.group is not None:
            return self.group
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{owner}: tp_size={self.size} needs torch.distributed: call "
                               "dist.init_process_group and pass tp_group (or call "
                               "set_tensor_parallel_group)")
        if dist.get_world_size() != self.size:
            raise ValueError(f"{owner}: tp_size={self.size} but no tp_group was given and the "
                             f"default group has {dist.get_world_size()} ranks; pass tp_group "
                             "or call set_tensor_parallel_group(group)")
        return dist.group.WORLD

    def rank(self, owner: str) -> int:
        return 0 if self.size == 1 else dist.get_rank(self.active_group(owner))

    def spec(self, owner: str, mode: Optional[str]) -> Optional["TPSpec"]:
        """The TPSpec of a GEMM in `mode` (None without TP); made once per mode and group."""
        if self.size == 1 or mode is None:
            return None
        spec = self._specs.get(mode)
        if spec is None:
            spec = TPSpec(mode, self.active_group(owner), self.size, self.sequence_parallel)
            self._specs[mode] = spec
        return spec


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """What one GEMM call needs: its parallel mode and the group (built per call)."""

    mode: str                # "column" | "row"
    group: dist.ProcessGroup
    size: int
    sequence_parallel: bool


def check_parallel_mode(owner: str, parallel_mode) -> None:
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got "
                         f"{parallel_mode!r}")


def divide(owner: str, name: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ValueError(f"{owner}: {name}={size} is not divisible by tp_size={tp_size}; "
                         f"tensor parallelism splits it into tp_size equal shards")
    return size // tp_size


# --------------------------------------------------------------------------- collectives
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's x (same shape on every rank). FP8 tensors
    travel as their bytes."""
    n = group_world_size(group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.dtype.itemsize == 1 and x.dtype.is_floating_point:  # fp8: gloo has no fp8 dtypes
        _all_gather(out.view(torch.uint8), x.view(torch.uint8), group=group)
    else:
        _all_gather(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Rank r's chunk (along dim 0) of the sum over ranks of x."""
    return start_reduce_scatter_dim0(x, group)()


def start_reduce_scatter_dim0(x: torch.Tensor, group):
    """reduce_scatter_dim0 started asynchronously: returns a function that waits for it and
    gives the result (work on other streams, e.g. a wgrad GEMM, runs meanwhile)."""
    n = group_world_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism: dim 0 of the tensor to reduce-scatter "
                         f"({tuple(x.shape)}) is not divisible by tp_size={n}; the sequence "
                         "(dim 0) length must be a multiple of tp_size")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter(out, x, group=group, async_op=True)
    return lambda: (work.wait(), out)[1]


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return start_all_reduce(x, group)()


def start_all_reduce(x: torch.Tensor, group):
    """all_reduce started asynchronously: returns a function that waits and gives the sum."""
    x = x.contiguous()
    work = dist.all_reduce(x, group=group, async_op=True)
    return lambda: (work.wait(), x)[1]


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward (the input of a column-parallel GEMM; a replicated
    parameter whose gradient each rank only sees part of)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return all_reduce(dy.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_dim0(dy, ctx.group), None


class _GatherSeqSplitGrad(_GatherSeq):
    """All-gather forward; backward keeps this rank's chunk of the gradient (every rank computed
    the same full gradient from the same whole output, so nothing is summed)."""

    @staticmethod
    def backward(ctx, dy):
        return _chunk0(dy, ctx.group).contiguous(), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim0(dy, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk0(x, group).clone()

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim0(dy, ctx.group), None


def _chunk0(x: torch.Tensor, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism: dim 0 of shape {tuple(x.shape)} (the sequence "
                         f"for sbhd/thd, the batch for bshd) is not divisible by tp_size={n}")
    return x.chunk(n, 0)[r]


def _group(group, owner):
    group = resolve_group(group, owner)
    return dist.group.WORLD if group is None else group


# what a fused producer attaches to its output (a pre-quantized GEMM operand on a zero-stride
# carrier, functional.fused_cast.block_carrier): an identity forward hands it on
_CARRIED = ("_block_operand", "_block_carrier")


def copy_to_tensor_parallel_region(x, group=None):
    """Identity forward, all-reduce (sum) backward. A block carrier stays one: the output holds
    x's pre-quantized blocks (the input of a column-parallel GEMM written by a fused norm)."""
    out = _CopyToTP.apply(x, _group(group, "copy_to_tensor_parallel_region"))
    for name in _CARRIED:
        if hasattr(x, name):
            setattr(out, name, getattr(x, name))
    return out


def reduce_from_tensor_parallel_region(x, group=None):
    """All-reduce (sum) forward, identity backward."""
    return _ReduceFromTP.apply(x, _group(group, "reduce_from_tensor_parallel_region"))


def gather_from_sequence_parallel_region(x, group=None, tensor_parallel_output_grad=True):
    """All-gather along dim 0 forward. Backward: reduce-scatter when the output feeds
    tensor-parallel work (each rank holds a partial gradient: a column-parallel GEMM); with
    tensor_parallel_output_grad=False, where every rank computes the same thing from the whole
    output (a model's replicated head), this rank's chunk of the gradient (Megatron's
    argument)."""
    fn = _GatherSeq if tensor_parallel_output_grad else _GatherSeqSplitGrad
    return fn.apply(x, _group(group, "gather_from_sequence_parallel_region"))


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """Reduce-scatter along dim 0 forward, all-gather backward."""
    return _ReduceScatterSeq.apply(x, _group(group, "reduce_scatter_to_sequence_parallel_region"))


def scatter_to_sequence_parallel_region(x, group=None):
    """This rank's dim-0 chunk of a full (replicated) tensor; the gradient is all-gathered.
    How a sequence-parallel model takes its input (and `gather_from_sequence_parallel_region`
    how its output is made whole again)."""
    return _ScatterSeq.apply(x, _group(group, "scatter_to_sequence_parallel_region"))


def sp_replicated(param, spec: Optional[TPSpec]):
    """A replicated parameter used on sequence-parallel (dim-0 sharded) activations: its
    gradient from the local rows is all-reduced over the group in backward (TE marks such
    params and leaves the reduction to Megatron; tritium does it, see docs/tensor_parallel.md)."""
    if param is None or spec is None or not spec.sequence_parallel:
        return param
    return _CopyToTP.apply(param, spec.group)


# --------------------------------------------------------------------------- state dicts
def shard_tensor(full: torch.Tensor, dim: int, blocks, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full`: each block (full sizes along `dim`) chunked in `size`."""
    parts = torch.split(full, list(blocks), dim=dim)
    return torch.cat([p.chunk(size, dim)[rank] for p in parts], dim=dim).contiguous()


def unshard_tensor(shards, dim: int, blocks, size: int) -> torch.Tensor:
    """Inverse of shard_tensor: the full tensor from every rank's shard (in rank order)."""
    local = [b // size for b in blocks]
    pieces = [torch.split(s, local, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(blocks))],
                     dim=dim)


def _sharded_params(model: torch.nn.Module):
    """{state-dict key: (dim, full block sizes, TPConfig)} of every TP-sharded parameter."""
    out = {}
    for prefix, mod in model.named_modules():
        layout = getattr(mod, "_tp_layout", None)
        if layout is None:
            continue
        for name, (dim, blocks) in layout().items():
            out[f"{prefix}.{name}" if prefix else name] = (dim, blocks, mod.tp)
    return out


def shard_state_dict(model: torch.nn.Module, full_state_dict: dict) -> dict:
    """The state dict this rank's TP `model` loads, from the state dict of the same model built
    with tp_size=1 (same keys). Replicated entries (norm weights, row-parallel biases, FP8
    extra state) are taken as they are. A block-scaled FP8 weight (Float8BlockTensor) is
    sharded with its fp8 bytes and scales, where its shards hold whole 128-element blocks
    (each sharded size a multiple of 128 x tp_size); where they would not, a block-FP8 param
    refuses it (ValueError) and a high-precision one takes its exact dequantized values."""
    from ..fp8.block_tensor import Float8BlockTensor
    from .tp_block_fp8 import shard_block_fp8
    sharded = _sharded_params(model)
    params = dict(model.named_parameters())
    out = {}
    for key, value in full_state_dict.items():
        if key in sharded and isinstance(value, torch.Tensor):
            dim, blocks, tp = sharded[key]
            if value.shape[dim] != sum(blocks):
                raise ValueError(f"shard_state_dict: {key} has shape {tuple(value.shape)}; "
                                 f"dim {dim} must be the full size {sum(blocks)}")
            rank = tp.rank("shard_state_dict")
            if isinstance(value, Float8BlockTensor) and tp.size > 1:
                value = shard_block_fp8(key, value, params.get(key), dim, blocks, tp.size, rank)
            else:
                value = shard_tensor(value, dim, blocks, tp.size, rank)
        out[key] = value
    return out


def load_full_state_dict(model: torch.nn.Module, full_state_dict: dict, strict: bool = True):
    """`model.load_state_dict` of this rank's shards of a full (tp_size=1) state dict."""
    return model.load_state_dict(shard_state_dict(model, full_state_dict), strict=strict)


def _unshard(local: torch.Tensor, dim: int, blocks, group, size: int) -> torch.Tensor:
    """The full tensor (block sizes `blocks` along `dim`) from every rank's shard `local`
    (one all-gather over `group`)."""
    moved = local.movedim(dim, 0).contiguous()
    shards = all_gather_dim0(moved, group).chunk(size, 0)
    return unshard_tensor([s.movedim(0, dim) for s in shards], dim, blocks, size)


def gather_full_state_dict(model: torch.nn.Module) -> dict:
    """The full (tp_size=1) state dict of a TP model, on every rank (one all-gather per sharded
    parameter, collective over each module's TP group: call it on every rank). DTensor entries
    (a model sharded with FSDP2 over the other mesh dim) are made whole first (full_tensor).
    A block-scaled FP8 weight comes back as a Float8BlockTensor with its shards' fp8 bytes and
    scales where they hold whole blocks (see shard_state_dict), else as its exact dequantized
    values (blocks cut by the shards are not blocks of the full weight)."""
    from torch.distributed.tensor import DTensor
    from ..fp8.block_tensor import Float8BlockTensor
    from .tp_block_fp8 import block_fp8, block_parts, whole_blocks
    sharded = _sharded_params(model)
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if key in sharded and isinstance(value, torch.Tensor):
            dim, blocks, tp = sharded[key]
            if tp.size > 1:
                group = tp.active_group("gather_full_state_dict")
                if not isinstance(value, Float8BlockTensor):
                    value = _unshard(value.detach(), dim, blocks, group, tp.size)
                elif whole_blocks(blocks, tp.size):   # the shards' blocks are the full
                    parts = {n: _unshard(p, dim, b, group, tp.size)   # weight's: bytes and
                             for n, p, b in block_parts(value, dim, blocks)}  # scales kept
                    values = _unshard(value.dequantize(), dim, blocks, group, tp.size)
                    value = block_fp8(values, parts, value)
                else:   # shards that cut the blocks: their exact dequantized values
                    value = _unshard(value.dequantize(), dim, blocks, group, tp.size)
        out[key] = value
    return out


__all__ = ["TPConfig", "TPSpec", "resolve_group", "all_gather_dim0", "reduce_scatter_dim0",
           "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "shard_tensor", "unshard_tensor",
           "shard_state_dict", "load_full_state_dict", "gather_full_state_dict"]
