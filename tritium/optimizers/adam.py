"""FusedAdam: Adam/AdamW over fp32, bf16, fp16 and FP8 params with master weights as optimizer
state, one multi-tensor launch per dtype bucket (TE's `te.optimizers.FusedAdam` arguments).

The math and its op order are written once, in `tritium/ref/adam.py`; the Triton kernel
(`tritium/kernels/adam.py`) is its bit-for-bit twin. This file decides what goes in: state
creation, bias corrections, hyperparameters, buckets (see `_common.py` for the shared checks,
master weights and state_dict).

Per param state: `exp_avg`, `exp_avg_sq` (exp_avg_dtype / exp_avg_sq_dtype: float32 or
bfloat16), `master_param` (fp32 copy of a bf16/fp16 param with master_weights=True, always for
FP8 params; None for fp32 params, which are their own master). With
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

Arguments follow TE (`lr, betas, eps, weight_decay, amsgrad` positional, the rest keyword-only).
Not supported (clear errors): amsgrad, fp16 moments, a master dtype other than fp32. Unlike
TE, capturable=True works with bf16 moments and remainders too (state never moves).
"""
from __future__ import annotations

import torch

from ..ref import adam as ref_adam
from ._common import (MultiTensorOptimizer, fp8_meta, host_scalars_to, impl_for,
                      local_state, state_tensor, storage)

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)


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
        if master_weights and master_weight_dtype != torch.float32:
            raise NotImplementedError(f"FusedAdam(master_weight_dtype={master_weight_dtype}): only "
                                      "torch.float32 masters are supported")
        for name, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dt not in _MOMENT_DTYPES:
                raise NotImplementedError(f"FusedAdam({name}={dt}): moments are stored in "
                                          "torch.float32 or torch.bfloat16 (fp16 moments would "
                                          "need scaling, not implemented)")
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
        self._consts: dict = {}
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, master_weights=master_weights,
                         use_decoupled_grad=use_decoupled_grad,
                         store_param_remainders=store_param_remainders)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self.capturable and group["params"]:
            dev = storage(group["params"][0]).device
            lr = group["lr"]
            group["lr"] = (lr.to(dev, torch.float32) if isinstance(lr, torch.Tensor)
                           else torch.tensor(float(lr), dtype=torch.float32, device=dev))
            group["step"] = torch.zeros((), dtype=torch.float32, device=dev)

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, kind: str, state: dict) -> None:
        state["exp_avg"] = state_tensor(p, self.exp_avg_dtype)
        state["exp_avg_sq"] = state_tensor(p, self.exp_avg_sq_dtype)
        state["master_param"] = self._initial_master(p, kind)
        if self._uses_remainder(kind):
            # The param's bf16 value is exact in fp32: the master starts with a zero remainder.
            state["master_remainder"] = state_tensor(p, torch.int16)

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
            return
        if self.capturable:
            group["step"] += 1
        else:
            group["step"] = int(group.get("step", 0)) + 1
        decay = float(group["weight_decay"]) != 0.0
        hps = {}
        for key, bucket in self._buckets(items).items():
            device, _, _, is_fp8, has_master, remainder, _ = key
            if device not in hps:
                hps[device] = self._hp(gi, group, device)
            states = [local_state(p, self.state[p]) for p, _, _ in bucket]
            impl = impl_for(storage(bucket[0][0]), "adam", ref_adam)
            impl.adam_step(
                [storage(p) for p, _, _ in bucket], [g for _, g, _ in bucket],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["master_param"] for s in states] if has_master else None,
                [fp8_meta(p) for p, _, _ in bucket] if is_fp8 else None,
                [s["master_remainder"] for s in states] if remainder else None,
                hps[device], adam_w_mode=self.adam_w_mode, weight_decay=decay,
                cache=self._table_cache(gi, key))


__all__ = ["FusedAdam"]
