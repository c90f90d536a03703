"""FP8 GEMM in the "TN" form every Linear GEMM takes: out = (a @ b.T) * a_scale_inv * b_scale_inv.

a [M, K] and b [N, K] are both row-major fp8 with K contiguous, which is exactly what
`torch._scaled_mm` (cuBLASLt) wants on Hopper: A row-major, B column-major (b.t()). The CUDA rules
are checked here, on every device, so a CPU run fails where a GPU run would: all four dims
divisible by 16 and not e5m2 x e5m2. Where FP8 tensor cores are missing (the CPU, older GPUs,
TRITIUM_EMULATE_FP8=1) the GEMM is emulated (`tritium.ref.gemm`): the fp8 values are exact in
fp32, multiplied in fp32, then scaled, biased and rounded once to out_dtype.

Which GEMM runs on Hopper (TRITIUM_FP8_GEMM, default "auto"): fast accumulation (the forward
GEMM) runs the Triton kernel `tritium.kernels.gemm`, as fast as cuBLASLt there and lighter on
the host of an eager step; precise accumulation (dgrad, wgrad) runs cuBLASLt through
`torch._scaled_mm`, ~20% faster there than Triton's split accumulation. Measurements:
docs/performance.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _device, _env
from ..fp8.formats import E5M2
from ..ref import gemm as ref_gemm

# _scaled_mm fuses a bias only for 16-bit outputs of the bias's own dtype.
_BIAS_FUSABLE = (torch.bfloat16, torch.float16)


def _tma_ok(t: Optional[torch.Tensor]) -> bool:
    """A layout TMA takes: last dim contiguous, base and row stride 16-byte aligned."""
    return t is None or (t.stride(-1) == 1 and not t.data_ptr() & 15
                         and not (t.stride(0) * t.element_size()) & 15)


def _use_triton_gemm(a, b, out, fast_accum: bool) -> bool:
    """"auto": the Triton kernel for fast accumulation (fprop), cuBLASLt for precise (dgrad,
    wgrad); docs/performance.md has the measurements behind it. Layouts TMA cannot take go to
    cuBLASLt."""
    if not _device.use_triton(a):  # TRITIUM_FORCE_REF, or no triton
        return False
    choice = _env.fp8_gemm()
    if not (fast_accum if choice == "auto" else choice == "triton"):
        return False
    return _tma_ok(a) and _tma_ok(b) and _tma_ok(out)


@functools.lru_cache(maxsize=None)
def _kernels():
    """tritium.kernels.gemm, imported on first use (it imports triton)."""
    from ..kernels import gemm as kernel_gemm
    return kernel_gemm


def check_fp8_gemm_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    sa, sb = a.shape, b.shape
    if len(sa) == 2 and len(sb) == 2 and sa[1] == sb[1] and not (sa[0] | sa[1] | sb[0]) & 15 \
            and not (a.dtype == E5M2 and b.dtype == E5M2):
        return  # the common case, in a few operations (this runs for every GEMM)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8 GEMM operands must be [M, K] and [N, K], got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.shape[0] % 16 or t.shape[1] % 16:
            raise ValueError(f"fp8 GEMM operand {name} has shape {tuple(t.shape)}: both dims must "
                             "be divisible by 16 (cuBLASLt FP8 rule)")
    raise TypeError("fp8 GEMM cannot multiply e5m2 by e5m2 (cuBLASLt FP8 rule)")


def fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None, fast_accum: bool = False,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out`: a contiguous [M, N] tensor of out_dtype (e.g. a row block of a larger result)
    to write into; bias is not supported with it."""
    check_fp8_gemm_operands(a, b)
    if out is not None and bias is not None:
        raise ValueError("fp8_gemm_tn: pass either bias or out, not both")
    if not _device.fp8_tensor_cores(a):
        return ref_gemm.fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum,
                                    out)
    if _use_triton_gemm(a, b, out, fast_accum):
        return _kernels().fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                       fast_accum, out)
    fuse_bias = bias is not None and out_dtype in _BIAS_FUSABLE and bias.dtype == out_dtype
    if out is None:
        res = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                               bias=bias if fuse_bias else None, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
    else:
        res = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                               out_dtype=out_dtype, use_fast_accum=fast_accum, out=out)
    if bias is not None and not fuse_bias:
        res = res + bias.to(out_dtype)
    return res
