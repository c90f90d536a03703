"""Pure-PyTorch twin of `tritium.kernels.block_gemm`: the block-scaled FP8 GEMM, "TN" form.

out[m, n] = sum over 128-wide K slices s of (a[m, s] . b[n, s]) * sa(m, s) * sb(n, s)
(+ bias), with a [M, K] and b [N, K] fp8 (K contiguous), a_scale_inv [Kb, M] (1x128 tiles,
slice-major: sa(m, s) = a_scale_inv[s, m]), and b_scale_inv [Kb, N] (1x128 tiles: sb(n, s) =
b_scale_inv[s, n]) or [Nb, Kb] (128x128 blocks, `b_block_2d`: sb(n, s) =
b_scale_inv[n // 128, s]); Kb = ceil(K / 128). These are the layouts
`tritium.ref.block_cast.quantize_blocks` writes.

Numerics: each slice's products are exact in fp32 and summed in fp32 (the GPU sums one slice
in the tensor cores' accumulator); the slice sum is multiplied by sa * sb (128x128 weight
blocks: one scale per row of a kernel tile) or by sa, then sb (1x128 x 1x128), and added to the
fp32 accumulator (no rounding in the scaling with power-of-2 scales; the GPU may fuse the last
multiply and add into one FMA) ("promotion" every 128 of K, DeepSeek-V3's recipe); the bias
is added in fp32 and the result rounded once to out_dtype. The kernel does the same operations
in the same order, so the two agree bit for bit wherever the slice sums are exact.
"""
from __future__ import annotations

from typing import Optional

import torch

BLOCK = 128


def block_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                  b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                  bias: Optional[torch.Tensor] = None, *, b_block_2d: bool = False,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    sb = b_scale_inv.repeat_interleave(BLOCK, dim=0)[:n].t() if b_block_2d else b_scale_inv
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for i, k0 in enumerate(range(0, k, BLOCK)):
        part = a[:, k0:k0 + BLOCK].float() @ b[:, k0:k0 + BLOCK].float().t()
        sa_i, sb_i = a_scale_inv[i, :, None].float(), sb[None, i, :].float()
        acc += part * (sa_i * sb_i) if b_block_2d else (part * sa_i) * sb_i
    if bias is not None:
        acc += bias.float()
    if out is not None:
        return out.copy_(acc)
    return acc.to(out_dtype)


def mx_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MXFP8 GEMM, emulated: a [M, K], b [N, K] fp8 with power-of-2 scales [*, ceil(K/32)]
    (one per 32 elements along K). Dequantized values are exact in fp32 (fp8 times 2^e), the
    products and their fp32 sum are what a Blackwell MXFP8 MMA computes up to summation order."""
    k = a.shape[1]
    a_deq = a.float() * a_scale.repeat_interleave(32, dim=1)[:, :k]
    b_deq = b.float() * b_scale.repeat_interleave(32, dim=1)[:, :k]
    acc = a_deq @ b_deq.t()
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


__all__ = ["block_gemm_tn", "mx_gemm_tn", "BLOCK"]
