"""Triton LayerNorm and RMSNorm, forward and backward.

Twins: `tritium.ref.norm` (same names and signatures; its docstring states the math). The two
agree to a few fp32 ulps, not bit for bit (reduction order differs).

Layout assumptions: x and dy are 2D [rows, hidden] with a contiguous last dim (any row stride;
anything else is made contiguous); y and dx are fresh contiguous tensors; weight and bias are
contiguous [hidden]. One kernel serves both norms (IS_RMS is a constexpr), so LayerNorm and
RMSNorm share every line but the mean.

Forward (`_norm_fwd_kernel`): one program normalizes a tile of BLOCK_ROWS whole rows
[BLOCK_ROWS, BLOCK_N], BLOCK_N = next_power_of_2(hidden): x is read once and y written once, and
the per-row mean and rstd (fp32) are saved for the backward. Small hidden sizes take several rows
per program so that every program moves a few KiB; num_warps grows with the tile (`_tile`).

Backward (`_norm_bwd_kernel`): a persistent grid of G = min(row tiles, 2 x SMs) programs;
program p handles row tiles p, p+G, p+2G, ... For each tile it reads x, dy, mean and rstd once
and writes dx once, and adds dy * xhat (and dy) elementwise into fp32 accumulators shaped like
the tile, in registers. After the loop each program sums its accumulator over rows and writes
it to its own row of an fp32 [G, hidden] buffer (no atomics, no races); `_partial_sum_kernel`
then sums the G rows of each column in fp32 and writes dweight (and dbias) in the weight's
dtype. Deterministic, run to run. Each buffer adds 8*G*hidden bytes of traffic (written, read:
about 2% of a 16384x4096 bf16 backward on 132 SMs).

Norm + FP8 cast: `tritium.kernels.norm_cast` runs the same forward tile (`_norm_fwd_tile`, same
BLOCK_ROWS/BLOCK_N/num_warps from `_tile`) and writes the next GEMM's fp8 input directly.
`tritium.kernels.norm_block_cast` does the same for Float8BlockScaling's 1x128 blocks.

Limits: the whole row lives in registers, so hidden <= MAX_HIDDEN (65536); `tritium.functional`
sends longer rows to the PyTorch twin. ptxas (sm_90, bf16) reports no spills up to hidden 8192
and spills in the backward from 12288 on (BLOCK_N 16384; 32 warps keep them smaller): correct
but slower. A column-looped backward for very wide rows is not written.

Numerics: mean = sum/H and rstd = 1/sqrt(var + eps) use IEEE-rounded division and square root
(div_rn, sqrt_rn), as the twin's torch ops do; everything is fp32 until the single rounding of
y and dx to x.dtype (and of dweight/dbias to the weight's dtype).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2, num_sms

MAX_HIDDEN = 65536
_TILE = 4096                # elements per forward/backward tile when hidden is small
_BWD_PROGRAMS_PER_SM = 2    # persistent backward grid: G = programs per SM x SMs
_BWD_PREFETCH = True        # backward loads tile t + G while tile t computes
_SUM_BLOCK_G, _SUM_BLOCK_N = 64, 32   # 128 programs at hidden 4096, rows of 128 bytes


@triton.jit
def _norm_fwd_tile(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, rows, N, n, stride_x, eps,
                   IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """y (fp32, not yet rounded) of the whole rows `r`, storing their mean and rstd. Shared by
    the plain forward and the norm + FP8 cast forward (`tritium.kernels.norm_cast`): with the
    same tile shape and num_warps both compile to the same reductions, hence the same bits."""
    c = tl.arange(0, BLOCK_N)
    rmask, cmask = r < rows, c < N
    mask = rmask[:, None] & cmask[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), n)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + r, mean, mask=rmask)
    var = tl.math.div_rn(tl.sum(xc * xc, axis=1), n)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    tl.store(rstd_ptr + r, rstd, mask=rmask)

    gamma = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    y = (xc * rstd[:, None]) * gamma[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y, mask, r64, c


@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                     rows, N, n, stride_x, eps,  # n: N as an fp32 value
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    y, mask, r64, c = _norm_fwd_tile(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, r, rows, N, n,
                                     stride_x, eps, IS_RMS, HAS_BIAS, ZERO_CENTERED, BLOCK_N)
    tl.store(y_ptr + r64[:, None] * N + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, tile, rows, stride_dy, stride_x, c, cmask,
                   IS_RMS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """One row tile's x, dy (fp32), rstd and mean ([BLOCK_ROWS, 1]; rows past the end read 0)."""
    r = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = r < rows
    mask = rmask[:, None] & cmask[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + r64[:, None] * stride_dy + c[None, :], mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + r, mask=rmask, other=0.0)[:, None]
    if IS_RMS:
        mean = rstd  # unused
    else:
        mean = tl.load(mean_ptr + r, mask=rmask, other=0.0)[:, None]
    return x.to(tl.float32), dy.to(tl.float32), rstd, mean


@triton.jit
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr,
                     rows, N, n, stride_dy, stride_x,
                     IS_RMS: tl.constexpr, HAS_DB: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < N
    gamma = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    # Accumulators shaped like the tile: the loop only adds elementwise; rows are summed once,
    # after it (a per-tile column sum would move data between threads on every iteration).
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # the next tile's loads are in flight while this tile reduces and stores
        nx, ndy, nrstd, nmean = _norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, pid, rows,
                                               stride_dy, stride_x, c, cmask, IS_RMS, BLOCK_ROWS)
    for tile in range(pid, tl.cdiv(rows, BLOCK_ROWS), num_progs):
        if PREFETCH:
            x, dy, rstd, mean = nx, ndy, nrstd, nmean
            nx, ndy, nrstd, nmean = _norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr,
                                                   tile + num_progs, rows, stride_dy, stride_x,
                                                   c, cmask, IS_RMS, BLOCK_ROWS)
        else:
            x, dy, rstd, mean = _norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, tile, rows,
                                               stride_dy, stride_x, c, cmask, IS_RMS, BLOCK_ROWS)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = (x - mean) * rstd
        # Masked places: dy = 0 there, so they add nothing to any sum below.
        g = dy * gamma[None, :]
        c1 = tl.math.div_rn(tl.sum(xhat * g, axis=1), n)[:, None]
        if IS_RMS:
            dx = (g - xhat * c1) * rstd
        else:
            c2 = tl.math.div_rn(tl.sum(g, axis=1), n)[:, None]
            dx = (g - (xhat * c1 + c2)) * rstd
        r = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (r < rows)[:, None] & cmask[None, :]
        tl.store(dx_ptr + r.to(tl.int64)[:, None] * N + c[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_DB:
            db_acc += dy
    part = pid.to(tl.int64) * N + c  # dweight's partial sums, then (HAS_DB) dbias's
    tl.store(part_ptr + part, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_DB:
        tl.store(part_ptr + num_progs.to(tl.int64) * N + part, tl.sum(db_acc, axis=0),
                 mask=cmask)


@triton.jit
def _partial_sum_kernel(part_ptr, dw_ptr, db_ptr, G, N,
                        HAS_DB: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[c] = sum_g part[0, g, c] (and db[c] = sum_g part[1, g, c]), in fp32, stored in the
    output's dtype."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = c < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        offs = g.to(tl.int64)[:, None] * N + c[None, :]
        mask = (g[:, None] < G) & cmask[None, :]
        dw += tl.sum(tl.load(part_ptr + offs, mask=mask, other=0.0), axis=0)
        if HAS_DB:
            db += tl.sum(tl.load(part_ptr + G * N + offs, mask=mask, other=0.0), axis=0)
    tl.store(dw_ptr + c, dw.to(dw_ptr.dtype.element_ty), mask=cmask)
    if HAS_DB:
        tl.store(db_ptr + c, db.to(db_ptr.dtype.element_ty), mask=cmask)


_launch_fwd = Launcher(_norm_fwd_kernel)
_launch_bwd = Launcher(_norm_bwd_kernel)
_launch_sum = Launcher(_partial_sum_kernel)


@functools.lru_cache(maxsize=None)
def _tile(n: int, interpret: bool, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps) for rows of n elements.

    A tile holds whole rows and at least _TILE elements where rows are short (at most 16 rows);
    num_warps keeps about 16 elements per thread: 4 warps up to 2048 elements, 8 at 4096, 16
    from 8192 on, and 32 where 16 would spill many registers (ptxas for sm_90: the backward
    from BLOCK_N 16384 on, the forward at 65536). Under the interpreter: 2-row tiles, so that
    tiny tests cross tile edges."""
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} > {MAX_HIDDEN}: the Triton norm kernels keep a whole "
                         "row in registers; use the PyTorch twin (tritium.ref.norm)")
    block_n = next_pow2(n)
    if interpret:
        return 2, block_n, 1
    block_rows = max(1, min(16, _TILE // block_n))
    warps = min(16, max(4, block_rows * block_n // 512))
    if block_n >= (16384 if backward else 65536):
        warps = 32
    return block_rows, block_n, warps


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd(x, weight, bias, eps, zero_centered_gamma, is_rms):
    x, weight = _rows_contiguous(x), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    mean = rstd if is_rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_rows, block_n, warps = _tile(n, not x.is_cuda)
        _launch_fwd(((rows + block_rows - 1) // block_rows,),
                    x, weight, bias if bias is not None else weight, y, mean, rstd, rows, n,
                    float(n), x.stride(0), float(eps),
                    IS_RMS=is_rms, HAS_BIAS=bias is not None,
                    ZERO_CENTERED=bool(zero_centered_gamma),
                    BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=warps)
    return y, mean, rstd


def _bwd(dy, x, weight, mean, rstd, zero_centered_gamma, is_rms, need_bias_grad):
    dy, x, weight = _rows_contiguous(dy), _rows_contiguous(x), weight.contiguous()
    rows, n = x.shape
    dev = x.device
    dx = torch.empty((rows, n), dtype=x.dtype, device=dev)
    dw = torch.empty(n, dtype=weight.dtype, device=dev)
    db = torch.empty(n, dtype=weight.dtype, device=dev) if need_bias_grad else None
    if rows == 0:
        dw.zero_()
        return dx, dw, db.zero_() if db is not None else None
    block_rows, block_n, warps = _tile(n, not x.is_cuda, backward=True)
    tiles = (rows + block_rows - 1) // block_rows
    if x.is_cuda:
        index = x.get_device()
        programs = min(tiles, _BWD_PROGRAMS_PER_SM * num_sms(index))
    else:
        programs = min(tiles, 3)  # interpreter: a few programs that each loop over tiles
    # dweight's per-program partial sums, then dbias's: one buffer, one allocation
    parts = torch.empty(((2 if db is not None else 1) * programs, n), dtype=torch.float32,
                        device=dev)
    _launch_bwd((programs,), dy, x, weight, rstd if is_rms else mean, rstd, dx, parts,
                rows, n, float(n), dy.stride(0), x.stride(0),
                IS_RMS=is_rms, HAS_DB=db is not None, ZERO_CENTERED=bool(zero_centered_gamma),
                BLOCK_ROWS=block_rows, BLOCK_N=block_n, PREFETCH=_BWD_PREFETCH, num_warps=warps)
    _launch_sum(((n + _SUM_BLOCK_N - 1) // _SUM_BLOCK_N,), parts, dw,
                db if db is not None else dw, programs, n,
                HAS_DB=db is not None, BLOCK_G=_SUM_BLOCK_G, BLOCK_N=_SUM_BLOCK_N,
                num_warps=4)
    return dx, dw, db


def layernorm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  eps: float, zero_centered_gamma: bool):
    """See `tritium.ref.norm.layernorm_fwd`."""
    return _fwd(x, weight, bias, eps, zero_centered_gamma, is_rms=False)


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                  rstd: torch.Tensor, zero_centered_gamma: bool, need_bias_grad: bool = True):
    """See `tritium.ref.norm.layernorm_bwd`."""
    return _bwd(dy, x, weight, mean, rstd, zero_centered_gamma, False, need_bias_grad)


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
    """See `tritium.ref.norm.rmsnorm_fwd`."""
    y, _, rstd = _fwd(x, weight, None, eps, zero_centered_gamma, is_rms=True)
    return y, rstd


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                zero_centered_gamma: bool):
    """See `tritium.ref.norm.rmsnorm_bwd`."""
    dx, dw, _ = _bwd(dy, x, weight, None, rstd, zero_centered_gamma, True, False)
    return dx, dw


__all__ = ["MAX_HIDDEN", "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd"]
