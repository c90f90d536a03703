"""The one place tritium reads environment variables. Each is documented here and nowhere else.

TRITIUM_FORCE_REF=1     run the pure-PyTorch twins in `tritium.ref` even where Triton kernels
                        could run (debugging, bisecting a numerical difference).
TRITIUM_EMULATE_FP8=1   emulate FP8 GEMMs (dequantize + fp32 matmul) even on a GPU that has FP8
                        tensor cores; the casts and scales stay exactly as in the real path.
TRITON_INTERPRET=1      Triton's own switch: kernels run in its CPU interpreter. tritium then
                        launches its Triton kernels on CPU tensors too (the `interp` test tier).
TRITIUM_LOG=LEVEL       logging level of the `tritium` logger (default WARNING).
"""
from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def force_ref() -> bool:
    return _flag("TRITIUM_FORCE_REF")


def emulate_fp8() -> bool:
    return _flag("TRITIUM_EMULATE_FP8")


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def log_level() -> str:
    return os.environ.get("TRITIUM_LOG", "WARNING").upper()
