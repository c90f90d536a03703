"""Capability checks. Each answers with a reason, so callers can log or raise it verbatim.

`use_triton(t)` decides, per call, whether a Triton kernel or its pure-PyTorch twin in `ref/`
runs: kernels on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1 (tests).
`fp8_gemm_support(device)` decides between `torch._scaled_mm` and the emulated FP8 GEMM.
"""
from __future__ import annotations

import functools
import importlib
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


@functools.lru_cache(maxsize=None)
def kernel_module(name: str):
    """tritium.kernels.<name>, imported on first use (it imports triton); a cached look-up
    after that, where a function-level import runs the import machinery on every call."""
    return importlib.import_module(f"{__package__}.kernels.{name}")


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


# ---------------------------------------------------------------- TE's capability queries
# TE's `is_*_available(return_reason=False)` say whether a recipe can run. tritium runs every
# recipe it implements on any device (FP8 tensor cores where there are some, fp32 emulation
# elsewhere), so "available" means "runs here"; the reason says how (TE leaves it empty when
# available; here it names the emulation when there are no FP8 tensor cores).
def device_compute_capability() -> tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) where there is no GPU."""
    if not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))


def fp8_recipe_support() -> tuple[bool, str]:
    """Delayed and current (per-tensor) scaling: always available; how it runs."""
    if torch.cuda.is_available():
        ok, reason = fp8_gemm_support(torch.device("cuda", torch.cuda.current_device()))
        if ok:
            return True, ""
        return True, f"emulated: {reason}"
    return True, "emulated: no CUDA device, FP8 GEMMs are emulated in fp32 on the CPU"


def block_recipe_support(recipe_class: str, what: str,
                         native_cc: tuple[int, int]) -> tuple[bool, str]:
    """A block-scaled recipe: available once tritium implements `recipe_class`."""
    from .fp8.recipe import _RECIPE_CLASSES  # fp8 imports this module: import late
    if recipe_class not in _RECIPE_CLASSES:
        return False, f"{what} ({recipe_class}) is not implemented in this tritium version"
    cc = device_compute_capability()
    if cc >= native_cc:
        return True, ""
    return True, (f"emulated: {what} GEMMs need compute capability {native_cc[0]}.{native_cc[1]}"
                  f" (this device: {cc[0]}.{cc[1]})")


def bf16_support() -> tuple[bool, str]:
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return True, ""
        return False, "this GPU has no bfloat16 support (needs compute capability >= 8.0)"
    return True, ""


def cudnn_version() -> tuple[int, int, int]:
    """cuDNN's (major, minor, patch); (0, 0, 0) where torch has no cuDNN (CPU builds)."""
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not v:
        return (0, 0, 0)
    major = v // 10000 if v >= 90000 else v // 1000   # cuDNN 9 encodes 9.10.2 as 91002
    rest = v - major * (10000 if v >= 90000 else 1000)
    return (major, rest // 100, rest % 100)
