"""FP8 formats and the constants every other module reads.

Two torch dtypes exist: E4M3 (`torch.float8_e4m3fn`, max 448, no infinities) and E5M2
(`torch.float8_e5m2`, max 57344). A recipe's `Format` says which one each direction uses:
HYBRID = forward tensors (input, weight, output) E4M3, backward (grad_output, grad_input) E5M2.
"""
from __future__ import annotations

import enum

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FP32_MAX = torch.finfo(torch.float32).max
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Format(enum.Enum):
    """Which FP8 dtype the forward and the backward pass use (TE's `recipe.Format`)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        return E5M2 if self is Format.E5M2 else E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        return E4M3 if self is Format.E4M3 else E5M2


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_MAX:
        raise TypeError(f"fp8 dtype must be one of {FP8_DTYPES}, got {dtype}")
    return FP8_MAX[dtype]
