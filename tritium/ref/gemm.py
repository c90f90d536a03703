"""Pure-PyTorch twin of `tritium.kernels.gemm`: the emulated FP8 GEMM (the CPU path, GPUs
without FP8 tensor cores, TRITIUM_EMULATE_FP8=1) and the test oracle.

out = (a @ b.T) * (a_scale_inv * b_scale_inv) + bias, with a [M, K] and b [N, K] fp8. The fp8
values are exact in fp32 and so are their products; they are summed in fp32, scaled, biased
(with `accumulate`, out's old values added in fp32) and rounded once to out_dtype. `fast_accum` is accepted for the signature: the twin always
accumulates in fp32 (the GPU's fast mode accumulates in the tensor cores' narrower format;
docs/numerics.md gives the difference).
"""
from __future__ import annotations

from typing import Optional

import torch


def fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None, fast_accum: bool = False,
                out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`out`: a [M, N] tensor of out_dtype with a contiguous last dim to write into (e.g. a row
    block); `accumulate`: add to it instead."""
    res = (a.float() @ b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        res = res + bias.float()
    if accumulate:
        res = res + out.float()
    if out is not None:
        return out.copy_(res)
    return res.to(out_dtype)


__all__ = ["fp8_gemm_tn"]
