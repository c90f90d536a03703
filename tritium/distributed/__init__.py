"""Distributed helpers: amax reduction, tensor/sequence parallelism (tensor_parallel.py),
FP8-aware activation recomputation (`checkpoint`) and the dropout RNG tracker.

`checkpoint` and `CudaRNGStatesTracker` are loaded on first use: fp8/ imports this package
(amax reduction) and `checkpoint` imports fp8/, so an eager import here would be circular.
"""
from .amax import reduce_amax_rows

__all__ = ["reduce_amax_rows", "checkpoint", "CudaRNGStatesTracker"]


def __getattr__(name):
    if name == "checkpoint":
        from .activation_checkpoint import checkpoint
        return checkpoint
    if name == "CudaRNGStatesTracker":
        from .random import CudaRNGStatesTracker
        return CudaRNGStatesTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
