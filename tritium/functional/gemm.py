"""FP8 GEMM in the "TN" form every Linear GEMM takes: out = (a @ b.T) * a_scale_inv * b_scale_inv.

a [M, K] and b [N, K] are both row-major fp8 with K contiguous, which is exactly what
`torch._scaled_mm` (cuBLASLt) wants on Hopper: A row-major, B column-major (b.t()). The CUDA rules
are checked here, on every device, so a CPU run fails where a GPU run would: all four dims
divisible by 16 and not e5m2 x e5m2. Where FP8 tensor cores are missing (the CPU, older GPUs,
TRITIUM_EMULATE_FP8=1) the GEMM is emulated (`tritium.ref.gemm`): the fp8 values are exact in
fp32, multiplied in fp32, then scaled, biased and rounded once to out_dtype.

Which GEMM runs on Hopper (TRITIUM_FP8_GEMM, default "auto"): fast accumulation (the forward
GEMM) runs the Triton kernel `tritium.kernels.gemm`, precise accumulation (dgrad, wgrad) cuBLASLt
through `torch._scaled_mm`; the choice is `tritium.ops.gemm.tensor_core_gemm` (measurements:
docs/performance.md). Under torch.compile the GEMM is the custom op of `tritium.ops.gemm`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..fp8.formats import E5M2
from ..ops import gemm as ops_gemm
from ..ref import gemm as ref_gemm

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
                out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`out`: a contiguous [M, N] tensor of out_dtype (e.g. a row block of a larger result)
    to write into, or with `accumulate` to add into (out += the product, summed in fp32 and
    rounded once); bias is not supported with it."""
    check_fp8_gemm_operands(a, b)
    if out is not None and bias is not None:
        raise ValueError("fp8_gemm_tn: pass either bias or out, not both")
    if accumulate and (out is None or tuple(out.shape) != (a.shape[0], b.shape[0])
                       or out.dtype != out_dtype or out.stride(-1) != 1):
        raise ValueError(f"fp8_gemm_tn(accumulate=True) adds into out: pass out as a [M, N] = "
                         f"[{a.shape[0]}, {b.shape[0]}] tensor of {out_dtype} with a contiguous "
                         f"last dim, got {None if out is None else (tuple(out.shape), out.dtype)}")
    if torch.compiler.is_compiling():
        return ops_gemm.fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum,
                                    out, accumulate)
    if not _device.fp8_tensor_cores(a):
        return ref_gemm.fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum,
                                    out, accumulate)
    return ops_gemm.tensor_core_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum,
                                     out, accumulate)


def fp8_gemm_tn_pair_on_one_launch(first: tuple, second: tuple,
                                   fast_accum: bool = False) -> Optional[tuple]:
    """Two independent GEMMs, each (a, b, a_scale_inv, b_scale_inv, out_dtype), as
    (fp8_gemm_tn of each) in one launch of the Triton kernel where both run on it on this
    device (`tritium.ops.gemm.tensor_core_gemm_pair`: small GEMMs, whose launches' host time is
    their cost); None elsewhere (emulation, torch.compile, cuBLASLt's GEMMs): the caller runs
    them one by one then, in the order its memory wants."""
    check_fp8_gemm_operands(*first[:2])
    check_fp8_gemm_operands(*second[:2])
    if torch.compiler.is_compiling() or not _device.fp8_tensor_cores(first[0]):
        return None
    return ops_gemm.tensor_core_gemm_pair(first, second, fast_accum)


def fp8_dgrad_wgrad_on_one_launch(dy: torch.Tensor, dy_scale: Optional[torch.Tensor],
                                  dy_amax: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                                  w_t: torch.Tensor, w_scale_inv: torch.Tensor,
                                  x_t: torch.Tensor, x_scale_inv: torch.Tensor,
                                  dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                                  dbias_dtype: Optional[torch.dtype] = None,
                                  current: Optional[tuple] = None) -> Optional[tuple]:
    """A small Linear's backward, (dx, dw, dbias or None) as
    `tritium.ref.gemm.fp8_dgrad_wgrad`, in one launch that casts dy in its GEMMs' loads
    (`tritium.ops.gemm.tensor_core_dgrad_wgrad`; under current scaling after the launch that
    measures dy's amax); None where that does not run (emulation, torch.compile, GEMMs above
    the small-GEMM rule): the caller casts dy and runs the GEMMs."""
    if torch.compiler.is_compiling() or not _device.fp8_tensor_cores(dy):
        return None
    return ops_gemm.tensor_core_dgrad_wgrad(dy, dy_scale, dy_amax, fp8_dtype, w_t, w_scale_inv,
                                            x_t, x_scale_inv, dx_dtype, dw_dtype,
                                            dbias_dtype, current)


def gemm_casts_weight(rows: int, weight: torch.Tensor) -> bool:
    """Whether `fp8_gemm_tn_casting_weight` runs its one launch for `rows` rows against this
    high-precision weight here (CUDA with FP8 tensor cores, eager, the small-GEMM rule)."""
    return (not torch.compiler.is_compiling() and _device.fp8_tensor_cores(weight)
            and ops_gemm.casts_b_in_gemm(rows, weight))


def fp8_gemm_tn_casting_weight(a: torch.Tensor, a_scale_inv: torch.Tensor,
                               weight: torch.Tensor, w_scale: Optional[torch.Tensor],
                               w_amax: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                               out_dtype: torch.dtype, bias: Optional[torch.Tensor],
                               write_w_t: bool,
                               current: Optional[tuple] = None) -> Optional[tuple]:
    """A small Linear's forward with its weight in high precision:
    (out, w8^T or None, w's scale_inv) as `tritium.ref.gemm.fp8_gemm_tn_cast_b`, the weight
    cast in the GEMM's loads (`tritium.ops.gemm.tensor_core_gemm_cast_b`). For callers that
    checked `gemm_casts_weight` (device, eager); None where the op's own rule or a's layout
    says no: the caller casts the weight and runs the GEMM."""
    check_fp8_gemm_operands(a, weight)
    return ops_gemm.tensor_core_gemm_cast_b(a, a_scale_inv, weight, w_scale, w_amax, fp8_dtype,
                                            out_dtype, bias, write_w_t, current)


def fp8_gemm_tn_casting_both(x: torch.Tensor, x_scale: Optional[torch.Tensor],
                             x_amax: Optional[torch.Tensor], weight: torch.Tensor,
                             w_scale: Optional[torch.Tensor], w_amax: Optional[torch.Tensor],
                             fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                             bias: Optional[torch.Tensor], write_x_t: bool, write_w_t: bool,
                             current: Optional[tuple] = None) -> Optional[tuple]:
    """`fp8_gemm_tn_casting_weight` with the input x [T, K] in high precision too: (out,
    x8^T or None, x's scale_inv, w8^T or None, w's scale_inv) as
    `tritium.ref.gemm.fp8_gemm_tn_cast_ab`, both cast in the GEMM's loads. For callers that
    checked `gemm_casts_weight` and FP8's shape rules (x's rows need not be a multiple of 16:
    x8^T is padded); None where the op's own rule or x's layout says no."""
    return ops_gemm.tensor_core_gemm_cast_ab(x, x_scale, x_amax, weight, w_scale, w_amax,
                                             fp8_dtype, out_dtype, bias, write_x_t, write_w_t,
                                             current)
