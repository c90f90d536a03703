"""Custom op behind `tritium.fp8.scaling`'s delayed-scaling update, and the namespace with
`tritium.ref.scaling.delayed_scaling_update`'s name and signature.

tritium::delayed_scaling_update(amax_history, scale, fp8_max, margin, algo) writes
amax_history (rolled) and scale in place, nothing else: the Triton kernel where
`_device.use_triton` says so and the history fits it (MAX_HISTORY rows), the twin otherwise,
as ScalingState's eager update picks. Recipes with callables (amax_compute_algo /
scaling_factor_compute_algo) are plain PyTorch and user code: ScalingState traces those itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _device
from ..ref import scaling as ref_scaling
from ._common import tritium_op


def _update(amax_history: Tensor, scale: Tensor, fp8_max: float, margin: int, algo: str):
    if _device.use_triton(scale):
        from ..kernels import scaling as kernel_scaling
        if amax_history.shape[0] <= kernel_scaling.MAX_HISTORY:
            return kernel_scaling.delayed_scaling_update(amax_history, scale, fp8_max, margin,
                                                         algo)
    return ref_scaling.delayed_scaling_update(amax_history, scale, fp8_max, margin, algo)


@tritium_op("tritium::delayed_scaling_update",
                         mutates_args=("amax_history", "scale"))
def _op(amax_history: Tensor, scale: Tensor, fp8_max: float, margin: int, algo: str) -> None:
    _update(amax_history, scale, fp8_max, margin, algo)


@_op.register_fake
def _(amax_history, scale, fp8_max, margin, algo):
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    return None


def delayed_scaling_update(amax_history: Tensor, scale: Tensor, fp8_max: float, margin: int,
                           algo: str) -> None:
    torch.ops.tritium.delayed_scaling_update(amax_history, scale, float(fp8_max), int(margin),
                                             algo)


__all__ = ["delayed_scaling_update"]


@tritium_op("tritium::read_scale")
def read_scale(scale: Tensor) -> Tensor:
    """A copy of `scale` taken now. Compiled graphs read delayed-scaling scales through it: the
    partitioner may recompute a cast in backward from its inputs, and a scale is changed in
    place (when fp8_autocast exits) between the forward and the backward; an op's output it
    cannot recompute, so it saves it."""
    return scale.clone()


@read_scale.register_fake
def _(scale):
    return torch.empty_like(scale)
