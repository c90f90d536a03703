"""Distributed helpers: amax reduction, FSDP2 FP8 all-gather (`fsdp`), DCP checkpoints
(`checkpointing`; not named `checkpoint`, which is TE's activation-recompute function). See
docs/distributed.md.

`fsdp` and `checkpointing` import tritium's FP8 and module code, which itself imports `amax` from
here, so they are loaded on first use (module __getattr__) instead of at package import."""
from .amax import reduce_amax_rows

_LAZY = {"enable_fp8_all_gather": "fsdp", "precompute_fp8_scales_for_fsdp": "fsdp",
         "FP8AllGatherWeight": "fsdp"}


def __getattr__(name):
    import importlib
    if name in ("fsdp", "checkpointing"):
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["reduce_amax_rows", "enable_fp8_all_gather", "precompute_fp8_scales_for_fsdp",
           "FP8AllGatherWeight", "fsdp", "checkpointing"]
