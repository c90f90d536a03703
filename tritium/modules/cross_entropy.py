"""`LinearCrossEntropyLoss`: the module form of `tritium.functional.linear_cross_entropy`.

    loss_fn = te.LinearCrossEntropyLoss(ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, lse_square_scale=0.0,
                                        tp_group=None, fp8=False, chunk_size=None,
                                        accum_dtype=None)
    loss = loss_fn(hidden, lm_head.weight, target, bias=None)

It owns no parameters (the lm_head weight stays the model's, tied or not) and no FP8 state
(FP8 uses per-chunk current scaling, see the functional docstring); it holds the options, as
torch.nn.CrossEntropyLoss does. The argument order of forward is the functional one (hidden
first); Liger's LigerFusedLinearCrossEntropyLoss takes the weight first.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..functional.linear_cross_entropy import REDUCTIONS, linear_cross_entropy


class LinearCrossEntropyLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, *, tp_group=None,
                 fp8: bool = False, chunk_size: Optional[int] = None,
                 accum_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"LinearCrossEntropyLoss: reduction must be one of {REDUCTIONS}, "
                             f"got {reduction!r}")
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError("LinearCrossEntropyLoss: label_smoothing must be in [0, 1), got "
                             f"{label_smoothing}")
        if float(lse_square_scale) < 0.0:
            raise ValueError("LinearCrossEntropyLoss: lse_square_scale must be >= 0, got "
                             f"{lse_square_scale}")
        self.ignore_index, self.reduction = int(ignore_index), reduction
        self.label_smoothing, self.lse_square_scale = float(label_smoothing), float(lse_square_scale)
        self.tp_group, self.fp8 = tp_group, bool(fp8)
        self.chunk_size, self.accum_dtype = chunk_size, accum_dtype

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, target, self.ignore_index, self.reduction,
                                    self.label_smoothing, self.lse_square_scale, bias,
                                    tp_group=self.tp_group, fp8=self.fp8,
                                    chunk_size=self.chunk_size, accum_dtype=self.accum_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, fp8={self.fp8}")


__all__ = ["LinearCrossEntropyLoss"]
