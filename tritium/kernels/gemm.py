"""Triton FP8 GEMM in the "TN" form: out = (a @ b.T) * a_scale_inv * b_scale_inv (+ bias), or
with `accumulate` out += that product.

Why it exists beside `torch._scaled_mm`: at 8192x4096->4096 an eager FP8 Linear step is bound
by host time on a slow host, and a step whose forward GEMM is this kernel spends ~70 us less
host time than one whose forward goes through cuBLASLt (same GPU time: in fast-accumulation
mode the kernel matches cuBLASLt; in precise mode it is ~20% slower, so dgrad/wgrad stay on
cuBLASLt, see `tritium.functional.gemm`). It is launched through `Launcher` (a direct call of
the compiled kernel) with TMA descriptors built by a light subclass of Triton's
`TensorDescriptor`: a few microseconds of Python plus one driver call per descriptor.

Layout: a [M, K] and b [N, K], fp8 (e4m3 or e5m2, not both e5m2), row-major with K contiguous;
out [M, N] contiguous (a row block of a larger tensor is fine). TMA zero-fills the edges, so M,
N, K need not divide the tiles (the Linear keeps them multiples of 16 anyway). Each program
walks tiles `pid, pid + P, ...` (P = programs launched: the tile count, or the SM count for a
persistent launch) in GROUP_M-grouped order for L2 reuse.

Numerics (twin: `tritium.ref.gemm.fp8_gemm_tn`, the exact fp8 products summed in fp32):
Hopper's tensor cores add fp8 products in a reduced-precision accumulator. `fast_accum=False`
("precise") moves that partial sum into an fp32 accumulator after every BLOCK_K slice of K
(max_num_imprecise_acc), `fast_accum=True` keeps the whole K in the tensor cores' accumulator,
as cuBLASLt's two modes do; measured against fp64, each mode is as accurate as cuBLASLt's
(tests/gpu/test_gpu_gemm.py). The epilogue multiplies by a_scale_inv * b_scale_inv in fp32,
adds the bias in fp32 (the compiler fuses the two into one FMA) and rounds once to the output
dtype. So the kernel equals its twin bit for bit only where every partial sum is exact (the
tests use integer-valued operands for that), and otherwise agrees to the accumulator's
precision. `accumulate` (cuBLAS's beta = 1, which `torch._scaled_mm` does not offer): the
epilogue reads out's tile, adds it in fp32 after the scale and bias and rounds once, so a
[V, H] weight gradient summed over chunks (the FP8 lm_head) needs no product tensor and no
separate add (which reads and writes out once more); its tiles (ACCUMULATE_CONFIG) are smaller,
leaving registers for the old tile.

The small-GEMM forms (a small Linear's forward and backward, one launch each) are in
`tritium.kernels.small_gemm`, built from `tile_offsets`, `_tile_product` and `_store_tile`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher, TensorDesc, num_sms


@triton.jit
def tile_offsets(tile, tiles_m, tiles_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(off_m, off_n) of output tile `tile` in GROUP_M order: GROUP_M row tiles share each
    column tile before the next column, so consecutive programs reuse B's tiles in L2. Shared
    by every GEMM kernel (tensorwise, grouped, block-scaled)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return (first_m + tile % group_m) * BLOCK_M, ((tile % per_group) // group_m) * BLOCK_N


@triton.jit
def _tile_product(a_desc, b_desc, off_m, off_n, K, PRECISE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile (a @ b.T)[off_m:, off_n:], unscaled."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, ki * BLOCK_K])
        b = b_desc.load([off_n, ki * BLOCK_K])
        if PRECISE:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _store_tile(c_desc, c, off_m, off_n, SPLIT_STORE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """c rounded to c_desc's dtype at [off_m, off_n]; SPLIT_STORE: as two [BLOCK_M, BLOCK_N / 2]
    stores (half the staging memory, what an fp32 tile beside the operand stages needs)."""
    if SPLIT_STORE:
        left, right = c.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        c_desc.store([off_m, off_n], left.to(c_desc.dtype))
        c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))
    else:
        c_desc.store([off_m, off_n], c.to(c_desc.dtype))


@triton.jit
def _fp8_gemm_tn_kernel(a_desc, b_desc, c_desc, a_scale_inv_ptr, b_scale_inv_ptr, bias_ptr,
                        c_ptr, M, N, K, stride_cm, num_programs,
                        HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
                        SPLIT_STORE: tl.constexpr, ACCUMULATE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    scale = tl.load(a_scale_inv_ptr) * tl.load(b_scale_inv_ptr)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        off_m, off_n = tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        c = _tile_product(a_desc, b_desc, off_m, off_n, K, PRECISE, BLOCK_M, BLOCK_N,
                          BLOCK_K) * scale
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            c += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if ACCUMULATE:  # out's old tile, added in fp32: one rounding for the sum
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            old = tl.load(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
                          mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
            c += old.to(tl.float32)
        _store_tile(c_desc, c, off_m, off_n, SPLIT_STORE, BLOCK_M, BLOCK_N)


_launch_gemm = Launcher(_fp8_gemm_tn_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) by fast_accum, the best of a
# sweep on an H100 at the Linear's GEMM shapes (8192x4096x4096, 8192x14336x4096,
# 16384x8192x8192), launched persistent.
# Precise accumulation holds a second fp32 tile in registers: 128x256 spills there.
CONFIGS = {True: (128, 256, 128, 8, 8, 3), False: (256, 128, 128, 8, 8, 3)}
ACCUMULATE_CONFIG = (128, 128, 128, 8, 8, 3)
_INTERPRET_CONFIG = (16, 16, 32, 2, 1, 1)


def fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None, fast_accum: bool = False,
                out: Optional[torch.Tensor] = None, accumulate: bool = False, *,
                config: Optional[tuple] = None, persistent: bool = True) -> torch.Tensor:
    """See `tritium.ref.gemm.fp8_gemm_tn`. `config` / `persistent`: tile choice (benchmarks)."""
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if config is None:
        config = (_INTERPRET_CONFIG if not a.is_cuda else ACCUMULATE_CONFIG if accumulate
                  else CONFIGS[fast_accum])
    bm, bn, bk, group_m, warps, stages = config
    tiles = -(-m // bm) * -(-n // bn)
    programs = min(tiles, num_sms(a.get_device())) if persistent and a.is_cuda else tiles
    # the output tile is staged in shared memory for its TMA store: an fp32 tile beside the
    # operand stages would not fit, so it is stored in two halves
    split = out.element_size() == 4
    _launch_gemm((programs,), TensorDesc(a, (bm, bk)), TensorDesc(b, (bn, bk)),
                 TensorDesc(out, (bm, bn // 2 if split else bn)), a_scale_inv, b_scale_inv,
                 bias if bias is not None else a_scale_inv, out if accumulate else a_scale_inv,
                 m, n, k, out.stride(0), programs,
                 HAS_BIAS=bias is not None, PRECISE=not fast_accum, SPLIT_STORE=split,
                 ACCUMULATE=accumulate,
                 BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return out


__all__ = ["fp8_gemm_tn", "CONFIGS", "ACCUMULATE_CONFIG"]
