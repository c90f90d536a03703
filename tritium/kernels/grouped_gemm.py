"""Triton kernels of GroupedLinear under FP8: one grouped cast and two grouped GEMMs.

Twins: `tritium.ref.grouped_gemm` (same names and signatures; its docstring has the layouts:
`offsets` int32 [2, G+1] with the real and the 16-padded cumulative row counts, each group's
transpose a [K, pm_g] block of one flat buffer).

* `grouped_cast_transpose`: every group's rows cast with that group's scale (per-expert scales,
  as TE's GroupedLinear has), amax max-accumulated per group, transposed blocks written in the
  same pass, in ONE launch for all groups. Each row finds its group by counting the offsets it
  has passed; a tile that spans a group boundary does one atomic max per group it touches.
* `grouped_fp8_gemm_tn` (fprop and dgrad): out[rows of g] = a[rows of g] @ b[g].T, scaled by the
  group's two scale_invs (+ the group's bias). One persistent launch walks all groups' tiles
  (group by group, GROUP_M-swizzled inside a group for L2 reuse); a program finds its tile's
  group by a scan over the G offsets (a few scalar loads). a and b are read through TMA
  descriptors (rows past a group's end belong to the next group or are TMA's zero fill: they
  are computed and never stored); the output is stored with a row mask, so m_g needs no
  padding, and an empty group has no tiles.
* `grouped_fp8_gemm_wgrad`: out[g] = A_g @ B_g.T with the reduction over the group's rows, from
  the transposed blocks. Pointer loads (a TMA box cannot stop at a group boundary inside one
  tensor): the whole K tiles unmasked along K, with rows 16-byte aligned by the padded layout,
  so they are vector loads and the loop is cp.async-pipelined (checked in the sm_90 build); the
  group's last partial tile is one masked step. An empty group gets zeros.
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
from ._launch import Launcher, TensorDesc, next_pow2, num_sms
from .cast import _TL_FP8, _current_scale, _scaled_fp8


@triton.jit
def _group_of(rows, offs_ptr, G, GP: tl.constexpr):
    """The group of each row: how many group starts it has passed (empty groups skipped)."""
    j = tl.arange(0, GP)
    starts = tl.load(offs_ptr + j, mask=j <= G, other=2147483647)
    g = tl.sum((rows[:, None] >= starts[None, :]).to(tl.int32), axis=1) - 1
    return tl.minimum(tl.maximum(g, 0), G - 1)


@triton.jit
def _grouped_cast_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, scale_stride, amax_ptr,
                         amax_stride, scale_inv_ptr, offs_ptr, M, K, G, stride_xm,
                         FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                         WRITE_DATA: tl.constexpr, WRITE_T: tl.constexpr,
                         UPDATE_AMAX: tl.constexpr, CURRENT: tl.constexpr, EPS: tl.constexpr,
                         POW2: tl.constexpr, GP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    row_ok = rm < M
    g = _group_of(rm, offs_ptr, G, GP)
    if CURRENT:
        scale = _current_scale(tl.load(amax_ptr + g * amax_stride), FP8_MAX, EPS, POW2)
    else:
        scale = tl.load(scale_ptr + g * scale_stride)
    if WRITE_DATA or UPDATE_AMAX:
        mask = row_ok[:, None] & (rn[None, :] < K)
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rn[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if WRITE_DATA:
            tl.store(data_ptr + rm64[:, None] * K + rn[None, :],
                     _scaled_fp8(x, scale[:, None], mask, FP8_MAX, OUT_DTYPE), mask=mask)
        if UPDATE_AMAX:
            row_max = tl.max(tl.abs(x), axis=1)
            row_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
            g_lo = tl.min(tl.where(row_ok, g, G))
            g_hi = tl.max(tl.where(row_ok, g, -1))
            for gg in range(g_lo, g_hi + 1):
                sel = row_ok & (g == gg)
                m = tl.max(tl.where(sel, row_max, 0.0))
                has_nan = tl.max((sel & row_nan).to(tl.int32)) > 0
                tl.atomic_max(amax_ptr + gg * amax_stride, tl.where(has_nan, float("nan"), m))
    if WRITE_T:
        # the tile read again transposed (see tritium.kernels.cast on tl.trans)
        mask_t = (rn[:, None] < K) & row_ok[None, :]
        xt = tl.load(x_ptr + rm64[None, :] * stride_xm + rn[:, None], mask=mask_t, other=0.0)
        xt = xt.to(tl.float32)
        r0 = tl.load(offs_ptr + g)
        p0 = tl.load(offs_ptr + G + 1 + g)
        pm = tl.load(offs_ptr + G + 2 + g) - p0
        dst = (K * p0.to(tl.int64))[None, :] + rn.to(tl.int64)[:, None] * pm[None, :] \
            + (rm - r0)[None, :]
        tl.store(data_t_ptr + dst, _scaled_fp8(xt, scale[None, :], mask_t, FP8_MAX, OUT_DTYPE),
                 mask=mask_t)
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
        per_group = GROUP_M * tiles_n
        first_m = (local // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        off_m = (first_m + local % group_m) * BLOCK_M
        off_n = ((local % per_group) // group_m) * BLOCK_N
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
        per_group = GROUP_M * tiles_n
        first_m = (local // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        off_m = (first_m + local % group_m) * BLOCK_M
        off_n = ((local % per_group) // group_m) * BLOCK_N
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


_launch_cast = Launcher(_grouped_cast_kernel)
_launch_gemm = Launcher(_grouped_gemm_kernel)
_launch_wgrad = Launcher(_grouped_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the single GEMM's tiles
# (tritium.kernels.gemm.CONFIGS) for fprop / dgrad; wgrad's pointer loads take 128x128.
CONFIGS = {"fast": (128, 256, 128, 8, 8, 3), "precise": (256, 128, 128, 8, 8, 3),
           "wgrad": (128, 128, 128, 8, 8, 3)}
_INTERPRET_CONFIG = (16, 16, 32, 2, 1, 1)


def _programs(tiles: int, t: torch.Tensor) -> int:
    return max(min(tiles, num_sms(t.get_device())) if t.is_cuda else tiles, 1)


def grouped_amax_into(x: torch.Tensor, offsets: torch.Tensor, amax: torch.Tensor) -> None:
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
    bm, bn, warps = (16, 16, 1) if not x.is_cuda else (64, 128, 8)
    eps, pow2 = current if current is not None else (0.0, False)
    dummy = amax if amax is not None else scale
    src = scale if scale is not None else amax  # the scales (or, current scaling, amaxes)
    _launch_cast((max(-(-m // bm), 1), max(-(-k // bn), 1)), x,
                 data if data is not None else dummy, data_t if data_t is not None else dummy,
                 src, src.stride(0),
                 dummy, dummy.stride(0), scale_inv if scale_inv is not None else dummy, offsets,
                 m, k, g, x.stride(0),
                 FP8_MAX=fp8_max(fp8_dtype) if fp8_dtype is not None else 448.0,
                 OUT_DTYPE=_TL_FP8[fp8_dtype] if fp8_dtype is not None else tl.float8e4nv,
                 WRITE_DATA=write_data, WRITE_T=write_t, UPDATE_AMAX=update_amax,
                 CURRENT=current is not None, EPS=float(eps), POW2=bool(pow2),
                 GP=next_pow2(g + 1), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)


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
    if config is None:
        config = CONFIGS["fast" if fast_accum else "precise"] if a.is_cuda else _INTERPRET_CONFIG
    bm, bn, bk, group_m, warps, stages = config
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
                           out_dtype: torch.dtype, *,
                           config: Optional[tuple] = None) -> torch.Tensor:
    """See `tritium.ref.grouped_gemm.grouped_fp8_gemm_wgrad`."""
    g = offsets.shape[1] - 1
    out = torch.empty(g, n, k, dtype=out_dtype, device=a_t.device)
    if config is None:
        config = CONFIGS["wgrad"] if a_t.is_cuda else _INTERPRET_CONFIG
    bm, bn, bk, group_m, warps, stages = config
    tiles = g * -(-n // bm) * -(-k // bn)
    programs = _programs(tiles, a_t)
    _launch_wgrad((programs,), a_t, b_t, out, a_scale_inv, b_scale_inv, offsets, n, k, g,
                  programs, PRECISE=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                  num_warps=warps, num_stages=stages)
    return out


__all__ = ["grouped_amax_into", "grouped_cast_transpose", "grouped_fp8_gemm_tn",
           "grouped_fp8_gemm_wgrad", "CONFIGS"]
