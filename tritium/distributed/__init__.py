"""Distributed helpers: amax reduction, tensor/sequence parallelism (`tensor_parallel`),
FP8-aware activation recomputation (`checkpoint`), the dropout RNG tracker, FSDP2 FP8 all-gather
(`fsdp`), the TP-aware grad-norm clip (`clip_grad_norm_`) and DCP checkpoints (`checkpointing`;
not named `checkpoint`, which is TE's activation-recompute function). See docs/distributed.md
and docs/tensor_parallel.md.

Everything but the amax reduction is loaded on first use (module __getattr__): fp8/ imports this
package (amax reduction), and those modules import fp8/ and the modules, so an eager import here
would be circular.
"""
import importlib

from .amax import reduce_amax_rows

_LAZY = {"checkpoint": "activation_checkpoint", "CudaRNGStatesTracker": "random",
         "enable_fp8_all_gather": "fsdp", "precompute_fp8_scales_for_fsdp": "fsdp",
         "FP8AllGatherWeight": "fsdp", "clip_grad_norm_": "grad_norm"}


def __getattr__(name):
    if name in ("fsdp", "checkpointing", "tensor_parallel"):
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["reduce_amax_rows", "checkpoint", "CudaRNGStatesTracker", "enable_fp8_all_gather",
           "precompute_fp8_scales_for_fsdp", "FP8AllGatherWeight", "clip_grad_norm_", "fsdp",
           "checkpointing", "tensor_parallel"]
