"""What FusedAdam and FusedSGD share: parameter kinds and checks, master weights, the per-step
plan (validate everything, then launch), bucketing into multi-tensor launches, and a
state_dict that `torch.load(weights_only=True)` reads.

Kinds of params: fp32, bf16 or fp16 tensors, and tritium `Float8Tensor`s. An FP8 param `p` is
written through its documented interface only: `p._data` (fp8, in place), `p._scale_inv`
(fp32 [1], in place), `p._scale` (fp32 [1], read, never written: it is a view of the owning
module's scaling state), `p._amax` (optional fp32 [1]: max-accumulated with the new masters'
max |value|) and `p._transpose` (when kept: `p.data_written()` after the update refreshes it).
Its grad is a plain bf16/fp32 tensor. FP8 params need master_weights=True.

Block-scaled FP8 params (`Float8BlockTensor`, kind 'fp8_block', from fp8_model_init under
Float8BlockScaling) have one scale per block, which the fused kernels do not write: the kernel
steps their fp32 master as if it were an fp32 param (same bucket, same bits), then
`p.requantize_(master)` writes every block from it. They need master_weights=True and fp32
masters. Under FSDP2 (a DTensor whose local tensor is a Float8BlockTensor shard of whole
128-row blocks; 1x128 shards hold both forms) the master and moments are sharded like the param
and the shard's blocks are requantized from the local master: exact, each block (and each
columnwise 1x128 tile along N) lies in one shard. Tensor-parallel
(non-Shard(0)) placements of block params are refused.

Step = plan + run. The plan reads every param of every group, checks its grad (present, dense,
same shape and device, fp32/bf16/fp16) and its kind, and raises before anything was launched or
initialized, so a failing step leaves params and state untouched. The run initializes missing
state, then makes one launch per bucket: (device, param storage dtype, grad dtype, FP8 or not,
master or not, remainders or not) within a param group. The kernel runs where
`tritium._device.use_triton` says (CUDA; CPU under TRITON_INTERPRET=1), the PyTorch twin
otherwise.

DTensor params (FSDP2, tensor parallelism) are stepped on their local shards, with state kept
as DTensors like the param: see `_dtensor.py`.

state_dict: the same layout as torch.optim (`state` keyed by the param's index over all groups,
`param_groups` with `params` as index lists), every state tensor unscaled fp32 (bf16 moments
upcast, the master rebuilt from param + remainder), the group step a Python int and lr a float.
load_state_dict checks the whole dict against this optimizer's params (group and param counts,
every shape) before it changes anything, converts to the configured dtypes, and copies into
existing state tensors where they exist (CUDA graphs keep pointing at them).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import _device
from ..fp8.block_tensor import Float8BlockTensor
from ..fp8.tensor import Float8Tensor
from ..ref import adam as ref_adam
from ..ref import cast as ref_cast
from ._dtensor import (check_dtensor_param, is_dtensor, like_param, local, local_grad,
                       local_state, to_param_layout)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KIND_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def param_kind(p: torch.Tensor, where: str) -> str:
    """'fp32', 'bf16', 'fp16', 'fp8' or 'fp8_block'; a clear TypeError for anything else."""
    p = local(p)
    if isinstance(p, Float8Tensor):
        return "fp8"
    if isinstance(p, Float8BlockTensor):
        return "fp8_block"
    kind = _KIND_OF_DTYPE.get(p.dtype)
    if kind is None:
        raise TypeError(f"{where}: params must be float32, bfloat16, float16 or tritium "
                        f"Float8Tensor, got {p.dtype}; convert the model (e.g. model.float())")
    return kind


def storage(p: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels write: the fp8 `_data` of an FP8 param, else the param's data
    (of the local shard for a DTensor param)."""
    p = local(p)
    return p._data if isinstance(p, (Float8Tensor, Float8BlockTensor)) else p.detach()


def fp8_meta(p: torch.Tensor):
    p = local(p)
    return p._scale, p._scale_inv, getattr(p, "_amax", None)


def check_fp8_param(p: Float8Tensor, where: str) -> None:
    scale = getattr(p, "_scale", None)
    for name, t in (("_scale", scale), ("_scale_inv", p._scale_inv),
                    ("_amax", getattr(p, "_amax", None))):
        if t is None and name == "_amax":
            continue
        if t is None or t.dtype != torch.float32 or t.numel() != 1 or t.device != p._data.device:
            got = None if t is None else f"{t.dtype}{tuple(t.shape)} on {t.device}"
            raise ValueError(f"{where}: an FP8 param needs p.{name} as a one-element float32 "
                             f"tensor on {p._data.device} (got {got}); make FP8 params with "
                             "tritium's fp8_model_init or Float8Tensor.quantize(..., scale)")
    if not p._data.is_contiguous():
        raise ValueError(f"{where}: the FP8 param's _data must be contiguous")


def check_group_kinds(kinds: list[str], group_index: int, master_weights: bool) -> None:
    if "bf16" in kinds and "fp16" in kinds:
        raise ValueError(f"param group {group_index} mixes float16 and bfloat16 params; put them "
                         "in separate param groups (optimizer(params=[{'params': fp16_params}, "
                         "{'params': bf16_params}]))")
    if ("fp8" in kinds or "fp8_block" in kinds) and not master_weights:
        raise ValueError(f"param group {group_index} holds FP8 (Float8Tensor / "
                         "Float8BlockTensor) params: they need "
                         "master_weights=True (the fp32 master is the weight, the FP8 param its "
                         "cast)")


def state_tensor(p: torch.Tensor, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
    """A new state tensor for p (its local shard's shape; a DTensor like p for DTensor p)."""
    s = storage(p)
    t = (torch.zeros if zero else torch.empty)(local(p).shape, dtype=dtype, device=s.device)
    return like_param(p, t)


def check_param(p: torch.Tensor, where: str) -> str:
    check_dtensor_param(p, where)
    kind = param_kind(p, where)
    p0, p = p, local(p)
    if kind == "fp8":
        check_fp8_param(p, where)
    elif kind == "fp8_block":
        if is_dtensor(p0) and any(not (pl.is_replicate() or (pl.is_shard() and pl.dim == 0))
                                  for pl in p0.placements):
            raise ValueError(f"{where}: a block-scaled FP8 param (Float8BlockTensor) can be a "
                             f"DTensor sharded on dim 0 only (FSDP2), got {p0.placements}; "
                             "build tensor-parallel models under "
                             "fp8_model_init(recipe=DelayedScaling()) to shard FP8 params")
    elif not p.is_contiguous():
        raise ValueError(f"{where}: params must be contiguous (got strides {p.stride()}); "
                         "use p.data = p.data.contiguous() before building the optimizer")
    return kind


def get_grad(p: torch.Tensor, use_decoupled_grad: bool, where: str) -> Optional[torch.Tensor]:
    """p's gradient after all checks, contiguous, or None when it has none."""
    g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
    if g is None:
        return None
    attr = "p.decoupled_grad" if use_decoupled_grad else "p.grad"
    g, p = local_grad(p, g, attr, where), local(p)
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"{where}: {attr} is sparse ({g.layout}); fused optimizers take dense "
                           "grads only: use torch.optim.SparseAdam / Adam for sparse embeddings")
    if isinstance(g, Float8Tensor) or g.dtype not in _GRAD_DTYPES:
        raise TypeError(f"{where}: {attr} has dtype {g.dtype}; it must be float32, bfloat16 or "
                        "float16 (cast it, or keep FP8 grads as high-precision tensors)")
    if tuple(g.shape) != tuple(p.shape):
        raise ValueError(f"{where}: {attr} has shape {tuple(g.shape)} but the param has shape "
                         f"{tuple(p.shape)}; assign a grad shaped like the param")
    if g.device != storage(p).device:
        raise ValueError(f"{where}: {attr} is on {g.device} but the param is on "
                         f"{storage(p).device}; move the grad to the param's device")
    return g if g.is_contiguous() else g.contiguous()


def impl_for(t: torch.Tensor, kernel_module: str, ref_module):
    if _device.use_triton(t):
        import importlib
        return importlib.import_module(f"..kernels.{kernel_module}", __package__)
    return ref_module


def host_scalars_to(values: list[float], device: torch.device) -> torch.Tensor:
    """fp32 tensor of `values` on `device`, uploaded without a host sync (pinned memory)."""
    t = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class MultiTensorOptimizer(torch.optim.Optimizer):
    """Base of FusedAdam / FusedSGD. Subclasses set `_state_names` (per-param fp32-exportable
    state tensors) and implement `_init_state(p, kind, state)` and `_run_group(...)`."""

    _state_names: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, *, master_weights: bool, use_decoupled_grad: bool,
                 store_param_remainders: bool = False):
        self.master_weights = bool(master_weights)
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.store_param_remainders = bool(store_param_remainders)
        self._tables: dict = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ params and groups
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        index = len(self.param_groups)
        kinds = [check_param(p, f"param group {index}, param {i}") for i, p in enumerate(params)]
        check_group_kinds(kinds, index, self.master_weights)
        super().add_param_group(param_group)

    def _uses_remainder(self, kind: str) -> bool:
        return self.store_param_remainders and self.master_weights and kind == "bf16"

    def _has_master(self, kind: str) -> bool:
        return kind in ("fp8", "fp8_block") or (
            self.master_weights and kind in ("bf16", "fp16") and not self._uses_remainder(kind))

    def _initial_master(self, p: torch.Tensor, kind: str) -> Optional[torch.Tensor]:
        if not self._has_master(kind):
            return None
        q = local(p)
        if kind in ("fp8", "fp8_block"):  # fp8_model_init's kept init, else the fp8 value
            init = q.get_high_precision_init_val()
            if init is not None and tuple(init.shape) == tuple(q.shape):
                return like_param(p, init.to(q.device, torch.float32, copy=True).contiguous())
            return like_param(p, q.dequantize(torch.float32).contiguous())
        return like_param(p, q.detach().to(torch.float32, copy=True))

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.use_decoupled_grad:
            return super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                g = getattr(p, "decoupled_grad", None)
                if set_to_none:
                    p.decoupled_grad = None
                elif g is not None:
                    g.zero_()

    # ------------------------------------------------------------------ step
    def _plan(self) -> list[list[tuple]]:
        """Per group, [(param, grad, kind)] for the params that have grads; raises on any
        problem before anything is touched."""
        plans = []
        for gi, group in enumerate(self.param_groups):
            items, kinds = [], []
            for pi, p in enumerate(group["params"]):
                where = f"param group {gi}, param {pi}"
                kind = check_param(p, where)
                kinds.append(kind)
                g = get_grad(p, self.use_decoupled_grad, where)
                if g is not None:
                    items.append((p, g, kind))
            check_group_kinds(kinds, gi, self.master_weights)
            plans.append(items)
        return plans

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = self._plan()
        for gi, (group, items) in enumerate(zip(self.param_groups, plans)):
            for p, _, kind in items:
                state = self.state[p]
                if not state:
                    self._init_state(p, kind, state)
            self._run_group(gi, group, items)
            for p, _, kind in items:
                if kind in ("fp8", "fp8_block"):
                    self._refresh_fp8(p)
        return loss

    def _refresh_fp8(self, p: Float8Tensor) -> None:
        """After p's master changed: a current-scaled FP8 param (fp8_model_init under
        Float8CurrentScaling) takes its scale from the new master's amax and is rewritten with
        it; then the fp8 transpose follows the data. A block-scaled one is requantized from it."""
        if isinstance(local(p), Float8BlockTensor):
            local(p).requantize_(local(self.get_master_param(p)))
            return
        current = getattr(p, "_current_scaling", None)
        if current is not None:  # never a DTensor shard (Float8Tensor's FSDP gather refuses those)
            master = self.get_master_param(p).reshape(-1)
            amax = master.abs().amax().reshape(1) if master.numel() else torch.zeros_like(p._scale)
            p._scale.copy_(ref_cast.current_scale(amax, p._fp8_dtype, *current))
            ref_adam.store_weight(storage(p).view(-1), None, None, (p._scale, p._scale_inv, None),
                                  master)
        local(p).data_written()

    def _buckets(self, items: list[tuple], extra_key=None) -> dict:
        """{(device, storage dtype, grad dtype, kind class, extra): [(p, g, kind)]}."""
        buckets: dict = {}
        for p, g, kind in items:
            s = self._kernel_param(p)
            key = (s.device, s.dtype, g.dtype, kind == "fp8",
                   self._has_master(kind) and kind != "fp8_block",
                   self._uses_remainder(kind), None if extra_key is None else extra_key(p))
            buckets.setdefault(key, []).append((p, g, kind))
        return buckets

    def _kernel_param(self, p: torch.Tensor) -> torch.Tensor:
        """What the step kernel writes as p: its storage, or for a block-scaled FP8 param its
        fp32 master (stepped as an fp32 param; the blocks are requantized after the step)."""
        if isinstance(local(p), Float8BlockTensor):
            return local(self.state[p]["master_param"])
        return storage(p)

    def _table_cache(self, gi: int, key) -> dict:
        return self._tables.setdefault((gi, key), {})

    # ------------------------------------------------------------------ master weights
    def get_master_param(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 master of `p` (rebuilt from param + remainder in remainder mode), or None
        where there is none (fp32 params, master_weights=False, or no step taken yet)."""
        state = self.state.get(p)
        if not state:
            return None
        if "master_remainder" in state:
            return like_param(p, ref_adam.join_remainder(storage(p).view(torch.int16),
                                                         local(state["master_remainder"])))
        return state.get("master_param")

    @torch.no_grad()
    def set_master_param(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Use `value` (any float dtype, p's shape) as p's fp32 master from now on, and write the
        model param from it at once (bf16/fp16 by rounding, FP8 by the cast with p's scale,
        recording amax), so that param and master agree as after a step. Moments are created
        (zeros) if p had no state yet."""
        kind = self._find_kind(p)
        if not (self._has_master(kind) or self._uses_remainder(kind)):
            raise ValueError(f"set_master_param: a {kind} param has no master weight here "
                             f"(master_weights={self.master_weights}); fp32 params are their "
                             "own master, others need FusedAdam(..., master_weights=True)")
        if tuple(value.shape) != tuple(p.shape) or not value.is_floating_point():
            raise ValueError(f"set_master_param: value must be a float tensor of shape "
                             f"{tuple(p.shape)}, got {value.dtype}{tuple(value.shape)}")
        if is_dtensor(p):
            value = local(to_param_layout(p, value))
        state = self.state[p]
        if not state:
            self._init_state(p, kind, state)
        w = value.detach().to(device=storage(p).device, dtype=torch.float32).reshape(-1).clone()
        rem = local(state.get("master_remainder"))
        self._store_master(p, state, w)
        if kind == "fp8_block":
            return self._refresh_fp8(p)
        ref_adam.store_weight(storage(p).view(-1), None, None if rem is None else rem.view(-1),
                              fp8_meta(p) if kind == "fp8" else None, w)
        if kind == "fp8":
            self._refresh_fp8(p)

    def _store_master(self, p: torch.Tensor, state: dict, w: torch.Tensor) -> None:
        """Write the fp32 weight `w` (flat) into p's stored master, where it has one."""
        master = local(state.get("master_param"))
        if master is not None:
            master.view(-1).copy_(w)

    def _find_kind(self, p: torch.Tensor) -> str:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return param_kind(p, "set_master_param")
        raise ValueError("set_master_param: p is not one of this optimizer's params")

    # ------------------------------------------------------------------ state_dict
    def _group_to_plain(self, group: dict) -> dict:
        out = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item() if k != "step" else int(v.item())
            out[k] = v
        return out

    def state_dict(self) -> dict:
        index, groups = {}, []
        for group in self.param_groups:
            plain = self._group_to_plain(group)
            plain["params"] = []
            for p in group["params"]:
                if id(p) not in index:
                    index[id(p)] = len(index)
                plain["params"].append(index[id(p)])
            groups.append(plain)
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st or index[id(p)] in state:
                    continue
                out = {name: self._export_state(p, st, name) for name in self._state_names
                       if name in st}
                master = self.get_master_param(p)
                if master is not None:
                    out["master_param"] = master
                out.update(self._export_extra(st))
                state[index[id(p)]] = out
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError("load_state_dict: expected a dict with 'state' (dict) and "
                             "'param_groups' (list), as made by this optimizer's state_dict()")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the state_dict has {len(saved_groups)} param "
                             f"groups, this optimizer {len(self.param_groups)}")
        params = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"load_state_dict: param group {gi} has "
                                 f"{len(group['params'])} params, the state_dict's "
                                 f"{len(saved.get('params', ()))}")
            params += list(zip(saved["params"], group["params"]))
        by_index = dict(params)
        # 1. Check and convert everything; nothing of this optimizer changes here.
        new_state = {}
        for idx, saved in saved_state.items():
            if idx not in by_index:
                raise ValueError(f"load_state_dict: state for param index {idx}, which no "
                                 "param group lists")
            p = by_index[idx]
            new_state[p] = self._convert_state(p, saved, f"param index {idx}")
        # 2. Commit (copies into live tensors where they exist; cannot fail on shapes).
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            self._load_group(group, saved)
        for group in self.param_groups:
            for p in group["params"]:
                if p not in new_state:
                    self.state.pop(p, None)
        for p, st in new_state.items():
            self._commit_state(p, st)

    def _convert_state(self, p: torch.Tensor, saved: dict, where: str) -> dict:
        """Saved per-param state -> {name: fp32 tensor on p's device, '_kind': kind}."""
        kind = param_kind(p, where)
        if not isinstance(saved, dict):
            raise ValueError(f"load_state_dict: {where}: the state must be a dict of tensors")
        out = {"_kind": kind}
        for name in self._state_names + ("master_param",):
            t = saved.get(name)
            if t is None:
                if name in self._required_state:
                    raise ValueError(f"load_state_dict: {where} has no '{name}'")
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"load_state_dict: {where}: '{name}' must be a float tensor")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_state_dict: {where}: '{name}' has shape "
                                 f"{tuple(t.shape)} but the param has shape {tuple(p.shape)}; "
                                 "the state_dict belongs to another model or param order")
            out[name] = to_param_layout(p, t.to(device=storage(p).device, dtype=torch.float32))
        return out

    _required_state: tuple[str, ...] = ()

    def _export_extra(self, state: dict) -> dict:
        """Extra tensors a subclass saves beside the unscaled states (none here)."""
        return {}

    def _export_state(self, p: torch.Tensor, state: dict, name: str) -> torch.Tensor:
        """A state tensor as unscaled fp32 (FusedAdam overrides it for scaled states)."""
        return state[name].float()

    def _load_group(self, group: dict, saved: dict) -> None:
        for k, v in saved.items():
            if k == "params":
                continue
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)  # keep the tensor that CUDA graphs read
            else:
                group[k] = v

    def _commit_state(self, p: torch.Tensor, conv: dict) -> None:
        """Replace p's state by the converted one, in the configured dtypes, copying into live
        tensors of the same shape and dtype. A missing master is made from the param."""
        template: dict = {}
        self._init_state(p, conv["_kind"], template)
        state = self.state[p]
        for name in list(state):
            if name not in template and name not in conv:
                del state[name]
        for name in set(template) | set(conv):
            if name in ("_kind", "master_remainder"):
                continue
            if name == "master_param" and template.get("master_param") is None:
                state[name] = None  # fp32 param or remainder mode: no stored master
                continue
            value = conv.get(name, template.get(name))
            dtype = template[name].dtype if name in template else torch.float32
            shape = template[name].shape if name in template else p.shape
            live = state.get(name)
            if isinstance(live, torch.Tensor) and live.shape == shape and live.dtype == dtype:
                live.copy_(value)
            else:
                state[name] = value.to(dtype).reshape(shape).clone()
        if "master_remainder" in template:
            rem = state.get("master_remainder")
            if not isinstance(rem, torch.Tensor) or rem.shape != p.shape:
                rem = state["master_remainder"] = template["master_remainder"]
            master = conv.get("master_param")
            if master is None:
                rem.zero_()  # master = the param's value
            else:  # the param's bits and the remainder together hold the saved master
                ref_adam.store_weight(storage(p).view(-1), None, local(rem).view(-1), None,
                                      local(master).reshape(-1))

    # subclass hooks
    def _init_state(self, p: torch.Tensor, kind: str, state: dict) -> None:
        raise NotImplementedError

    def _run_group(self, gi: int, group: dict, items: list[tuple]) -> None:
        raise NotImplementedError


__all__ = ["MultiTensorOptimizer", "param_kind", "storage", "fp8_meta", "get_grad",
           "host_scalars_to", "impl_for", "local", "local_state", "state_tensor"]
