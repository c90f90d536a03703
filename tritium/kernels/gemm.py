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

A small Linear's backward in one launch (host time is what such a layer's step costs):
`fp8_gemm_tn_pair` runs two independent GEMMs (dgrad and wgrad) on one persistent grid, the
first's tiles then the second's, each in its own branch of the kernel with shared memory of its
own (hence PAIR_CONFIG's smaller tiles and two stages); `fp8_dgrad_wgrad` does the same from
the high-precision grad under delayed scaling, casting dy in registers as each A tile is loaded
(the cast kernel's arithmetic, amax recorded once per element) and summing dbias from the same
tiles. Twins: `tritium.ref.gemm.fp8_gemm_tn_pair` / `fp8_dgrad_wgrad`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher, TensorDesc, num_sms
from .cast import _TL_FP8, _abs_max_nan, _scaled_fp8


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


@triton.jit
def _fp8_gemm_tn_pair_kernel(a0_desc, b0_desc, c0_desc, a0_scale_inv_ptr, b0_scale_inv_ptr,
                             M0, N0, K0, a1_desc, b1_desc, c1_desc, a1_scale_inv_ptr,
                             b1_scale_inv_ptr, M1, N1, K1, num_programs,
                             PRECISE: tl.constexpr, SPLIT_STORE0: tl.constexpr,
                             SPLIT_STORE1: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    """Two independent GEMMs in one persistent launch: tiles 0 .. T0 - 1 are the first's,
    the rest the second's."""
    tiles_m0 = tl.cdiv(M0, BLOCK_M)
    tiles_n0 = tl.cdiv(N0, BLOCK_N)
    tiles_m1 = tl.cdiv(M1, BLOCK_M)
    tiles_n1 = tl.cdiv(N1, BLOCK_N)
    tiles0 = tiles_m0 * tiles_n0
    for tile in tl.range(tl.program_id(0), tiles0 + tiles_m1 * tiles_n1, num_programs):
        if tile < tiles0:
            off_m, off_n = tile_offsets(tile, tiles_m0, tiles_n0, BLOCK_M, BLOCK_N, GROUP_M)
            c = _tile_product(a0_desc, b0_desc, off_m, off_n, K0, PRECISE, BLOCK_M, BLOCK_N,
                              BLOCK_K)
            c *= tl.load(a0_scale_inv_ptr) * tl.load(b0_scale_inv_ptr)
            _store_tile(c0_desc, c, off_m, off_n, SPLIT_STORE0, BLOCK_M, BLOCK_N)
        else:
            off_m, off_n = tile_offsets(tile - tiles0, tiles_m1, tiles_n1, BLOCK_M, BLOCK_N,
                                        GROUP_M)
            c = _tile_product(a1_desc, b1_desc, off_m, off_n, K1, PRECISE, BLOCK_M, BLOCK_N,
                              BLOCK_K)
            c *= tl.load(a1_scale_inv_ptr) * tl.load(b1_scale_inv_ptr)
            _store_tile(c1_desc, c, off_m, off_n, SPLIT_STORE1, BLOCK_M, BLOCK_N)


@triton.jit
def _dy_tile(dy_ptr, stride_dy, T, N, off_m, ki, scale, TRANSPOSED: tl.constexpr,
             FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """(dy's tile cast to fp8 as `kernels.cast` casts it, the tile in fp32): the dgrad GEMM's
    A tile dy[off_m:, ki * BLOCK_K:] or, TRANSPOSED, the wgrad GEMM's dy^T[off_m:, ki *
    BLOCK_K:] (rows of dy^T are dy's columns); zeros outside dy."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
    if TRANSPOSED:
        valid = (rm[:, None] < N) & (rk[None, :] < T)
        x = tl.load(dy_ptr + rk[None, :].to(tl.int64) * stride_dy + rm[:, None], mask=valid,
                    other=0.0)
    else:
        valid = (rm[:, None] < T) & (rk[None, :] < N)
        x = tl.load(dy_ptr + rm[:, None].to(tl.int64) * stride_dy + rk[None, :], mask=valid,
                    other=0.0)
    x = x.to(tl.float32)
    return _scaled_fp8(x, scale, valid, FP8_MAX, FP8_DTYPE), x


@triton.jit
def _fp8_dgrad_wgrad_kernel(dy_ptr, dy_scale_ptr, dy_amax_ptr, w_t_desc, dx_desc,
                            w_scale_inv_ptr, x_t_desc, dw_desc, x_scale_inv_ptr, dbias_ptr,
                            T, N, K_IN, T_PADDED, stride_dy, num_programs,
                            FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr,
                            SPLIT_DX: tl.constexpr, SPLIT_DW: tl.constexpr,
                            HAS_DBIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """A Linear's backward GEMMs from its high-precision grad dy [T, N] under delayed scaling:
    dx = fp8(dy) @ w (w_t [K_IN, N]) and dw = fp8(dy)^T @ x (x_t [K_IN, T_PADDED]), dy cast
    in registers as each A tile is loaded (no fp8 copy of dy in memory), its amax recorded
    by dx's first column of tiles (each element of dy once). Precise accumulation.
    HAS_DBIAS: dbias = dy.sum(0), summed in fp32 from dy's tiles by dw's first column of
    tiles (each walks all of T for its rows of dy^T) and rounded once."""
    scale = tl.load(dy_scale_ptr)
    dy_scale_inv = tl.math.div_rn(1.0, scale)  # what the cast kernel would write
    tiles_m0 = tl.cdiv(T, BLOCK_M)
    tiles_n0 = tl.cdiv(K_IN, BLOCK_N)
    tiles_m1 = tl.cdiv(N, BLOCK_M)
    tiles0 = tiles_m0 * tiles_n0
    for tile in tl.range(tl.program_id(0), tiles0 + tiles_m1 * tiles_n0, num_programs):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if tile < tiles0:  # dx
            off_m, off_n = tile_offsets(tile, tiles_m0, tiles_n0, BLOCK_M, BLOCK_N, GROUP_M)
            for ki in range(tl.cdiv(N, BLOCK_K)):
                a, x = _dy_tile(dy_ptr, stride_dy, T, N, off_m, ki, scale, False, FP8_MAX,
                                FP8_DTYPE, BLOCK_M, BLOCK_K)
                if off_n == 0:
                    tl.atomic_max(dy_amax_ptr, _abs_max_nan(x))
                b = w_t_desc.load([off_n, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            acc *= dy_scale_inv * tl.load(w_scale_inv_ptr)
            _store_tile(dx_desc, acc, off_m, off_n, SPLIT_DX, BLOCK_M, BLOCK_N)
        else:  # dw
            off_m, off_n = tile_offsets(tile - tiles0, tiles_m1, tiles_n0, BLOCK_M, BLOCK_N,
                                        GROUP_M)
            db = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for ki in range(tl.cdiv(T_PADDED, BLOCK_K)):
                a, x = _dy_tile(dy_ptr, stride_dy, T, N, off_m, ki, scale, True, FP8_MAX,
                                FP8_DTYPE, BLOCK_M, BLOCK_K)
                if HAS_DBIAS:
                    db += tl.sum(x, axis=1)
                b = x_t_desc.load([off_n, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            if HAS_DBIAS:
                if off_n == 0:
                    rm = off_m + tl.arange(0, BLOCK_M)
                    tl.store(dbias_ptr + rm, db.to(dbias_ptr.dtype.element_ty), mask=rm < N)
            acc *= dy_scale_inv * tl.load(x_scale_inv_ptr)
            _store_tile(dw_desc, acc, off_m, off_n, SPLIT_DW, BLOCK_M, BLOCK_N)


_launch_gemm = Launcher(_fp8_gemm_tn_kernel)
_launch_gemm_pair = Launcher(_fp8_gemm_tn_pair_kernel)
_launch_dgrad_wgrad = Launcher(_fp8_dgrad_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) by fast_accum, the best of a
# sweep on an H100 at the Linear's GEMM shapes (8192x4096x4096, 8192x14336x4096,
# 16384x8192x8192), launched persistent.
# Precise accumulation holds a second fp32 tile in registers: 128x256 spills there.
CONFIGS = {True: (128, 256, 128, 8, 8, 3), False: (256, 128, 128, 8, 8, 3)}
ACCUMULATE_CONFIG = (128, 128, 128, 8, 8, 3)
# The pair kernels stage each GEMM's operands in shared memory of their own (two branches),
# and their GEMMs are small (the rule's): smaller tiles, more of them on the SMs, two stages.
# BLOCK_K stays 128, CONFIGS[False]'s: precise accumulation promotes every BLOCK_K of K, so
# the products equal the one-GEMM kernel's bit for bit (eager and compiled steps agree).
PAIR_CONFIG = (128, 128, 128, 8, 4, 2)
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


def fp8_gemm_tn_pair(first: tuple, second: tuple, fast_accum: bool = False) -> tuple:
    """See `tritium.ref.gemm.fp8_gemm_tn_pair`: two GEMMs, one launch (the tiles of both on
    one persistent grid; for small GEMMs, where each launch's host time is the cost)."""
    bm, bn, bk, group_m, warps, stages = PAIR_CONFIG if first[0].is_cuda else _INTERPRET_CONFIG
    args, outs, tiles = [], [], 0
    for a, b, a_scale_inv, b_scale_inv, out_dtype in (first, second):
        m, k = a.shape
        n = b.shape[0]
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
        args += [TensorDesc(a, (bm, bk)), TensorDesc(b, (bn, bk)),
                 TensorDesc(out, (bm, bn // 2 if out_dtype.itemsize == 4 else bn)),
                 a_scale_inv, b_scale_inv, m, n, k]
        outs.append(out)
        tiles += -(-m // bm) * -(-n // bn)
    programs = min(tiles, num_sms(first[0].get_device())) if first[0].is_cuda else tiles
    _launch_gemm_pair((programs,), *args, programs, PRECISE=not fast_accum,
                      SPLIT_STORE0=outs[0].element_size() == 4,
                      SPLIT_STORE1=outs[1].element_size() == 4, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return outs[0], outs[1]


def fp8_dgrad_wgrad(dy: torch.Tensor, dy_scale: torch.Tensor, dy_amax: torch.Tensor,
                    fp8_dtype: torch.dtype, w_t: torch.Tensor, w_scale_inv: torch.Tensor,
                    x_t: torch.Tensor, x_scale_inv: torch.Tensor, dx_dtype: torch.dtype,
                    dw_dtype: torch.dtype, dbias_dtype: Optional[torch.dtype] = None) -> tuple:
    """See `tritium.ref.gemm.fp8_dgrad_wgrad`: the cast of dy and both GEMMs (and dbias),
    one launch."""
    t, n = dy.shape
    k_in, t_padded = x_t.shape
    bm, bn, bk, group_m, warps, stages = PAIR_CONFIG if dy.is_cuda else _INTERPRET_CONFIG
    dx = torch.empty(t, k_in, dtype=dx_dtype, device=dy.device)
    dw = torch.empty(n, k_in, dtype=dw_dtype, device=dy.device)
    db = None if dbias_dtype is None else torch.empty(n, dtype=dbias_dtype, device=dy.device)
    split_dx, split_dw = dx_dtype.itemsize == 4, dw_dtype.itemsize == 4
    tiles = (-(-t // bm) + -(-n // bm)) * -(-k_in // bn)
    programs = min(tiles, num_sms(dy.get_device())) if dy.is_cuda else tiles
    _launch_dgrad_wgrad(
        (programs,), dy, dy_scale, dy_amax, TensorDesc(w_t, (bn, bk)),
        TensorDesc(dx, (bm, bn // 2 if split_dx else bn)), w_scale_inv,
        TensorDesc(x_t, (bn, bk)), TensorDesc(dw, (bm, bn // 2 if split_dw else bn)),
        x_scale_inv, db if db is not None else dx, t, n, k_in, t_padded, dy.stride(0),
        programs, FP8_MAX=fp8_max(fp8_dtype), FP8_DTYPE=_TL_FP8[fp8_dtype], SPLIT_DX=split_dx,
        SPLIT_DW=split_dw, HAS_DBIAS=db is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return dx, dw, db


__all__ = ["fp8_gemm_tn", "fp8_gemm_tn_pair", "fp8_dgrad_wgrad", "CONFIGS", "ACCUMULATE_CONFIG"]
