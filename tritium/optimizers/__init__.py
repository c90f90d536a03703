"""Fused optimizers with TE's API: `FusedAdam`, `FusedSGD` (math in `tritium.kernels`, twins in
`tritium.ref`; see docs/optimizers.md)."""
from .adam import FusedAdam
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
