"""Pure-PyTorch twin of `tritium.kernels.scaling`: the delayed-scaling update, in place.

For each slot (column) j of amax_history [L, n] and scale [n]:
  * row 0 == 0 (nothing cast since the last update: an unused module, a cached weight):
    leave the column and the scale alone;
  * else amax = max over all rows ("max") or row 0 ("most_recent"); roll the column up by one
    (row 0 goes to the end), zero row 0; scale = (fp8_max / amax) / 2**margin if amax is finite
    and > 0, else keep the old scale; an infinite scale becomes fp32 max.
"""
from __future__ import annotations

import torch

from ..fp8.formats import FP32_MAX


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                           margin: int, algo: str) -> None:
    if algo == "max":
        amax = amax_history.amax(dim=0)  # propagates NaN
    elif algo == "most_recent":
        amax = amax_history[0].clone()
    else:
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    new_scale = compute_scale(amax, scale, fp8_max, margin)
    roll_history(amax_history, scale, new_scale)


def delayed_scaling_update_many(hists: list, scales: list, fp8_max: float, margin: int,
                                algo: str) -> None:
    """`delayed_scaling_update` of several states (one recipe, one fp8 dtype) in turn."""
    for amax_history, scale in zip(hists, scales):
        delayed_scaling_update(amax_history, scale, fp8_max, margin, algo)


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    s = (torch.full_like(amax, fp8_max) / amax) / (2.0 ** margin)
    s = torch.where((amax > 0) & torch.isfinite(amax), s, scale)
    return torch.where(torch.isinf(s), torch.full_like(s, FP32_MAX), s)


def roll_history(amax_history: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> None:
    """Apply new_scale and roll the columns whose row 0 is non-zero; leave the others."""
    active = amax_history[0] != 0
    rolled = torch.roll(amax_history, -1, 0)
    rolled[0] = 0
    amax_history.copy_(torch.where(active, rolled, amax_history))
    scale.copy_(torch.where(active, new_scale, scale))
