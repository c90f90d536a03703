"""What every FP8-capable module shares: its FP8Meta, the per-call FP8 plans, checkpoints.

A module with `num_gemms` GEMMs owns one FP8Meta whose forward state has two slots per GEMM
(input 2i, weight 2i+1) and whose backward state has one (grad_output i). `_fp8_plans(device)`
reads the active fp8_autocast, makes the states match the recipe, registers them with the
autocast region and returns one `FP8Plan` per GEMM, or None when neither FP8 nor calibration is
on. GEMM 0 (the first in forward, so the last in backward) carries the region's backward scale
update when the module is the region's first. The FP8 state goes into checkpoints through
get_extra_state/set_extra_state as tensors and plain values only.

FP8 params (modules built under `fp8_model_init`): the subclass names its GEMM weights and their
forward slots in `_fp8_weight_slots`; `reset_parameters` initialises them in high precision and
`_quantize_fp8_params` then replaces each with a Float8Tensor Parameter tied to its slot, or
under Float8BlockScaling with a Float8BlockTensor Parameter (see tritium/fp8/model_init.py for
the contract with the optimizer).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..fp8 import recompute
from ..fp8.autocast import current as current_autocast
from ..fp8.formats import HIGH_PRECISION_DTYPES, fp8_max
from ..fp8.model_init import fp8_params_config
from ..fp8.block_tensor import Float8BlockTensor
from ..fp8.quantized_tensor import QuantizedTensor
from ..fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe
from ..fp8.scaling import FP8Meta
from ..fp8.tensor import Float8Tensor
from ..functional.fp8_plan import FP8Plan, WeightCache
from ..ref.cast import current_scale
from ..ref.scaling import compute_scale


def check_input(owner: str, inp, weight: torch.Tensor, dim_name: str, dim: int) -> None:
    """The checks every GEMM module runs on its input, with messages that name the fix."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{owner}.forward: inp must be a torch.Tensor, got {type(inp).__name__}")
    if inp.device != weight.device:
        raise ValueError(f"{owner}.forward: inp is on {inp.device} but the weight is on "
                         f"{weight.device}; move one of them (inp.to({str(weight.device)!r}))")
    if inp.dim() < 1 or inp.shape[-1] != dim:
        raise ValueError(f"{owner}.forward: inp has shape {tuple(inp.shape)}; its last dim must "
                         f"be {dim_name}={dim}")
    if inp.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{owner}.forward: inp dtype {inp.dtype} is not supported; pass float32, "
                        "bfloat16 or float16")
    if inp.dtype != weight.dtype and not torch.is_autocast_enabled(inp.device.type):
        raise TypeError(f"{owner}.forward: inp dtype {inp.dtype} differs from the params dtype "
                        f"{weight.dtype}; cast the input, build {owner} with "
                        f"params_dtype={inp.dtype}, or run under torch.autocast")


def check_fp8_dims(owner: str, sizes: dict) -> None:
    """FP8 GEMMs need every feature dim divisible by 16: say which one and what to pad it to."""
    for name, size in sizes.items():
        if size % 16:
            raise ValueError(f"{owner}({name}={size}) cannot run in FP8: FP8 GEMMs need "
                             f"{' and '.join(sizes)} divisible by 16; pad {name} to "
                             f"{-(-size // 16) * 16} or run this module outside fp8_autocast")


def prepare_fp8(model: torch.nn.Module, fp8_recipe) -> None:
    """Create every FP8 module's scaling state for `fp8_recipe` now, as its first forward under
    fp8_autocast would (FP8 attention's too, under fp8_dpa / fp8_mha). Before torch.compile it
    spares the compiled model the graph break of that first call (docs/compile.md)."""
    if not isinstance(fp8_recipe, Recipe):
        raise TypeError("prepare_fp8: fp8_recipe must be a tritium recipe (e.g. "
                        f"recipe.DelayedScaling()), got {type(fp8_recipe).__name__}")
    from ..attention import fp8 as attn_fp8
    from ..attention.dot_product_attention import DotProductAttention
    model_device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for m in model.modules():
        if isinstance(m, FP8Module):
            device = next((p.device for p in m.parameters()), torch.device("cpu"))
            m.fp8_meta.prepare(fp8_recipe, device)
            if m._fp8_param_recipe is not None:
                m._link_fp8_params()
        elif isinstance(m, DotProductAttention):   # fp8_dpa / fp8_mha under DelayedScaling
            attn_fp8.prepare(m, fp8_recipe, model_device)


class FP8Module(torch.nn.Module):
    def __init__(self, num_gemms: int = 1):
        super().__init__()
        self.fp8_meta = FP8Meta(2 * num_gemms, num_gemms)
        self._weight_caches = [WeightCache() for _ in range(num_gemms)]
        config = fp8_params_config()
        self._fp8_param_recipe = None if config is None else config[0]
        self._preserve_init_val = config is not None and config[1]
        self._fp8_weight_slots: dict[str, int] = {}  # set by the subclass: param name -> slot
        self._linked_history = None

    @property
    def primary_weights_in_fp8(self) -> bool:
        """True for a module built under fp8_model_init (its GEMM weights are Float8Tensors)."""
        return self._fp8_param_recipe is not None

    def _unquantize_fp8_params(self) -> None:
        """Before re-initialising: give each FP8 weight a high-precision Parameter to init. An
        FSDP2 shard (a DTensor of a Float8Tensor, e.g. a meta-device model after to_empty)
        gets a high-precision DTensor like it; `_quantize_fp8_params` then fills the shard in
        place, so the parameter FSDP2 manages stays."""
        self._fp8_shards = {}
        for name in self._fp8_weight_slots:
            p = self._parameters[name]
            local = getattr(p, "_local_tensor", None)
            if isinstance(local, QuantizedTensor):
                self._check_shardable_fp8_init(name)
                from torch.distributed.tensor import DTensor
                hp = DTensor.from_local(torch.empty(local.shape, dtype=p.dtype, device=local.device),
                                        p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
                self._fp8_shards[name] = p
                self._parameters[name] = torch.nn.Parameter(hp, requires_grad=p.requires_grad)
            elif isinstance(p, QuantizedTensor):
                self._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=p.device),
                    requires_grad=p.requires_grad)

    def _check_shardable_fp8_init(self, name: str) -> None:
        if not isinstance(self._fp8_param_recipe, DelayedScaling):
            raise NotImplementedError(
                f"{type(self).__name__}.reset_parameters: the FSDP2-sharded FP8 weight {name!r} "
                f"was made under {type(self._fp8_param_recipe).__name__}; sharded FP8 weights "
                "are initialized in place under DelayedScaling only (build with "
                "fp8_model_init(recipe=DelayedScaling()))")
        if self._preserve_init_val:
            raise NotImplementedError(
                f"{type(self).__name__}.reset_parameters: preserve_high_precision_init_val is not "
                f"supported for the FSDP2-sharded FP8 weight {name!r}; the optimizer's masters "
                "start from the FP8 values")

    def _fill_fp8_shard(self, name: str, slot: int, hp, recipe: DelayedScaling) -> None:
        """This rank's shard of the initialized weight `hp` (a DTensor) quantized into the
        FSDP2 shard in place, with ONE scale for the whole weight: the amax of every shard,
        all-reduced over the mesh, recorded as a cast would record it."""
        import torch.distributed as dist
        target = self._fp8_shards.pop(name)
        local_hp = hp.detach()._local_tensor
        self.fp8_meta.prepare(recipe, local_hp.device)
        state = self.fp8_meta.fwd
        with torch.no_grad():
            amax = (local_hp.abs().amax().float().reshape(1) if local_hp.numel()
                    else torch.zeros(1, device=local_hp.device))
            for group in hp.device_mesh.get_all_groups():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            scale = compute_scale(amax, state.scale_slot(slot), fp8_max(state.fp8_dtype),
                                  recipe.margin)
            state.scale_slot(slot).copy_(scale)
            state.amax_slot(slot).copy_(amax)
            q = Float8Tensor.quantize(local_hp, state.scale_slot(slot), state.fp8_dtype)
            shard = target._local_tensor
            shard._data.copy_(q._data)
            shard._scale_inv.copy_(q._scale_inv)
        self._parameters[name] = target

    def _quantize_fp8_params(self) -> None:
        """After initialising: each GEMM weight becomes a Float8Tensor Parameter whose first
        scale comes from its own amax (recorded in history row 0 as a cast would)."""
        recipe = self._fp8_param_recipe
        if recipe is None:
            return
        if isinstance(recipe, Float8CurrentScaling):
            return self._quantize_current_scaled_params(recipe)
        if isinstance(recipe, Float8BlockScaling):
            return self._quantize_block_params(recipe)
        for name, slot in self._fp8_weight_slots.items():
            p = self._parameters[name]
            if name in getattr(self, "_fp8_shards", {}):
                self._fill_fp8_shard(name, slot, p, recipe)
                continue
            self.fp8_meta.prepare(recipe, p.device)
            state = self.fp8_meta.fwd
            value = p.detach()
            with torch.no_grad():
                amax = value.abs().amax().float().reshape(1)
                scale = compute_scale(amax, state.scale_slot(slot), fp8_max(state.fp8_dtype),
                                      recipe.margin)
                state.scale_slot(slot).copy_(scale)
                state.amax_slot(slot).copy_(amax)
            q = Float8Tensor.quantize(value, state.scale_slot(slot), state.fp8_dtype,
                                      with_transpose=True)
            param = torch.nn.Parameter(q, requires_grad=p.requires_grad)
            if self._preserve_init_val:
                param._high_precision_init_val = value.to("cpu", copy=True)
            self._parameters[name] = param
        self._link_fp8_params()

    def _quantize_current_scaled_params(self, recipe: Float8CurrentScaling) -> None:
        """Under current scaling each FP8 weight owns its scale, taken from its own amax."""
        dtype = recipe.fp8_format.forward_dtype
        current = (float(recipe.amax_epsilon), recipe.power_2_scale)
        for name in self._fp8_weight_slots:
            p = self._parameters[name]
            value = p.detach()
            with torch.no_grad():
                scale = current_scale(value.abs().amax().float().reshape(1), dtype, *current)
            q = Float8Tensor.quantize(value, scale, dtype, with_transpose=True)
            param = torch.nn.Parameter(q, requires_grad=p.requires_grad)
            param._current_scaling = current
            if self._preserve_init_val:
                param._high_precision_init_val = value.to("cpu", copy=True)
            self._parameters[name] = param

    def _quantize_block_params(self, recipe: Float8BlockScaling) -> None:
        """Under Float8BlockScaling each FP8 weight holds its own block scales."""
        q = recipe.fp8_quant_fwd_weight
        for name in self._fp8_weight_slots:
            p = self._parameters[name]
            value = p.detach()
            w = Float8BlockTensor.quantize(value, recipe.fp8_format.forward_dtype,
                                           block_2d=recipe.w_block_scaling_dim == 2,
                                           power_2_scale=q.power_2_scale,
                                           amax_epsilon=q.amax_epsilon)
            param = torch.nn.Parameter(w, requires_grad=p.requires_grad)
            if self._preserve_init_val:
                param._high_precision_init_val = value.to("cpu", copy=True)
            self._parameters[name] = param

    def _link_fp8_params(self) -> None:
        """Point each FP8 weight's `_scale` / `_amax` at its slot in the current state (the
        state's tensors are replaced when a recipe changes the history length or format).
        Current-scaled FP8 weights own their scale: nothing to link."""
        state = self.fp8_meta.fwd
        if not isinstance(self._fp8_param_recipe, DelayedScaling):
            return
        if state is None or state.amax_history is self._linked_history:
            return
        for name, slot in self._fp8_weight_slots.items():
            p = self._parameters[name]
            p = getattr(p, "_local_tensor", p)   # FSDP2's DTensor: its local fp8 shard
            if isinstance(p, Float8Tensor):
                p._scale, p._amax = state.scale_slot(slot), state.amax_slot(slot)
        self._linked_history = state.amax_history

    def _fp8_plans(self, device: torch.device,
                   is_first_microbatch: Optional[bool]) -> Optional[list]:
        state = current_autocast()
        if state is None or not (state.enabled or state.calibrating):
            return None
        meta = self.fp8_meta
        meta.prepare(state.recipe, device)
        if self._fp8_param_recipe is not None:
            self._link_fp8_params()
        fwd, scope = meta.fwd, recompute.current()
        again = scope is not None and scope.recomputing
        if scope is not None:  # inside tritium.distributed.checkpoint (fp8/recompute.py)
            fwd = scope.forward_scales(meta.fwd)
            if again and is_first_microbatch:  # the forward cached this step's weight cast
                is_first_microbatch = False
        # Under torch.compile the backward state is not the region's: GEMM 0's backward (the
        # module's last) updates it in the graph.
        compiling = torch.compiler.is_compiling()
        first = state.region.register(meta.fwd, None if compiling else meta.bwd, state.recipe,
                                      state.group, again)
        if not state.enabled and meta.fwd is None:  # calibrating needs a delayed-scaling state
            return None
        return [FP8Plan(recipe=state.recipe, fwd=fwd, bwd=meta.bwd,
                        compute_in_fp8=state.enabled,
                        region=state.region if first and i == 0 and not compiling else None,
                        weight_cache=cache, is_first_microbatch=is_first_microbatch,
                        input_slot=2 * i, weight_slot=2 * i + 1, grad_slot=i,
                        update_bwd=compiling and i == 0 and meta.bwd is not None,
                        amax_group=state.group, grad=torch.is_grad_enabled())
                for i, cache in enumerate(self._weight_caches)]

    def _fp8_plan(self, device: torch.device, is_first_microbatch: Optional[bool]):
        plans = self._fp8_plans(device, is_first_microbatch)
        return None if plans is None else plans[0]

    def _forward_scales(self):
        """The forward ScalingState a fused cast reads now (frozen copy when recomputing)."""
        scope = recompute.current()
        return self.fp8_meta.fwd if scope is None else scope.forward_scales(self.fp8_meta.fwd)

    def _shard_init_rng(self, sharded: bool, name: Optional[str] = None):
        """TE's init of TP shards: inside the RNG tracker's fork when one was given (each rank
        seeds it differently, so the shards differ); the default generator otherwise."""
        tracker = getattr(self, "get_rng_state_tracker", None)
        if not sharded or tracker is None:
            return contextlib.nullcontext()
        return tracker().fork(name) if name else tracker().fork()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's method: the group the tensor-parallel collectives use (a ProcessGroup or a
        DeviceMesh); its size must be the tp_size the module was built with."""
        self.tp.set_group(type(self).__name__, tp_group)

    def _clear_weight_caches(self) -> None:
        for cache in self._weight_caches:
            cache.entry = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """A loaded FP8 weight drops its kept high-precision init (fp8_model_init(
        preserve_high_precision_init_val=True)): the optimizer seeds its master from that init,
        so its first step would write the init back over the loaded weight."""
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) > errors:
            return
        for name in self._fp8_weight_slots:
            p = self._parameters.get(name)
            p = getattr(p, "_local_tensor", p)
            if prefix + name in state_dict and hasattr(p, "clear_high_precision_init_val"):
                p.clear_high_precision_init_val()

    def get_extra_state(self):
        return self.fp8_meta.extra_state()

    def set_extra_state(self, state) -> None:
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        self.fp8_meta.load_extra_state(state, device)
        self._clear_weight_caches()
        self._linked_history = None
        self._link_fp8_params()
