"""FusedAdam: Adam/AdamW over fp32, bf16, fp16 and FP8 params with master weights as optimizer
state, one multi-tensor launch per dtype bucket (TE's `te.optimizers.FusedAdam` arguments).

The math and its op order are written once, in `tritium/ref/adam.py`; the Triton kernel
(`tritium/kernels/adam.py`) is its bit-for-bit twin. This file decides what goes in: state
creation, bias corrections, hyperparameters, buckets (see `_common.py` for the shared checks,
master weights and state_dict).

Per param state: `exp_avg`, `exp_avg_sq` (exp_avg_dtype / exp_avg_sq_dtype: float32,
bfloat16, float16 or torch.uint8 = FP8 E4M3, as TE), `master_param` (copy of a bf16/fp16 param
with master_weights=True, always for FP8 params, in master_weight_dtype float32 or float16;
None for fp32 params, which are their own master).

fp16 and FP8 states are SCALED per tensor (TE's scheme, see `tritium/ref/adam.py`): each step
recomputes the factor from the new values' max |value| so the format's range is used fully
(fp16: max / 2, E4M3: 448); `state["state_scales"]` (fp32 [3, 3]) holds the factors. The raw
state tensors are then scaled values (FP8 ones are stored as torch.float8_e4m3fn): read them
with `get_unscaled_state(p, name)` and write them with `set_scaled_state(p, name, fp32)` (TE's
names). state_dict() exports unscaled fp32, load_state_dict() rescales. bf16 states are plain
casts (no factor), as in TE. store_param_remainders applies to fp32 masters only (TE). With
store_param_remainders=True, bf16 params keep `master_remainder` (int16, the master's low 16
bits; see `tritium.ref.adam.split_remainder`) instead of `master_param`.
`get_master_param(p)` / `set_master_param(p, value)` read and replace a master.

The step counter is per param group (`group["step"]`, as TE), so a param that gets its first
grad late uses that group's bias correction. Bias corrections bc = 1 - beta**step:
  * capturable=False: on the host in float64, rounded once to fp32 in `hp`;
  * capturable=True: `group["step"]` and `group["lr"]` are tensors on the params' device, and
    bc is computed there (float64, rounded to fp32), so step() never syncs the host and can be
    captured in a CUDA graph. Update the lr in place (`group["lr"].fill_(x)`, outside the
    graph) to schedule it; assigning a float makes a new tensor (the captured graph would keep
    reading the old one).

The step counter: every param group has `group["step"]` from the start (0), empty groups
included (TE adds the key at a group's first step and never to an empty group; torch's
LR schedulers and checkpoint code read it, so here it is always there and a state_dict always
carries it). A step() advances it for each group where at least one param has a grad (TE also
advances groups without grads; tritium keeps their count, so a group's first real update gets
step 1's bias correction, as torch.optim.Adam gives a param its own count).

Arguments follow TE (`lr, betas, eps, weight_decay, amsgrad` positional, the rest keyword-only).
Not supported (clear errors): amsgrad. Unlike TE, capturable=True works with bf16/fp16/FP8
states and remainders too (state never moves; the scaled step needs no host sync).
"""
from __future__ import annotations

import torch

from ..fp8.block_tensor import Float8BlockTensor
from ..ref import adam as ref_adam
from ._common import (MultiTensorOptimizer, fp8_meta, host_scalars_to, impl_for, is_dtensor,
                      local, local_state, state_tensor, storage)

# The moment dtypes TE accepts -> how they are stored (torch.uint8 means FP8 E4M3 in TE).
_MOMENT_STORAGE = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16,
                   torch.float16: torch.float16, torch.uint8: torch.float8_e4m3fn}
_MASTER_DTYPES = (torch.float32, torch.float16)
_ROWS = {"exp_avg": ref_adam.ROW_EXP_AVG, "exp_avg_sq": ref_adam.ROW_EXP_AVG_SQ,
         "master_param": ref_adam.ROW_MASTER}


class FusedAdam(MultiTensorOptimizer):
    _state_names = ("exp_avg", "exp_avg_sq")
    _required_state = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *,
                 bias_correction: bool = True, adam_w_mode: bool = True, capturable: bool = False,
                 master_weights: bool = False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False):
        if amsgrad:
            raise NotImplementedError("FusedAdam(amsgrad=True) is not supported; use amsgrad=False "
                                      "(or torch.optim.AdamW(amsgrad=True))")
        if master_weights and master_weight_dtype not in _MASTER_DTYPES:
            raise ValueError(f"FusedAdam(master_weight_dtype={master_weight_dtype}): masters are "
                             "torch.float32 or torch.float16 (scaled per tensor)")
        for name, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dt not in _MOMENT_STORAGE:
                raise ValueError(f"FusedAdam({name}={dt}): moments are torch.float32, "
                                 "torch.bfloat16, torch.float16 or torch.uint8 (FP8 E4M3)")
        if not master_weights:
            master_weight_dtype = torch.float32
        # TE: remainders only replace an fp32 master (ignored with fp16 masters).
        store_param_remainders = store_param_remainders and master_weight_dtype == torch.float32
        if store_param_remainders and not master_weights:
            raise ValueError("FusedAdam(store_param_remainders=True) needs master_weights=True "
                             "(the remainder is the low half of the fp32 master)")
        if not 0.0 <= float(eps):
            raise ValueError(f"FusedAdam: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: betas must be two values in [0, 1), got {betas}")
        if not isinstance(lr, torch.Tensor) and lr < 0.0:
            raise ValueError(f"FusedAdam: lr must be >= 0, got {lr}")
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = bool(capturable)
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.master_weight_dtype = master_weight_dtype
        self._storage = {"exp_avg": _MOMENT_STORAGE[exp_avg_dtype],
                         "exp_avg_sq": _MOMENT_STORAGE[exp_avg_sq_dtype],
                         "master_param": master_weight_dtype}
        self._scaled = any(ref_adam.is_scaled(dt) for dt in self._storage.values())
        self._consts: dict = {}
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, master_weights=master_weights,
                         use_decoupled_grad=use_decoupled_grad,
                         store_param_remainders=store_param_remainders)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self.master_weight_dtype != torch.float32 and any(
                isinstance(local(p), Float8BlockTensor) for p in group["params"]):
            self.param_groups.pop()
            raise ValueError("FusedAdam: block-scaled FP8 params (Float8BlockTensor) need float32 "
                             "masters; use master_weight_dtype=torch.float32")
        if self._scaled and any(is_dtensor(p) for p in group["params"]):
            # Each shard would get its own factors in a per-rank [3, 3] table, which DCP would
            # save as one replicated tensor: a resume could not be exact.
            raise ValueError("FusedAdam: fp16 / FP8 (torch.uint8) states or fp16 masters are not "
                             "supported with DTensor (FSDP2 / TP) params yet; use float32 or "
                             "bfloat16 moments and float32 masters")
        group.setdefault("step", 0)
        if self.capturable and group["params"]:
            dev = storage(group["params"][0]).device
            lr = group["lr"]
            group["lr"] = (lr.to(dev, torch.float32) if isinstance(lr, torch.Tensor)
                           else torch.tensor(float(lr), dtype=torch.float32, device=dev))
            group["step"] = torch.zeros((), dtype=torch.float32, device=dev)

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, kind: str, state: dict) -> None:
        state["exp_avg"] = state_tensor(p, self._storage["exp_avg"])
        state["exp_avg_sq"] = state_tensor(p, self._storage["exp_avg_sq"])
        master = self._initial_master(p, kind)
        if self._scaled:  # all factors 0: zero moments read as 0
            state["state_scales"] = torch.zeros(3, 3, dtype=torch.float32,
                                                device=storage(p).device)
        if master is not None and self.master_weight_dtype != torch.float32:
            stored = state_tensor(p, self.master_weight_dtype, zero=False)
            ref_adam.quantize_state(local(stored), state["state_scales"], ref_adam.ROW_MASTER,
                                    local(master))
            master = stored
        state["master_param"] = master
        if self._uses_remainder(kind):
            # The param's bf16 value is exact in fp32: the master starts with a zero remainder.
            state["master_remainder"] = state_tensor(p, torch.int16)

    # ------------------------------------------------------------------ scaled states (TE's API)
    def _check_state_name(self, p: torch.Tensor, state_name: str) -> dict:
        if state_name not in _ROWS:
            raise ValueError(f"state_name must be 'exp_avg', 'exp_avg_sq' or 'master_param', "
                             f"got {state_name!r}")
        state = self.state.get(p)
        if not state:
            raise ValueError(f"no optimizer state for this param yet (it is created at its first "
                             f"step); cannot read {state_name!r}")
        return state

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The fp32 value of `state_name` ('exp_avg', 'exp_avg_sq', 'master_param') of `param`:
        the state itself where it is fp32 (TE returns it too), else a fresh fp32 tensor (the
        stored value times its factor; the master rebuilt from param + remainder)."""
        state = self._check_state_name(param, state_name)
        if state_name == "master_param":
            master = self.get_master_param(param)
            if master is None:
                raise ValueError("get_unscaled_state: this param has no master_param (an fp32 "
                                 "param is its own master, or master_weights=False)")
            return master
        t = state[state_name]
        if ref_adam.is_scaled(t.dtype):
            return ref_adam.scaled_load(t, state["state_scales"][_ROWS[state_name], 0])
        return t if t.dtype == torch.float32 else t.float()

    @torch.no_grad()
    def set_scaled_state(self, param: torch.Tensor, state_name: str,
                         unscaled_state: torch.Tensor) -> None:
        """Store the fp32 `unscaled_state` into `state_name` of `param` in its configured dtype
        (fp16 / FP8 with a new factor from its amax; masters also rewrite nothing else: use
        set_master_param to move the model param too)."""
        state = self._check_state_name(param, state_name)
        t = state.get(state_name)
        if state_name == "master_param" and t is None:
            raise ValueError("set_scaled_state: this param keeps no stored master_param (an fp32 "
                             "param, master_weights=False or remainders); use set_master_param")
        value = unscaled_state.detach().to(t.device, torch.float32)
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"set_scaled_state: value has shape {tuple(value.shape)}, the state "
                             f"{tuple(t.shape)}")
        if ref_adam.is_scaled(t.dtype):
            ref_adam.quantize_state(t, state["state_scales"], _ROWS[state_name], value)
        else:
            t.copy_(value)

    def get_master_param(self, p: torch.Tensor):
        state = self.state.get(p)
        master = state.get("master_param") if state else None
        if master is not None and ref_adam.is_scaled(master.dtype):
            return ref_adam.scaled_load(master, state["state_scales"][ref_adam.ROW_MASTER, 0])
        return super().get_master_param(p)

    def _store_master(self, p: torch.Tensor, state: dict, w: torch.Tensor) -> None:
        master = state.get("master_param")
        if master is not None and ref_adam.is_scaled(master.dtype):
            ref_adam.quantize_state(master, state["state_scales"], ref_adam.ROW_MASTER, w)
        else:
            super()._store_master(p, state, w)

    def _export_state(self, p: torch.Tensor, state: dict, name: str) -> torch.Tensor:
        return self.get_unscaled_state(p, name)  # fp32 states as they are (as torch.optim)

    def _export_extra(self, state: dict) -> dict:
        # The factors, so that a resume stores exactly the same scaled values (a state_dict
        # without them, e.g. TE's, gets factors from each state's amax).
        return {"state_scales": state["state_scales"].clone()} if "state_scales" in state else {}

    def _convert_state(self, p: torch.Tensor, saved: dict, where: str) -> dict:
        out = super()._convert_state(p, saved, where)
        table = saved.get("state_scales") if isinstance(saved, dict) else None
        if table is not None and self._scaled:
            if not isinstance(table, torch.Tensor) or tuple(table.shape) != (3, 3) \
                    or table.dtype != torch.float32:
                raise ValueError(f"load_state_dict: {where}: 'state_scales' must be a float32 "
                                 "[3, 3] tensor (as state_dict() writes it)")
            out["state_scales"] = table.to(storage(p).device)
        return out

    def _commit_state(self, p: torch.Tensor, conv: dict) -> None:
        super()._commit_state(p, conv)  # plain casts; scaled states are rewritten below
        state = self.state[p]
        saved_table = conv.get("state_scales")
        for name, row in _ROWS.items():
            t, value = state.get(name), conv.get(name)
            if t is None or value is None or not ref_adam.is_scaled(t.dtype):
                continue
            table = state["state_scales"]
            rng = torch.full((), ref_adam.SCALED_RANGE[t.dtype], device=table.device)
            if saved_table is not None and torch.equal(
                    table[row, ref_adam.COL_AMAX] / rng, table[row, ref_adam.COL_D]):
                # factors saved for this format: the stored values come back exactly
                ref_adam.scaled_store(t.view(-1), value.reshape(-1), table[row, ref_adam.COL_Q])
            else:  # no factors, or ones for another format: new ones from the value's amax
                self.set_scaled_state(p, name, value)

    # ------------------------------------------------------------------ hyperparameters
    def _hp(self, gi: int, group: dict, device: torch.device) -> torch.Tensor:
        """fp32 [NUM_HP] on `device` in the layout of tritium.ref.adam (after the step count
        was advanced)."""
        b1, b2 = (float(b) for b in group["betas"])
        consts = [b1, 1.0 - b1, b2, 1.0 - b2, float(group["eps"]), float(group["weight_decay"])]
        if not self.capturable:
            step = group["step"]
            if group["bias_correction"]:
                bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
            else:
                bc1 = bc2 = 1.0
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                raise TypeError("FusedAdam: a tensor lr needs capturable=True (a host lr is "
                                "read as a float); pass a float lr")
            return host_scalars_to([float(lr), bc1, bc2] + consts, device)
        key = (gi, device)
        cached = self._consts.get(key)
        if cached is None or cached[0] != consts:
            cached = self._consts[key] = (consts, host_scalars_to(consts, device),
                                          torch.tensor([b1, b2], dtype=torch.float64).to(device))
        lr, step = group["lr"], group["step"]
        if not isinstance(lr, torch.Tensor):  # a float assigned after construction
            lr = group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        if group["bias_correction"]:
            bc = (1.0 - torch.pow(cached[2], step.to(device, torch.float64))).to(torch.float32)
        else:
            bc = torch.ones(2, dtype=torch.float32, device=device)
        return torch.cat([lr.reshape(1).to(device, torch.float32), bc, cached[1]])

    # ------------------------------------------------------------------ step
    def _run_group(self, gi: int, group: dict, items: list[tuple]) -> None:
        if not items:
            return  # no grads in this group (or no params): its step does not advance
        if isinstance(group["step"], torch.Tensor):
            group["step"] += 1
        else:
            group["step"] = int(group["step"]) + 1
        decay = float(group["weight_decay"]) != 0.0
        hps = {}
        for key, bucket in self._buckets(items).items():
            device, _, _, is_fp8, has_master, remainder, _ = key
            if device not in hps:
                hps[device] = self._hp(gi, group, device)
            states = [local_state(p, self.state[p]) for p, _, _ in bucket]
            impl = impl_for(storage(bucket[0][0]), "adam", ref_adam)
            impl.adam_step(
                [self._kernel_param(p) for p, _, _ in bucket], [g for _, g, _ in bucket],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["master_param"] for s in states] if has_master else None,
                [fp8_meta(p) for p, _, _ in bucket] if is_fp8 else None,
                [s["master_remainder"] for s in states] if remainder else None,
                hps[device], adam_w_mode=self.adam_w_mode, weight_decay=decay,
                cache=self._table_cache(gi, key),
                state_scales=[s["state_scales"] for s in states] if self._scaled else None)


__all__ = ["FusedAdam"]
