"""Triton block-scaled FP8 GEMM for Hopper (Float8BlockScaling), "TN" form.

out = sum over 128-wide K slices of (a_slice @ b_slice^T) * sa[m, slice] * sb[n or n/128, slice]
(+ bias). Twin and exact contract: `tritium.ref.block_gemm.block_gemm_tn`. BLOCK_K is 128, the
scale granularity: each K step's tensor-core product starts from a zero accumulator and is
then scaled and added to the fp32 accumulator (split accumulation, promotion every 128 of K).

Layout: a [M, K] and b [N, K] fp8 with K contiguous, 16-byte aligned rows (K % 16 == 0), read
through TMA (zero-filled at the edges, so M, N, K need not divide the tiles); a_scale_inv
[Kb, M] and b_scale_inv [Kb, N] (1x128, slice-major) or [Nb, Kb] (128x128 blocks), fp32, read
with plain masked loads: one contiguous vector per K step (a scalar for 128x128 blocks). The
output tile is stored through TMA. Each program walks tiles `pid, pid + P, ...` (persistent:
P = programs per SM x SM count) in GROUP_M order.

Scheduling: each K step waits for its MMA (wgmma.wait_group 0) before the promotion, since the
slice is scaled as soon as it is summed; Triton 3.6 neither keeps such a dot in flight across
iterations nor warp-specializes this loop on Hopper (checked in the PTX). The default config
therefore runs two programs per SM, so that one's promotion FMAs overlap the other's MMAs.
Not done: DeepGEMM's warp-specialized ping-pong consumers, FP8 output.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher, TensorDesc, num_sms
from .gemm import tile_offsets


@triton.jit
def _block_gemm_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, bias_ptr, M, N, K, KB,
                       num_programs, HAS_BIAS: tl.constexpr, B_2D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        off_m, off_n = tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        sb_block = sb_ptr + (off_n // 128) * KB   # B_2D: a tile lies in one 128-row block
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            part = tl.dot(a, b.T)
            # slice-major scale grids: this K step's scales are contiguous vectors
            sa = tl.load(sa_ptr + ki * M + rm, mask=rm < M, other=0.0)
            if B_2D:  # one scale per row: one FMA per element
                acc += part * (sa * tl.load(sb_block + ki))[:, None]
            else:
                sb = tl.load(sb_ptr + ki * N + rn, mask=rn < N, other=0.0)
                acc += (part * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


_launch_gemm = Launcher(_block_gemm_kernel)

# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages, programs per SM); BLOCK_K is always 128.
# Two fp32 tiles (slice and accumulator) live in registers. Each K step waits for its MMA
# before the promotion FMAs, so one program alone leaves the tensor cores idle during them:
# the default keeps two programs per SM (64x128 tiles, 4 warps, ~170 registers, ~90 KB of
# shared memory each), so one's FMAs overlap the other's MMAs. Checked free of spills with
# ptxas for sm_90a; the benchmark's sweep (benchmarks/bench_block_scaling.py) picks among these.
CONFIG = (64, 128, 8, 4, 3, 2)
_INTERPRET_CONFIG = (16, 32, 2, 1, 1, 1)


def block_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                  b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                  bias: Optional[torch.Tensor] = None, *, b_block_2d: bool = False,
                  out: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                  persistent: bool = True) -> torch.Tensor:
    """See `tritium.ref.block_gemm.block_gemm_tn`. `config` / `persistent`: benchmarks."""
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if config is None:
        config = CONFIG if a.is_cuda else _INTERPRET_CONFIG
    bm, bn, group_m, warps, stages, per_sm = config
    tiles = -(-m // bm) * -(-n // bn)
    programs = (min(tiles, per_sm * num_sms(a.get_device())) if persistent and a.is_cuda
                else tiles)
    sa, sb = a_scale_inv.contiguous(), b_scale_inv.contiguous()
    if b_block_2d and 128 % bn:
        raise ValueError(f"block_gemm_tn: with 128x128 weight blocks BLOCK_N must divide 128, "
                         f"got config {config}")
    _launch_gemm((programs,), TensorDesc(a, (bm, 128)), TensorDesc(b, (bn, 128)),
                 TensorDesc(out, (bm, bn)), sa, sb, bias if bias is not None else sa,
                 m, n, k, -(-k // 128), programs, HAS_BIAS=bias is not None, B_2D=b_block_2d,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=group_m, num_warps=warps,
                 num_stages=stages)
    return out


__all__ = ["block_gemm_tn", "CONFIG"]
