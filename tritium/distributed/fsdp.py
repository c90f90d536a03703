"""FSDP2 with FP8 all-gather for high-precision weights (torchao's `enable_fsdp_float8_all_gather`).

tritium modules work under `torch.distributed.fsdp.fully_shard` as they are: FSDP2 shards each
parameter along dim 0 as a DTensor and all-gathers per module group; FusedAdam / FusedSGD step
the local shards (tritium/optimizers/_dtensor.py). What travels depends on the weight:
  * bf16 / fp32 weights: their own bytes (or MixedPrecisionPolicy's param_dtype), and the
    module casts the gathered weight to FP8 under fp8_autocast, as without FSDP.
  * FP8 params (fp8_model_init / quantized_model_init): FP8 bytes, always (Float8Tensor
    implements FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather: tritium/fp8/tensor.py).
  * high-precision weights after `enable_fp8_all_gather(model)`: FP8 bytes. Each GEMM weight
    becomes an `FP8AllGatherWeight`, a wrapper tensor subclass around the bf16/fp32 weight
    whose `fsdp_pre_all_gather` casts the local shard to FP8 with the weight's one scale, so
    the gather moves 1 byte per element; `fsdp_post_all_gather` (shared with Float8Tensor)
    builds the unsharded Float8Tensor. The module then runs its FP8 GEMMs on it without a
    cast. Optimizer, gradients and checkpoints see the plain high-precision shard.

The gathered weight's fp8 transpose (dgrad's w8^T) is lazy, for both kinds of FP8 gather: each
gather only marks it stale, and the first reader after the gather (the Linear's backward, which
gets `transpose_data` in the w8^T slot instead of a tensor) makes it, in the buffer FSDP2 frees
at reshard and allocates again for the next gather. So a weight gathered twice a step (for the
forward, then for backward after reshard_after_forward, or for a recompute) is transposed once,
and a no-grad forward transposes nothing. The rule and its readers: fp8/tensor.py's note.

One scale per weight across shards:
  * DelayedScaling: the module's own weight scale (its delayed-scaling state, equal on every
    rank); the shard's amax is recorded into the weight's amax slot and reduced with every other
    amax of the step in the region's one MAX all-reduce at fp8_autocast exit (fp8_group must
    contain the shard group: the default group does). A gather in backward (FSDP2 resharded
    the weight after forward, or a recompute) casts with the scale of the forward's gather,
    kept per weight, and records nothing: the scale updates at the forward's autocast exit,
    and dgrad must read the fp8 weight the forward read.
  * Float8CurrentScaling: the weight's amax over all shards. `precompute_fp8_scales_for_fsdp
    (model)` reduces the local amaxes of ALL such weights in one all-reduce (call it after each
    optimizer.step(), as torchao's `precompute_float8_dynamic_scale_for_fsdp`); without it,
    each gather reduces its weight's amax on its own (one small all-reduce per weight). A
    precomputed scale is used until the next precompute, so call it after every step.
Naming: TE has no such switch; the name follows tritium's fp8_* functions and torchao's.

Gathered weights are FP8 everywhere they are used: outside fp8_autocast the module dequantizes
them (as torchao does). Not supported: parameters_split weights, wrapping after fully_shard.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..fp8.cast import amax_into, cast_transpose
from ..fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from ..fp8.tensor import check_amax_group_covers, fp8_from_all_gather
from ..ref.cast import current_scale

aten = torch.ops.aten


@dataclasses.dataclass(eq=False)
class _WeightConfig:
    """What one weight's FP8 gather needs (shared by every view FSDP makes of the shard)."""
    recipe: Recipe
    module: torch.nn.Module
    slot: int                                   # the weight's forward slot in module.fp8_meta
    precomputed_scale: Optional[torch.Tensor] = None
    forward_scale: Optional[torch.Tensor] = None  # delayed: the scale of the last forward gather

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.recipe.fp8_format.forward_dtype


# Ops whose results stay wrapped: how FSDP2 builds, pads, views and moves a shard.
_WRAP_OPS = {aten.detach.default, aten.alias.default, aten.view.default,
             aten._unsafe_view.default, aten.as_strided.default, aten.split.Tensor,
             aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default,
             aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default,
             aten.clone.default, aten._to_copy.default,
             aten.chunk.default, aten.reshape.default}


def _writes_self(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers as FP8 (see the module note)."""

    _hp_shard: torch.Tensor
    _config: _WeightConfig

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: _WeightConfig):
        self = torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), dtype=tensor.dtype, device=tensor.device,
            requires_grad=tensor.requires_grad)
        self._hp_shard, self._config = tensor, config
        return self

    def __repr__(self, *, tensor_contents=None):
        return f"FP8AllGatherWeight({self._hp_shard!r}, recipe={self._config.recipe})"

    def __tensor_flatten__(self):
        return ["_hp_shard"], self._config

    @staticmethod
    def __tensor_unflatten__(inner, config, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_hp_shard"], config)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        config = next(a._config for a in args if isinstance(a, FP8AllGatherWeight))

        def unwrap(t):
            return t._hp_shard if isinstance(t, FP8AllGatherWeight) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if args and isinstance(args[0], FP8AllGatherWeight) and _writes_self(func):
            return args[0]                       # in place: it ran on the wrapped tensor
        if func in _WRAP_OPS:
            return tree_map(lambda t: FP8AllGatherWeight(t, config)
                            if isinstance(t, torch.Tensor) else t, out)
        return out

    # ------------------------------------------------------------------ FSDP2 extension points
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None,
                            mp_policy=None):
        """This shard cast to FP8 with the weight's one scale, as uint8, padded to FSDP's rows."""
        x = self._hp_shard
        if outer_size is not None:
            rows = -(-outer_size[0] // mesh.size())
            if x.shape[0] < rows:
                x = torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
        cfg = self._config
        x2d = x.detach().reshape(-1, x.shape[-1])
        if isinstance(cfg.recipe, DelayedScaling):
            check_amax_group_covers(mesh, "a weight cast to FP8 with its delayed scale")
            state = _weight_state(cfg, x.device)
            scale, amax = state.scale_slot(cfg.slot), state.amax_slot(cfg.slot)
            if torch._C._current_graph_task_id() != -1 and cfg.forward_scale is not None:
                # FSDP2 gathers again in backward (resharded after forward, or a recompute):
                # the forward's scale, not the one updated since, so dgrad and the recompute
                # read the fp8 weight the forward read (one fp8 weight per step, as TE's)
                scale, amax = cfg.forward_scale, None
            else:
                if cfg.forward_scale is None:
                    cfg.forward_scale = torch.empty_like(scale)
                cfg.forward_scale.copy_(scale)
        else:
            scale, amax = cfg.precomputed_scale, None
            if scale is None:
                scale = _current_scales([self._hp_shard], [cfg], mesh.get_group())[0]
        data, _, scale_inv = cast_transpose(x2d, scale, amax, cfg.fp8_dtype)
        rows = None if outer_size is None else outer_size[0]
        return (data.view(x.shape).view(torch.uint8),), (rows, scale_inv)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return fp8_from_all_gather(all_gather_outputs, metadata, self._config.fp8_dtype,
                                   param_dtype, out=out)


def _weight_state(cfg: _WeightConfig, device: torch.device):
    meta = cfg.module.fp8_meta
    if meta.fwd is None or meta.fwd.scale.device != device:
        meta.prepare(cfg.recipe, device)
    return meta.fwd


def _current_scales(shards, configs, group, reduce: bool = True) -> list:
    """Float8CurrentScaling scales of several weights from their shards: one MAX all-reduce."""
    import torch.distributed as dist
    device = shards[0].device
    amax = torch.zeros(len(shards), dtype=torch.float32, device=device)
    for i, x in enumerate(shards):
        amax_into(x.detach(), amax[i:i + 1])
    if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return [current_scale(amax[i:i + 1], c.fp8_dtype, c.recipe.amax_epsilon,
                          c.recipe.power_2_scale) for i, c in enumerate(configs)]


def _gemm_weights(module) -> dict:
    """{param name: forward weight slot} of a tritium GEMM module; {} for other modules."""
    from ..modules.layernorm_mlp import LayerNormMLP
    from ..modules.linear import Linear
    if isinstance(module, LayerNormMLP):
        return {"fc1_weight": 1, "fc2_weight": 3}
    if isinstance(module, Linear):
        if len(module.split_sizes) != 1:
            raise NotImplementedError(
                "enable_fp8_all_gather: a Linear with parameters_split is not supported; build "
                "it without parameters_split (one fused weight)")
        return {"weight": 1}
    return {}


def enable_fp8_all_gather(model: torch.nn.Module, recipe: Optional[Recipe] = None):
    """Make FSDP2 gather the high-precision GEMM weights of `model`'s tritium modules as FP8.

    Call it BEFORE fully_shard (it works on meta-device models too). `recipe` (default
    Float8CurrentScaling(), torchao's tensorwise dynamic scaling) picks the weights' scales;
    use the same recipe in fp8_autocast. FP8 params (fp8_model_init) are left as they are:
    they already travel as FP8. Returns the model."""
    from torch.distributed.tensor import DTensor
    recipe = Float8CurrentScaling() if recipe is None else recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError("enable_fp8_all_gather(recipe=...) takes recipe.DelayedScaling or "
                        f"recipe.Float8CurrentScaling, got {type(recipe).__name__}")
    for name, module in model.named_modules():
        weights = _gemm_weights(module)
        if getattr(module, "primary_weights_in_fp8", False):
            continue
        for pname, slot in weights.items():
            p = module._parameters[pname]
            if isinstance(p, DTensor):
                raise RuntimeError(f"enable_fp8_all_gather: {name}.{pname} is already sharded; "
                                   "call enable_fp8_all_gather(model) before fully_shard")
            if isinstance(p, FP8AllGatherWeight):
                continue
            config = _WeightConfig(recipe, module, slot)
            module._parameters[pname] = torch.nn.Parameter(
                FP8AllGatherWeight(p.detach(), config), requires_grad=p.requires_grad)
    return model


@torch.no_grad()
def precompute_fp8_scales_for_fsdp(model: torch.nn.Module) -> None:
    """One MAX all-reduce (per mesh) of the amaxes of every current-scaling FP8AllGatherWeight
    in `model`; the next all-gathers cast with these scales. Call after each optimizer.step()."""
    from torch.distributed.tensor import DTensor
    by_mesh: dict = {}
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, FP8AllGatherWeight) and \
                isinstance(local._config.recipe, Float8CurrentScaling):
            mesh = p.device_mesh if isinstance(p, DTensor) else None
            by_mesh.setdefault(mesh, []).append(local)
    for mesh, weights in by_mesh.items():
        scales = _current_scales([w._hp_shard for w in weights], [w._config for w in weights],
                                 None if mesh is None else mesh.get_group(),
                                 reduce=mesh is not None)
        for w, s in zip(weights, scales):
            w._config.precomputed_scale = s


__all__ = ["FP8AllGatherWeight", "enable_fp8_all_gather", "precompute_fp8_scales_for_fsdp"]
