"""FusedSGD: torch.optim.SGD semantics (momentum, dampening, nesterov, weight decay) over fp32,
bf16, fp16 and FP8 params with optional fp32 master weights, one multi-tensor launch per bucket.

The math and its op order are written once, in `tritium/ref/sgd.py`; the Triton kernel
(`tritium/kernels/sgd.py`) is its bit-for-bit twin. State per param: `momentum_buffer` (fp32,
created at the param's first step with momentum != 0 and set to that step's (decayed) grad, as
torch.optim.SGD does), `master_param` (as FusedAdam: fp32 copy for bf16/fp16 params with
master_weights=True, always for FP8 params, None for fp32 params). Shared checks, master
weights and state_dict: `_common.py`. `wd_after_momentum=True` (apex/TE) adds the weight decay
after the momentum update instead of to the grad.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ..ref import sgd as ref_sgd
from ._common import (MultiTensorOptimizer, fp8_meta, host_scalars_to, impl_for,
                      local_state, state_tensor, storage)


class FusedSGD(MultiTensorOptimizer):
    _state_names = ("momentum_buffer",)
    _required_state = ()

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 wd_after_momentum: bool = False, master_weights: bool = False,
                 use_decoupled_grad: bool = False):
        if lr is required:
            raise TypeError("FusedSGD needs lr, e.g. FusedSGD(params, lr=0.1)")
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"FusedSGD: lr, momentum and weight_decay must be >= 0, got lr={lr}, "
                             f"momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("FusedSGD(nesterov=True) needs momentum > 0 and dampening == 0")
        self.wd_after_momentum = bool(wd_after_momentum)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=bool(nesterov))
        super().__init__(params, defaults, master_weights=master_weights,
                         use_decoupled_grad=use_decoupled_grad)

    def _init_state(self, p: torch.Tensor, kind: str, state: dict) -> None:
        state["master_param"] = self._initial_master(p, kind)

    def _run_group(self, gi: int, group: dict, items: list[tuple]) -> None:
        if not items:
            return
        has_momentum = float(group["momentum"]) != 0.0
        if has_momentum:  # a new buffer's first step is buf = d: bucket new and old apart
            first = {id(p): "momentum_buffer" not in self.state[p] for p, _, _ in items}
            for p, _, _ in items:
                if first[id(p)]:
                    self.state[p]["momentum_buffer"] = state_tensor(p, torch.float32,
                                                                    zero=False)
        hp_values = [float(group["lr"]), float(group["momentum"]),
                     1.0 - float(group["dampening"]), float(group["weight_decay"])]
        hps = {}
        extra = (lambda p: first[id(p)]) if has_momentum else None
        for key, bucket in self._buckets(items, extra).items():
            device, _, _, is_fp8, has_master, _, is_first = key
            if device not in hps:
                hps[device] = host_scalars_to(hp_values, device)
            states = [local_state(p, self.state[p]) for p, _, _ in bucket]
            impl = impl_for(storage(bucket[0][0]), "sgd", ref_sgd)
            impl.sgd_step(
                [self._kernel_param(p) for p, _, _ in bucket], [g for _, g, _ in bucket],
                [s["momentum_buffer"] for s in states] if has_momentum else None,
                [s["master_param"] for s in states] if has_master else None,
                [fp8_meta(p) for p, _, _ in bucket] if is_fp8 else None,
                hps[device], weight_decay=hp_values[3] != 0.0,
                wd_after_momentum=self.wd_after_momentum, nesterov=bool(group["nesterov"]),
                first=bool(is_first), cache=self._table_cache(gi, key))


__all__ = ["FusedSGD"]
