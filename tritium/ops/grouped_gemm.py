"""Which grouped FP8 GEMM runs for GroupedLinear: tritium's grouped Triton launches or one
cuBLASLt GEMM (`torch._scaled_mm`) per group.

The rule is Linear's (`tritium.ops.gemm`, TRITIUM_FP8_GEMM, default "auto"): fast accumulation
(fprop) runs the grouped Triton kernel, one persistent launch for all groups, as fast as
cuBLASLt there; precise accumulation (dgrad, wgrad) runs cuBLASLt per group, which reaches
~1.1-1.25k FP8 TFLOP/s at the expert shapes where Triton's split accumulation stays near 800
for wgrad (docs/moe.md). "triton" / "cublas" force one for all three. The host cost of a loop (a
`_scaled_mm` call per group, G of them) is hidden behind the GEMMs at expert sizes; at tiny
shapes "triton" is lighter.

`cublas_grouped_fp8_gemm_tn` / `cublas_grouped_fp8_gemm_wgrad` have the signatures of
`tritium.kernels.grouped_gemm`'s (layouts: `tritium.ref.grouped_gemm`'s docstring). The wgrad
loop multiplies each group's whole 16-padded [N, pm_g] x [K, pm_g] blocks: the kernels' grouped
cast writes zeros in the padding columns (cuBLASLt needs the reduction dim a multiple of 16), so
this path runs only on operands the Triton cast wrote (`impl` gives it where that holds).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..ref import grouped_gemm as ref_grouped
from .gemm import cublas_gemm, triton_by_rule


def _aligned_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """The [G] scale_invs as a [G, 4] copy: row g's first element (`[g, :1]`) starts 16 bytes
    after row g-1's. cuBLASLt rejects a scale pointer that is not 16-byte aligned
    (CUBLAS_STATUS_NOT_SUPPORTED), and `scale_inv[g:g + 1]` sits 4 * g bytes in."""
    return scale_inv.reshape(-1, 1).expand(-1, 4).contiguous()


def cublas_grouped_fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                               b_scale_inv: torch.Tensor, offsets: torch.Tensor,
                               out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                               fast_accum: bool = False, *, m_splits=None) -> torch.Tensor:
    """out[rows of g] = a[rows of g] @ b[g].T * a_scale_inv[g] * b_scale_inv[g] (+ bias[g]),
    one `torch._scaled_mm` per non-empty group, written into its rows of one [M, N] result."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    sa, sb = _aligned_scales(a_scale_inv), _aligned_scales(b_scale_inv)
    for g, (r0, r1, _, _) in enumerate(ref_grouped._splits(offsets, m_splits)):
        if r1 > r0:
            cublas_gemm(a[r0:r1], b[g], sa[g, :1], sb[g, :1], out_dtype,
                        None if bias is None else bias[g], fast_accum, out[r0:r1])
    return out


def cublas_grouped_fp8_gemm_wgrad(a_t: torch.Tensor, b_t: torch.Tensor,
                                  a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                                  offsets: torch.Tensor, n: int, k: int, out_dtype: torch.dtype,
                                  *, m_splits=None) -> torch.Tensor:
    """out[g] = A_g @ B_g.T * a_scale_inv[g] * b_scale_inv[g] over each group's 16-padded
    transposed blocks (zero padding: module docstring), precise accumulation; [G, N, K], an
    empty group zeros."""
    splits = ref_grouped._splits(offsets, m_splits)
    out = torch.empty(len(splits), n, k, dtype=out_dtype, device=a_t.device)
    sa, sb = _aligned_scales(a_scale_inv), _aligned_scales(b_scale_inv)
    for g, (_, _, p0, p1) in enumerate(splits):
        if p1 == p0:
            out[g].zero_()
            continue
        cublas_gemm(a_t[n * p0:n * p1].view(n, p1 - p0), b_t[k * p0:k * p1].view(k, p1 - p0),
                    sa[g, :1], sb[g, :1], out_dtype, None, False, out[g])
    return out


class _Cublas:
    """`tritium.kernels.grouped_gemm`'s GEMM functions, through cuBLASLt per group."""
    grouped_fp8_gemm_tn = staticmethod(cublas_grouped_fp8_gemm_tn)
    grouped_fp8_gemm_wgrad = staticmethod(cublas_grouped_fp8_gemm_wgrad)


def impl(t: torch.Tensor, fast_accum: bool):
    """The module-like object whose grouped_fp8_gemm_tn / grouped_fp8_gemm_wgrad run this GEMM:
    the Triton kernels or the cuBLASLt loop on FP8 tensor cores (the rule above), the twins in
    `tritium.ref.grouped_gemm` elsewhere."""
    if not (_device.fp8_tensor_cores(t) and _device.use_triton(t)):
        return ref_grouped
    if not triton_by_rule(fast_accum):
        return _Cublas
    from ..kernels import grouped_gemm as kernel_grouped
    return kernel_grouped


__all__ = ["cublas_grouped_fp8_gemm_tn", "cublas_grouped_fp8_gemm_wgrad", "impl"]
