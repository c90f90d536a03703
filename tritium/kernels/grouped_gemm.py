"""Triton kernels of GroupedLinear under FP8: one grouped cast and two grouped GEMMs.

Twins: `tritium.ref.grouped_gemm` (same names and signatures; its docstring has the layouts:
`offsets` int32 [2, G+1] with the real and the 16-padded cumulative row counts, each group's
transpose a [K, pm_g] block of one flat buffer).

* `grouped_cast_transpose`: every group's rows cast with that group's scale (per-expert scales,
  as TE's GroupedLinear has), amax max-accumulated per group, transposed blocks written in the
  same pass, in ONE launch for all groups. Row tiles are laid group by group (a group's last
  tile stops at its end; the grid has G spare tiles, which do nothing): a tile has one group,
  one scale, one atomic max, and its transposed rows are one 16-aligned run of the group's
  block. Every global access is 16 bytes a thread: the transposed store's mask stops at the
  group's 16-padded end (a multiple of 16 Triton can see; a mask at the loaded row count made
  each store one byte), so the padding columns get zeros. amax: a per-row max of |x|'s int32
  bits (warp shuffles), one block reduction and one relaxed atomic per program. Tile bases
  are 64-bit scalars, offsets inside a tile 32-bit (fewer registers: more programs an SM).
* `grouped_fp8_gemm_tn` (fprop and dgrad): out[rows of g] = a[rows of g] @ b[g].T, scaled by the
  group's two scale_invs (+ the group's bias). One persistent launch walks all groups' tiles
  (group by group, GROUP_M-swizzled inside a group for L2 reuse); a program finds its tile's
  group by a scan over the G offsets (a few scalar loads). a and b are read through TMA
  descriptors (rows past a group's end belong to the next group or are TMA's zero fill: they
  are computed and never stored); the output is stored with a row mask, so m_g needs no
  padding, and an empty group has no tiles.
* `grouped_fp8_gemm_wgrad`: out[g] = A_g @ B_g.T with the reduction over the group's rows, from
  the transposed blocks. Pointer loads (a host-built TMA box cannot stop at a group boundary
  inside one tensor): the whole K tiles unmasked along K, with rows 16-byte aligned by the
  padded layout, so they are vector loads and the loop is cp.async-pipelined (checked in the
  sm_90 build); the group's last partial tile is one masked step. An empty group gets zeros.
* Variant "tma" of both GEMMs (config's 7th field, `CONFIGS`): the same tiles walked group by
  group, each program building that group's TMA descriptors on the device once
  (`tl.make_tensor_descriptor`, shapes ending at the group's end, so boxes are zero-filled /
  stores clipped there): wgrad's operands through TMA, and TMA stores of the outputs.
Accumulation: fprop fast (`fast_accum=True`), dgrad/wgrad precise (fp32 promotion every BLOCK_K),
as `tritium.kernels.gemm`. Bitwise equal to the twin where all partial sums are exact.

Not done here: block scaling (1x128 / 128x128 tiles), a fused bias gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher, TensorDesc, ensure_scratch_allocator, next_pow2, num_sms
from .cast import _TL_FP8, _current_scale, _scaled_fp8
from .gemm import _store_tile, tile_offsets


@triton.jit
def _grouped_cast_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, scale_stride, amax_ptr,
                         amax_stride, scale_inv_ptr, offs_ptr, K, G, stride_xm,
                         FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                         WRITE_DATA: tl.constexpr, WRITE_T: tl.constexpr,
                         UPDATE_AMAX: tl.constexpr, CURRENT: tl.constexpr, EPS: tl.constexpr,
                         POW2: tl.constexpr, GP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # the row tiles are laid group by group (a group's last tile stops at its end): tile
    # pid_m is in the first group whose tiles end past it; the grid has G spare row tiles
    j = tl.arange(0, GP)
    starts = tl.load(offs_ptr + j, mask=j < G, other=0)
    ends = tl.load(offs_ptr + 1 + j, mask=j < G, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    g = tl.sum((tl.cumsum(tiles, 0) <= pid_m).to(tl.int32))
    first = tl.sum(tl.where(j < g, tiles, 0))
    valid = g < G  # a spare tile past the last group: no rows
    g = tl.minimum(g, G - 1)
    r0 = tl.load(offs_ptr + g)
    m_g = tl.load(offs_ptr + g + 1) - r0
    local = (pid_m - first) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows from the group's start
    row_ok = (local < m_g) & valid
    # 64-bit scalar bases of the tile, 32-bit offsets inside it (47 registers a thread where
    # a tile of 64-bit offsets took 55: 5 programs an SM, not 4)
    row0 = (r0 + (pid_m - first) * BLOCK_M).to(tl.int64)
    i = tl.arange(0, BLOCK_M)
    x_tile = x_ptr + row0 * stride_xm
    d_tile = data_ptr + row0 * K
    if CURRENT:
        scale = _current_scale(tl.load(amax_ptr + g * amax_stride), FP8_MAX, EPS, POW2)
    else:
        scale = tl.load(scale_ptr + g * scale_stride)
    if WRITE_T:
        # the group's [K, pm_g] block starts 16-aligned with 16-aligned rows; the tile's rows
        # are one run in it. Its store mask stops at pm_g (a multiple of 16, not at m_g, a
        # loaded count Triton knows nothing about): 16-byte vector stores, the padding
        # columns written with zeros (a mask at m_g made every store one byte)
        p0 = tl.multiple_of(tl.load(offs_ptr + G + 1 + g), 16)
        pm = tl.multiple_of(tl.load(offs_ptr + G + 2 + g) - p0, 16)
        t_tile = data_t_ptr + K * p0.to(tl.int64) + (pid_m - first) * BLOCK_M
        t_ok = (local < pm) & valid
    # amax kept as the int32 bits of |x| (non-negative floats order as their bits, a NaN's
    # above inf's), reduced along each row only (shuffles inside a warp, no shared memory):
    # one block-wide reduction per program, not one per tile
    amax_bits = tl.zeros([BLOCK_M], dtype=tl.int32)
    for c in range(COLS):  # COLS column tiles per program: one atomic max for them all
        col0 = (pid_n * COLS + c) * BLOCK_N
        jn = tl.arange(0, BLOCK_N)
        rn = col0 + jn
        if WRITE_DATA or UPDATE_AMAX:
            mask = row_ok[:, None] & (rn[None, :] < K)
            x = tl.load(x_tile + (i[:, None] * stride_xm + rn[None, :]), mask=mask, other=0.0)
            x = x.to(tl.float32)
            if WRITE_DATA:
                tl.store(d_tile + (i[:, None] * K + rn[None, :]),
                         _scaled_fp8(x, scale, mask, FP8_MAX, OUT_DTYPE), mask=mask)
            if UPDATE_AMAX:
                bits = tl.abs(x).to(tl.int32, bitcast=True)
                amax_bits = tl.maximum(amax_bits, tl.max(bits, axis=1))
        if WRITE_T:
            # the tile read again transposed (an L1/L2 hit; see tritium.kernels.cast on
            # tl.trans), stored as contiguous runs of the transposed rows
            mask_t = (rn[:, None] < K) & row_ok[None, :]
            xt = tl.load(x_tile + (i[None, :] * stride_xm + rn[:, None]), mask=mask_t,
                         other=0.0)
            tl.store(t_tile + col0.to(tl.int64) * pm + (jn[:, None] * pm + i[None, :]),
                     _scaled_fp8(xt.to(tl.float32), scale, mask_t, FP8_MAX, OUT_DTYPE),
                     mask=(rn[:, None] < K) & t_ok[None, :])
    if UPDATE_AMAX:  # relaxed: a max needs no ordering with this program's stores
        amax = tl.max(amax_bits).to(tl.float32, bitcast=True)
        amax = tl.where(amax != amax, float("nan"), amax)  # one NaN, whatever the payload
        tl.atomic_max(amax_ptr + g * amax_stride, amax, mask=valid, sem="relaxed")
    if WRITE_DATA or WRITE_T:
        if (pid_m == 0) & (pid_n == 0):
            for gg in range(G):  # every group's scale_inv, empty groups included
                if CURRENT:
                    s = _current_scale(tl.load(amax_ptr + gg * amax_stride), FP8_MAX, EPS, POW2)
                else:
                    s = tl.load(scale_ptr + gg * scale_stride)
                tl.store(scale_inv_ptr + gg, tl.math.div_rn(1.0, s))


@triton.jit
def _grouped_gemm_kernel(a_desc, b_desc, out_ptr, a_si_ptr, b_si_ptr, bias_ptr, offs_ptr,
                         N, K, G, total_tiles, num_programs,
                         HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), total_tiles, num_programs):
        grp = tile * 0  # int32 scalars from the start (loop-carried)
        first = tile * 0
        seen = tile * 0
        for j in range(G):  # which group's tiles this one is among
            cnt = tl.cdiv(tl.load(offs_ptr + j + 1) - tl.load(offs_ptr + j), BLOCK_M) * tiles_n
            hit = (tile >= seen) & (tile < seen + cnt)
            grp = tl.where(hit, j, grp)
            first = tl.where(hit, seen, first)
            seen += cnt
        row0 = tl.load(offs_ptr + grp)
        rows = tl.load(offs_ptr + grp + 1) - row0
        local = tile - first
        tiles_m = tl.cdiv(rows, BLOCK_M)
        off_m, off_n = tile_offsets(local, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([row0 + off_m, ki * BLOCK_K])
            b = b_desc.load([grp * N + off_n, ki * BLOCK_K])
            if PRECISE:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
        c = acc * (tl.load(a_si_ptr + grp) * tl.load(b_si_ptr + grp))
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            c += tl.load(bias_ptr + grp * N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm < rows)[:, None] & (rn < N)[None, :]
        tl.store(out_ptr + (row0 + rm).to(tl.int64)[:, None] * N + rn[None, :],
                 c.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, out_ptr, a_si_ptr, b_si_ptr, offs_ptr, N, K, G,
                          num_programs, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(N, BLOCK_M)
    tiles_n = tl.cdiv(K, BLOCK_N)
    per_expert = tiles_m * tiles_n
    for tile in tl.range(tl.program_id(0), G * per_expert, num_programs):
        grp = tile // per_expert
        local = tile % per_expert
        off_m, off_n = tile_offsets(local, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        rows = tl.load(offs_ptr + grp + 1) - tl.load(offs_ptr + grp)
        p0 = tl.multiple_of(tl.load(offs_ptr + G + 1 + grp).to(tl.int64), 16)  # 16-aligned
        stride = tl.multiple_of(tl.load(offs_ptr + G + 2 + grp) - p0, 16)     # rows: cp.async
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + N * p0 + rm.to(tl.int64)[:, None] * stride
        b_rows = b_ptr + K * p0 + rn.to(tl.int64)[:, None] * stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        full = (rows // BLOCK_K) * BLOCK_K
        # whole K tiles without a mask along K (vector loads, so the loop is pipelined with
        # cp.async), then one masked tail tile
        for k0 in range(0, full, BLOCK_K):
            a = tl.load(a_rows + (k0 + rk)[None, :], mask=(rm < N)[:, None], other=0.0)
            b = tl.load(b_rows + (k0 + rk)[None, :], mask=(rn < K)[:, None], other=0.0)
            if PRECISE:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
        if full < rows:
            kk = full + rk
            a = tl.load(a_rows + kk[None, :], mask=(rm < N)[:, None] & (kk < rows)[None, :],
                        other=0.0)
            b = tl.load(b_rows + kk[None, :], mask=(rn < K)[:, None] & (kk < rows)[None, :],
                        other=0.0)
            if PRECISE:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
        c = acc * (tl.load(a_si_ptr + grp) * tl.load(b_si_ptr + grp))
        mask = (rm < N)[:, None] & (rn < K)[None, :]
        tl.store(out_ptr + grp.to(tl.int64) * N * K + rm.to(tl.int64)[:, None] * K + rn[None, :],
                 c.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_gemm_tma_kernel(a_desc, b_desc, out_ptr, a_si_ptr, b_si_ptr, bias_ptr, offs_ptr,
                             N, K, G, num_programs,
                             HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
                             SPLIT_STORE: tl.constexpr, FLATTEN: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    """`_grouped_gemm_kernel`'s tiles, walked group by group: each program builds one output
    descriptor per group ([m_g, N] from the group's first row, so a TMA store stops at the
    group's end) and takes the group's tiles t with (tiles before + t) % programs == its id,
    the same tiles the flat walk gives it."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    seen = pid * 0  # the tiles of the groups before this one (int32, loop-carried)
    for grp in range(G):
        row0 = tl.load(offs_ptr + grp)
        rows = tl.load(offs_ptr + grp + 1) - row0
        tiles_m = tl.cdiv(rows, BLOCK_M)
        count = tiles_m * tiles_n
        sub_n: tl.constexpr = BLOCK_N // 2 if SPLIT_STORE else BLOCK_N
        out_desc = tl.make_tensor_descriptor(out_ptr + row0.to(tl.int64) * N,
                                             shape=[tl.maximum(rows, 1), N], strides=[N, 1],
                                             block_shape=[BLOCK_M, sub_n])
        scale = tl.load(a_si_ptr + grp) * tl.load(b_si_ptr + grp)
        start = (pid + num_programs - seen % num_programs) % num_programs
        for local in tl.range(start, count, num_programs, flatten=FLATTEN):
            off_m, off_n = tile_offsets(local, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = a_desc.load([row0 + off_m, ki * BLOCK_K])
                b = b_desc.load([grp * N + off_n, ki * BLOCK_K])
                if PRECISE:
                    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
                else:
                    acc = tl.dot(a, b.T, acc)
            c = acc * scale
            if HAS_BIAS:
                rn = off_n + tl.arange(0, BLOCK_N)
                c += tl.load(bias_ptr + grp * N + rn, mask=rn < N,
                             other=0.0).to(tl.float32)[None, :]
            _store_tile(out_desc, c, off_m, off_n, SPLIT_STORE, BLOCK_M, BLOCK_N)
        seen += count


@triton.jit
def _grouped_wgrad_tma_kernel(a_ptr, b_ptr, out_ptr, a_si_ptr, b_si_ptr, offs_ptr, N, K, G,
                              num_programs, PRECISE: tl.constexpr, SPLIT_STORE: tl.constexpr,
                              FLATTEN: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr):
    """`_grouped_wgrad_kernel` through TMA: per group, descriptors built on the device for its
    two transposed blocks ([N, m_g] and [K, m_g], row stride pm_g: a box stops at m_g and is
    zero-filled past it, so the last partial K tile needs no mask) and for its [N, K] output."""
    tiles_m = tl.cdiv(N, BLOCK_M)
    tiles_n = tl.cdiv(K, BLOCK_N)
    per_expert = tiles_m * tiles_n
    pid = tl.program_id(0)
    for grp in range(G):
        rows = tl.load(offs_ptr + grp + 1) - tl.load(offs_ptr + grp)
        p0 = tl.load(offs_ptr + G + 1 + grp)
        stride = tl.load(offs_ptr + G + 2 + grp) - p0
        p0 = p0.to(tl.int64)
        a_desc = tl.make_tensor_descriptor(a_ptr + N * p0, shape=[N, tl.maximum(rows, 1)],
                                           strides=[tl.maximum(stride, 16), 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr + K * p0, shape=[K, tl.maximum(rows, 1)],
                                           strides=[tl.maximum(stride, 16), 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        sub_n: tl.constexpr = BLOCK_N // 2 if SPLIT_STORE else BLOCK_N
        out_desc = tl.make_tensor_descriptor(out_ptr + tl.cast(grp, tl.int64) * N * K,
                                             shape=[N, K], strides=[K, 1],
                                             block_shape=[BLOCK_M, sub_n])
        scale = tl.load(a_si_ptr + grp) * tl.load(b_si_ptr + grp)
        start = (pid + num_programs - (grp * per_expert) % num_programs) % num_programs
        for local in tl.range(start, per_expert, num_programs, flatten=FLATTEN):
            off_m, off_n = tile_offsets(local, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, rows, BLOCK_K):
                a = a_desc.load([off_m, k0])
                b = b_desc.load([off_n, k0])
                if PRECISE:
                    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
                else:
                    acc = tl.dot(a, b.T, acc)
            c = acc * scale
            _store_tile(out_desc, c, off_m, off_n, SPLIT_STORE, BLOCK_M, BLOCK_N)


_launch_cast = Launcher(_grouped_cast_kernel)
_launch_gemm_tma = Launcher(_grouped_gemm_tma_kernel)
_launch_wgrad_tma = Launcher(_grouped_wgrad_tma_kernel)
_launch_gemm = Launcher(_grouped_gemm_kernel)
_launch_wgrad = Launcher(_grouped_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, variant): the single GEMM's tiles
# (tritium.kernels.gemm.CONFIGS) for fprop / dgrad; wgrad takes 128x128.
# variant: "flat" (`_grouped_gemm_kernel` / `_grouped_wgrad_kernel`), "tma" (the per-group
# walk with device-built descriptors) or "tma_flat" (the same, its tile loop flattened into
# the K loop by Triton's pipeliner). Each GEMM's fastest walk at the Mixtral expert shapes
# (H200, fc2 8 x 2048 rows: fprop tma 1.44 ms, flat about the same; dgrad flat 1.86 ms, tma
# 1.89; wgrad tma 2.48 ms, flat 2.65).
CONFIGS = {"fast": (128, 256, 128, 8, 8, 3, "tma"), "precise": (256, 128, 128, 8, 8, 3, "flat"),
           "wgrad": (128, 128, 128, 8, 8, 3, "tma")}
_INTERPRET_CONFIG = (16, 16, 32, 2, 1, 1, "flat")
# the grouped cast's (BLOCK_M, BLOCK_N, num_warps, COLS): tritium.kernels.cast's tile, COLS
# column tiles per program. COLS=1: 47 registers a thread (sm_90 build), 5 programs an SM;
# a COLS loop keeps its tile offsets live (108 registers, 2 programs an SM). 4 warps: the fc1
# weight cast (8 x [28672, 4096]) at 87.8% of a copy on an H200, 8 warps 74.8%, (128, 128, 8)
# 86.1%, (64, 256, 8) 83.8%, (32, 128, 4) 78.5% (bench_moe.py --stages, 2026-11-24)
CAST_CONFIG = (64, 128, 4, 1)
_INTERPRET_CAST_CONFIG = (16, 16, 1, 2)
VARIANTS = ("flat", "tma", "tma_flat")


def _config(config, default):
    if config is None:
        return default
    if len(config) == 6:
        return (*config, "flat")
    if len(config) != 7 or config[6] not in VARIANTS:
        raise ValueError(f"grouped GEMM config must be (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, "
                         f"num_warps, num_stages[, variant in {VARIANTS}]), got {config!r}")
    return tuple(config)


def _programs(tiles: int, t: torch.Tensor) -> int:
    return max(min(tiles, num_sms(t.get_device())) if t.is_cuda else tiles, 1)


def grouped_amax_into(x: torch.Tensor, offsets: torch.Tensor, amax: torch.Tensor, *,
                      m_splits=None) -> None:
    """See `tritium.ref.grouped_gemm.grouped_amax_into`."""
    _cast(x, offsets, amax, amax, None, False, False, True, None, None, None)


def _cast(x, offsets, scale, amax, fp8_dtype, write_data, write_t, update_amax, current,
          data, data_t, scale_inv=None):
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if m == 0 and not (write_data or write_t):
        return
    g = offsets.shape[1] - 1
    bm, bn, warps, cols = CAST_CONFIG if x.is_cuda else _INTERPRET_CAST_CONFIG
    if (m + 16) * bn >= 2 ** 31 or x.stride(0) * bm >= 2 ** 31:  # 32-bit offsets in a tile
        raise ValueError(f"grouped cast: x {tuple(x.shape)} (row stride {x.stride(0)}) is "
                         f"too large for 32-bit tile offsets; split it into fewer rows")
    eps, pow2 = current if current is not None else (0.0, False)
    dummy = amax if amax is not None else scale
    src = scale if scale is not None else amax  # the scales (or, current scaling, amaxes)
    # row tiles group by group: at most one partial tile per group beyond m's own tiles
    _launch_cast((-(-m // bm) + g, max(-(-k // (bn * cols)), 1)), x,
                 data if data is not None else dummy, data_t if data_t is not None else dummy,
                 src, src.stride(0),
                 dummy, dummy.stride(0), scale_inv if scale_inv is not None else dummy, offsets,
                 k, g, x.stride(0),
                 FP8_MAX=fp8_max(fp8_dtype) if fp8_dtype is not None else 448.0,
                 OUT_DTYPE=_TL_FP8[fp8_dtype] if fp8_dtype is not None else tl.float8e4nv,
                 WRITE_DATA=write_data, WRITE_T=write_t, UPDATE_AMAX=update_amax,
                 CURRENT=current is not None, EPS=float(eps), POW2=bool(pow2),
                 GP=next_pow2(g + 1), BLOCK_M=bm, BLOCK_N=bn, COLS=cols, num_warps=warps)


def grouped_cast_transpose(x: torch.Tensor, offsets: torch.Tensor, scale: Optional[torch.Tensor],
                           amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                           write_data: bool = True, write_transpose: bool = False,
                           current: Optional[tuple] = None, m_splits=None):
    """See `tritium.ref.grouped_gemm.grouped_cast_transpose`."""
    m, k = x.shape
    dev = x.device
    g = offsets.shape[1] - 1
    padded = 0
    if write_transpose:
        padded = (int(offsets[1, -1]) if m_splits is None
                  else sum(-(-r // 16) * 16 for r in m_splits))
    data = torch.empty(m, k, dtype=fp8_dtype, device=dev) if write_data else None
    data_t = torch.empty(k * padded, dtype=fp8_dtype, device=dev) if write_transpose else None
    scale_inv = torch.empty(g, dtype=torch.float32, device=dev)
    _cast(x, offsets, scale, amax, fp8_dtype, write_data, write_transpose,
          amax is not None and current is None, current, data, data_t, scale_inv)
    return data, data_t, scale_inv


def grouped_fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                        b_scale_inv: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None, fast_accum: bool = False, *,
                        m_splits=None, config: Optional[tuple] = None) -> torch.Tensor:
    """See `tritium.ref.grouped_gemm.grouped_fp8_gemm_tn`. Without `m_splits` the offsets
    are read back to count the tiles (a device sync)."""
    m, k = a.shape
    g, n, _ = b.shape
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    bm, bn, bk, group_m, warps, stages, variant = _config(
        config, CONFIGS["fast" if fast_accum else "precise"] if a.is_cuda else _INTERPRET_CONFIG)
    # a device-built output descriptor needs 16-byte rows (and so 16-byte group starts)
    if variant != "flat" and (n * out.element_size()) % 16 == 0:
        if m_splits is None and a.is_cuda:  # no read-back: one program per SM
            programs = num_sms(a.get_device())
        else:
            if m_splits is None:
                m_splits = offsets[0, 1:] - offsets[0, :-1]
            tiles = sum(-(-int(r) // bm) for r in m_splits) * -(-n // bn)
            programs = _programs(tiles, a)
        if a.is_cuda:
            ensure_scratch_allocator()
        _launch_gemm_tma((programs,), TensorDesc(a, (bm, bk)),
                         TensorDesc(b.view(g * n, k), (bn, bk)), out, a_scale_inv, b_scale_inv,
                         bias if bias is not None else a_scale_inv, offsets, n, k, g, programs,
                         HAS_BIAS=bias is not None, PRECISE=not fast_accum,
                         SPLIT_STORE=out.element_size() == 4, FLATTEN=variant == "tma_flat",
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps,
                         num_stages=stages)
        return out
    if m_splits is None:
        m_splits = [int(v) for v in (offsets[0, 1:] - offsets[0, :-1]).tolist()]
    tiles = sum(-(-r // bm) for r in m_splits) * -(-n // bn)
    programs = _programs(tiles, a)
    _launch_gemm((programs,), TensorDesc(a, (bm, bk)), TensorDesc(b.view(g * n, k), (bn, bk)),
                 out, a_scale_inv, b_scale_inv, bias if bias is not None else a_scale_inv,
                 offsets, n, k, g, tiles, programs, HAS_BIAS=bias is not None,
                 PRECISE=not fast_accum, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                 num_warps=warps, num_stages=stages)
    return out


def grouped_fp8_gemm_wgrad(a_t: torch.Tensor, b_t: torch.Tensor, a_scale_inv: torch.Tensor,
                           b_scale_inv: torch.Tensor, offsets: torch.Tensor, n: int, k: int,
                           out_dtype: torch.dtype, *, m_splits=None,
                           config: Optional[tuple] = None) -> torch.Tensor:
    """See `tritium.ref.grouped_gemm.grouped_fp8_gemm_wgrad` (m_splits: unused, the kernel reads
    the offsets on the device)."""
    g = offsets.shape[1] - 1
    out = torch.empty(g, n, k, dtype=out_dtype, device=a_t.device)
    bm, bn, bk, group_m, warps, stages, variant = _config(
        config, CONFIGS["wgrad"] if a_t.is_cuda else _INTERPRET_CONFIG)
    tiles = g * -(-n // bm) * -(-k // bn)
    programs = _programs(tiles, a_t)
    esize = out.element_size()
    # device-built descriptors: 16-byte output rows and 16-byte group starts in `out`
    if variant != "flat" and (k * esize) % 16 == 0 and (n * k * esize) % 16 == 0:
        if a_t.is_cuda:
            ensure_scratch_allocator()
        _launch_wgrad_tma((programs,), a_t, b_t, out, a_scale_inv, b_scale_inv, offsets, n, k,
                          g, programs, PRECISE=True, SPLIT_STORE=esize == 4,
                          FLATTEN=variant == "tma_flat", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          GROUP_M=group_m, num_warps=warps, num_stages=stages)
        return out
    _launch_wgrad((programs,), a_t, b_t, out, a_scale_inv, b_scale_inv, offsets, n, k, g,
                  programs, PRECISE=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                  num_warps=warps, num_stages=stages)
    return out


__all__ = ["grouped_amax_into", "grouped_cast_transpose", "grouped_fp8_gemm_tn",
           "grouped_fp8_gemm_wgrad", "CONFIGS", "VARIANTS"]
