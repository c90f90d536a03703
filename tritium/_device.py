"""Capability checks. Each answers with a reason, so callers can log or raise it verbatim.

`use_triton(t)` decides, per call, whether a Triton kernel or its pure-PyTorch twin in `ref/`
runs: kernels on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1 (tests).
`fp8_gemm_support(device)` decides between `torch._scaled_mm` and the emulated FP8 GEMM.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import _env

logger = logging.getLogger("tritium")
logger.setLevel(_env.log_level())


@functools.lru_cache(maxsize=None)
def _triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return False, f"triton is not importable ({exc})"
    return True, "triton importable"


def use_triton(t: torch.Tensor) -> bool:
    if _env.force_ref():
        return False
    if t.is_cuda:
        return _triton_available()[0]
    return t.is_cpu and _env.triton_interpret() and _triton_available()[0]


@functools.lru_cache(maxsize=None)
def _cuda_fp8_support(index: int) -> tuple[bool, str]:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (needs >= 8.9)"
    if not hasattr(torch, "_scaled_mm"):
        return False, "this torch build has no torch._scaled_mm"
    return True, f"FP8 tensor cores (compute capability {major}.{minor})"


def fp8_gemm_support(device: torch.device) -> tuple[bool, str]:
    """(True, reason) when FP8 GEMMs run on tensor cores through torch._scaled_mm."""
    if _env.emulate_fp8():
        return False, "TRITIUM_EMULATE_FP8=1"
    if device.type != "cuda":
        return False, f"device {device} is not CUDA: FP8 GEMMs are emulated in fp32"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_fp8_support(index)


def fp8_tensor_cores(t: torch.Tensor) -> bool:
    """Hot-path form of fp8_gemm_support for a tensor: a few attribute reads, no objects."""
    return t.is_cuda and not _env.emulate_fp8() and _cuda_fp8_support(t.get_device())[0]


def default_device(device=None) -> torch.device:
    """TE's default device is "cuda"; tritium falls back to the CPU where there is no GPU."""
    if device is None or (str(device) == "cuda" and not torch.cuda.is_available()):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
