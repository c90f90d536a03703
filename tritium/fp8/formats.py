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


class DType(enum.IntEnum):
    """TE's `DType` (`transformer_engine.pytorch.DType` / `tex.DType`), for code that passes
    `fp8_dtype=tex.DType.kFloat8E4M3` to a quantizer. tritium's own APIs take torch dtypes;
    `to_torch_dtype` maps these names onto them (FP4 / E8M0 members have no tritium use)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8

    def to_torch_dtype(self) -> torch.dtype:
        return _DTYPE_TO_TORCH[self]


_DTYPE_TO_TORCH = {DType.kByte: torch.uint8, DType.kInt32: torch.int32,
                   DType.kFloat32: torch.float32, DType.kFloat16: torch.float16,
                   DType.kBFloat16: torch.bfloat16, DType.kFloat8E4M3: E4M3,
                   DType.kFloat8E5M2: E5M2}


def fp8_dtype_arg(value, where: str) -> torch.dtype:
    """A torch fp8 dtype from a torch fp8 dtype or a DType fp8 member; clear error otherwise."""
    if isinstance(value, DType):
        value = value.to_torch_dtype()
    if value not in FP8_DTYPES:
        raise TypeError(f"{where}: fp8_dtype must be torch.float8_e4m3fn / torch.float8_e5m2 "
                        f"(or DType.kFloat8E4M3 / DType.kFloat8E5M2), got {value!r}")
    return value
