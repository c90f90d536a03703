"""The one place tritium reads environment variables. Each is documented here and nowhere else.

TRITIUM_FORCE_REF=1     run the pure-PyTorch twins in `tritium.ref` even where Triton kernels
                        could run (debugging, bisecting a numerical difference).
TRITIUM_EMULATE_FP8=1   emulate FP8 GEMMs (dequantize + fp32 matmul) even on a GPU that has FP8
                        tensor cores; the casts and scales stay exactly as in the real path.
TRITON_INTERPRET=1      Triton's own switch: kernels run in its CPU interpreter. tritium then
                        launches its Triton kernels on CPU tensors too (the `interp` test tier).
TRITIUM_ATTN_BACKEND=B  force DotProductAttention's backend: cudnn, flash, efficient or torch (alias math);
                        unset or "auto": chosen per call (`tritium.attention.explain` says why).
TRITIUM_FP8_GEMM=G      which FP8 GEMM runs on Hopper: "triton" (tritium.kernels.gemm), "cublas"
                        (torch._scaled_mm) or "auto" (default; ops/gemm.py says how). The same
                        choice for GroupedLinear (ops/grouped_gemm.py) and, "triton" or not,
                        for the block-scaled GEMMs (fp8/block.py).
TRITIUM_LOG=LEVEL       logging level of the `tritium` logger (default WARNING).

The variables are read once, at import: an FP8 step asks several times per layer, and reading
os.environ each time is measurable host time. After changing one at run time, call `reload()`.
"""
from __future__ import annotations

import os

# The variables above that change which code runs (benchmark results record them when set).
SWITCHES = ("TRITIUM_FORCE_REF", "TRITIUM_EMULATE_FP8", "TRITIUM_ATTN_BACKEND", "TRITIUM_FP8_GEMM")

_flags: dict[str, bool] = {}
_values: dict[str, str] = {}


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def reload() -> None:
    """Re-read the environment (tests and tools that change a variable at run time)."""
    for name in ("TRITIUM_FORCE_REF", "TRITIUM_EMULATE_FP8", "TRITON_INTERPRET"):
        _flags[name] = _flag(name)
    _values["TRITIUM_ATTN_BACKEND"] = os.environ.get("TRITIUM_ATTN_BACKEND", "").strip().lower()
    gemm = os.environ.get("TRITIUM_FP8_GEMM", "auto").strip().lower() or "auto"
    if gemm not in ("auto", "triton", "cublas"):
        raise ValueError(f"TRITIUM_FP8_GEMM={gemm!r}: use auto, triton or cublas")
    _values["TRITIUM_FP8_GEMM"] = gemm


reload()


def force_ref() -> bool:
    return _flags["TRITIUM_FORCE_REF"]


def emulate_fp8() -> bool:
    return _flags["TRITIUM_EMULATE_FP8"]


def triton_interpret() -> bool:
    return _flags["TRITON_INTERPRET"]


def attn_backend():
    """The forced attention backend name, or None (chosen per call)."""
    value = _values["TRITIUM_ATTN_BACKEND"]
    return None if value in ("", "auto") else value


def fp8_gemm() -> str:
    """"auto", "triton" or "cublas" (TRITIUM_FP8_GEMM)."""
    return _values["TRITIUM_FP8_GEMM"]


def log_level() -> str:
    return os.environ.get("TRITIUM_LOG", "WARNING").upper()
