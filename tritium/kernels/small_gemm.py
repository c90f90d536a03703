"""Triton FP8 GEMMs of a small Linear, one launch each: where a layer's GEMMs take a few
microseconds of GPU time (at most `tritium.ops.gemm.HOST_BOUND_MACS` multiply-adds each), the
host's time per launch is the step's cost, so casts and GEMMs share launches here.

The backward: `fp8_gemm_tn_pair` runs two independent GEMMs (dgrad and wgrad) on one
persistent grid, the first's tiles then the second's, each in its own branch of the kernel with
shared memory of its own (hence PAIR_CONFIG's smaller tiles and two stages); `fp8_dgrad_wgrad`
does the same from the high-precision grad under delayed scaling, casting dy in registers as
each A tile is loaded (amax recorded once per element) and summing dbias from the same tiles.
The forward: `fp8_gemm_tn_cast_b` casts the high-precision weight in registers as each B tile
is loaded (amax, scale_inv and the fp8 transpose dgrad needs written by the first row of
tiles). Twins: `tritium.ref.gemm.fp8_gemm_tn_pair` / `fp8_dgrad_wgrad` / `fp8_gemm_tn_cast_b`.
Under current scaling (`current=(amax_epsilon, power_2_scale)`) the same kernels run after one
launch that measures the high-precision operands' amaxes (`kernels.cast.amax_into`, or
`amax_pair_into` for both of the forward's), and derive the scales from them in-kernel.

Numerics: every cast is `tritium.kernels.cast`'s arithmetic on the same values (`_scaled_fp8`,
`_abs_max_nan`, scale_inv by `div_rn`), so the fp8 operands, amaxes and scale_invs are the
bits the separate cast kernels write; the products are those of `tritium.kernels.gemm` in the
same accumulation mode (BLOCK_K 128 in precise mode: promotion every 128 of K), so an eager
step (these launches) and a compiled one (the ops one by one) keep the same FP8 state.
Layouts: fp8 operands through TMA descriptors (`TensorDesc`), high-precision ones through
pointers with a contiguous last dim (any row stride).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher, TensorDesc, num_sms
from .cast import _TL_FP8, _abs_max_nan, _current_scale, _scaled_fp8, amax_into, amax_pair_into
from .gemm import _INTERPRET_CONFIG, _store_tile, _tile_product, tile_offsets


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
                            CURRENT: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                            SPLIT_DX: tl.constexpr, SPLIT_DW: tl.constexpr,
                            HAS_DBIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """A Linear's backward GEMMs from its high-precision grad dy [T, N] under delayed scaling:
    dx = fp8(dy) @ w (w_t [K_IN, N]) and dw = fp8(dy)^T @ x (x_t [K_IN, T_PADDED]), dy cast
    in registers as each A tile is loaded (no fp8 copy of dy in memory), its amax recorded
    by dx's first column of tiles (each element of dy once). Precise accumulation.
    HAS_DBIAS: dbias = dy.sum(0), summed in fp32 from dy's tiles by dw's first column of
    tiles (each walks all of T for its rows of dy^T) and rounded once. CURRENT
    (Float8CurrentScaling): dy_amax holds max|dy| already, the scale is derived from it as
    the cast kernel derives it, and nothing is recorded."""
    if CURRENT:
        scale = _current_scale(tl.load(dy_amax_ptr), FP8_MAX, EPS, POW2)
    else:
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
                if off_n == 0 and not CURRENT:
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


@triton.jit
def _cast_tile(x_ptr, stride_x, R, K, off_r, ki, scale, amax_ptr, x_t_ptr, R_T, record,
               FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, WRITE_T: tl.constexpr,
               RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[off_r:, ki * BLOCK_K:] of a high-precision x [R, K] cast to fp8 (zeros outside x);
    where `record`: the tile's amax max-recorded (RECORD_AMAX) and (WRITE_T) its fp8 values
    stored transposed into x_t [K, R_T] (indices mapped, no transpose of fp8 values; columns
    R..R_T get zeros)."""
    rr = off_r + tl.arange(0, BLOCK_R)
    rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
    valid = (rr[:, None] < R) & (rk[None, :] < K)
    x = tl.load(x_ptr + rr[:, None].to(tl.int64) * stride_x + rk[None, :], mask=valid,
                other=0.0).to(tl.float32)
    x8 = _scaled_fp8(x, scale, valid, FP8_MAX, FP8_DTYPE)
    if record:
        if RECORD_AMAX:
            tl.atomic_max(amax_ptr, _abs_max_nan(x))
        if WRITE_T:
            tl.store(x_t_ptr + rk[None, :].to(tl.int64) * R_T + rr[:, None], x8,
                     mask=(rr[:, None] < R_T) & (rk[None, :] < K))
    return x8


@triton.jit
def _fp8_gemm_tn_cast_kernel(a_ptr, a_scale_ptr, a_amax_ptr, a_t_ptr, a_scale_inv_ptr,
                             b_ptr, b_scale_ptr, b_amax_ptr, b_t_ptr, b_scale_inv_ptr, c_desc,
                             bias_ptr, M, N, K, M_T, stride_a, stride_b, num_programs,
                             FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr,
                             CURRENT: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                             A_HP: tl.constexpr, WRITE_A_T: tl.constexpr,
                             WRITE_B_T: tl.constexpr, HAS_BIAS: tl.constexpr,
                             SPLIT_STORE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    """A small Linear's forward GEMM under delayed scaling, its weight b [N, K] in high
    precision: each B tile cast in registers as it is loaded, b's amax recorded and
    (WRITE_B_T) its fp8 transpose b_t [K, N] written by the first row of tiles (each element
    of b once), its scale_inv by program 0; out = a @ fp8(b).T * scales (+ bias), fast
    accumulation. a [M, K]: fp8 with its scale_inv given (a_scale_inv_ptr), or (A_HP) high
    precision, cast the same way with its scale (a_scale_ptr) by the first column of tiles,
    a_t [K, M_T] (WRITE_A_T) and its scale_inv written. CURRENT (Float8CurrentScaling): the
    amax pointers hold the operands' amaxes already, the scales are derived from them as the
    cast kernel derives them, and no amax is recorded."""
    if CURRENT:
        b_scale = _current_scale(tl.load(b_amax_ptr), FP8_MAX, EPS, POW2)
    else:
        b_scale = tl.load(b_scale_ptr)
    b_scale_inv = tl.math.div_rn(1.0, b_scale)  # what the cast kernel would write
    if A_HP:
        if CURRENT:
            a_scale = _current_scale(tl.load(a_amax_ptr), FP8_MAX, EPS, POW2)
        else:
            a_scale = tl.load(a_scale_ptr)
        a_scale_inv = tl.math.div_rn(1.0, a_scale)
        if tl.program_id(0) == 0:
            tl.store(a_scale_inv_ptr, a_scale_inv)
    else:
        a_scale = 1.0
        a_scale_inv = tl.load(a_scale_inv_ptr)
    if tl.program_id(0) == 0:
        tl.store(b_scale_inv_ptr, b_scale_inv)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs):
        off_m, off_n = tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            b8 = _cast_tile(b_ptr, stride_b, N, K, off_n, ki, b_scale, b_amax_ptr, b_t_ptr, N,
                            off_m == 0, FP8_MAX, FP8_DTYPE, WRITE_B_T, not CURRENT, BLOCK_N,
                            BLOCK_K)
            if A_HP:
                a8 = _cast_tile(a_ptr, stride_a, M, K, off_m, ki, a_scale, a_amax_ptr, a_t_ptr,
                                M_T, off_n == 0, FP8_MAX, FP8_DTYPE, WRITE_A_T, not CURRENT,
                                BLOCK_M, BLOCK_K)
            else:
                rm = off_m + tl.arange(0, BLOCK_M)
                rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                a8 = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_a + rk[None, :],
                             mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc = tl.dot(a8, b8.T, acc)
        c = acc * (a_scale_inv * b_scale_inv)
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            c += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        _store_tile(c_desc, c, off_m, off_n, SPLIT_STORE, BLOCK_M, BLOCK_N)


_launch_gemm_pair = Launcher(_fp8_gemm_tn_pair_kernel)
_launch_dgrad_wgrad = Launcher(_fp8_dgrad_wgrad_kernel)
_launch_gemm_cast = Launcher(_fp8_gemm_tn_cast_kernel)

# The pair kernels stage each GEMM's operands in shared memory of their own (two branches),
# and their GEMMs are small (the rule's): smaller tiles, more of them on the SMs, two stages.
# BLOCK_K stays 128, CONFIGS[False]'s: precise accumulation promotes every BLOCK_K of K, so
# the products equal the one-GEMM kernel's bit for bit (eager and compiled steps agree).
PAIR_CONFIG = (128, 128, 128, 8, 4, 2)
# Casting in registers holds 16-bit operand tiles beside the accumulator: 128 x 128 tiles.
CAST_CONFIG = (128, 128, 128, 8, 8, 2)


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


def _measured(x: torch.Tensor) -> torch.Tensor:
    """Current scaling: max|x| measured now, a [1] fp32 tensor (`kernels.cast.amax_into`)."""
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    amax_into(x, amax)
    return amax


def _current_constexprs(current: Optional[tuple]) -> dict:
    eps, pow2 = current if current is not None else (0.0, False)
    return dict(CURRENT=current is not None, EPS=float(eps), POW2=bool(pow2))


def fp8_dgrad_wgrad(dy: torch.Tensor, dy_scale: Optional[torch.Tensor],
                    dy_amax: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                    w_t: torch.Tensor, w_scale_inv: torch.Tensor, x_t: torch.Tensor,
                    x_scale_inv: torch.Tensor, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                    dbias_dtype: Optional[torch.dtype] = None,
                    current: Optional[tuple] = None) -> tuple:
    """See `tritium.ref.gemm.fp8_dgrad_wgrad`: the cast of dy and both GEMMs (and dbias),
    one launch (under current scaling, after the launch that measures dy's amax)."""
    if current is not None:
        dy_amax = _measured(dy)
        dy_scale = dy_amax  # unread
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
        programs, FP8_MAX=fp8_max(fp8_dtype), FP8_DTYPE=_TL_FP8[fp8_dtype],
        **_current_constexprs(current), SPLIT_DX=split_dx,
        SPLIT_DW=split_dw, HAS_DBIAS=db is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return dx, dw, db


def _gemm_cast(a, a_hp, a_scale, a_amax, a_scale_inv, write_a_t, b, b_scale, b_amax,
               fp8_dtype, out_dtype, bias, write_b_t, current) -> tuple:
    """The launch of both forms below (a_hp False: a is fp8 with its a_scale_inv; else a is
    high precision and a_scale_inv is written; under current scaling the amaxes are given,
    measured, and the scales unread): (out, a8^T or None, b8^T or None, b's scale_inv)."""
    m, k = a.shape
    n = b.shape[0]
    if current is not None:
        a_scale, b_scale = a_amax, b_amax  # unread
    bm, bn, bk, group_m, warps, stages = CAST_CONFIG if a.is_cuda else _INTERPRET_CONFIG
    dev = a.device
    out = torch.empty(m, n, dtype=out_dtype, device=dev)
    m_t = -(-m // 16) * 16  # a8^T's columns: rows padded to 16 (FP8 GEMMs need it)
    a_t = torch.empty(k, m_t, dtype=fp8_dtype, device=dev) if a_hp and write_a_t else None
    b_t = torch.empty(k, n, dtype=fp8_dtype, device=dev) if write_b_t else None
    b_scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    split = out.element_size() == 4
    tiles = -(-m // bm) * -(-n // bn)
    programs = min(tiles, num_sms(a.get_device())) if a.is_cuda else tiles
    unused_t = b_t if b_t is not None else a_t if a_t is not None else out  # never written
    _launch_gemm_cast(
        (programs,), a, a_scale if a_hp else a_scale_inv, a_amax if a_hp else a_scale_inv,
        a_t if a_t is not None else unused_t, a_scale_inv, b, b_scale, b_amax,
        b_t if b_t is not None else unused_t, b_scale_inv,
        TensorDesc(out, (bm, bn // 2 if split else bn)),
        bias if bias is not None else b_scale, m, n, k, m_t, a.stride(0), b.stride(0), programs,
        FP8_MAX=fp8_max(fp8_dtype), FP8_DTYPE=_TL_FP8[fp8_dtype],
        **_current_constexprs(current), A_HP=a_hp,
        WRITE_A_T=a_t is not None, WRITE_B_T=write_b_t, HAS_BIAS=bias is not None,
        SPLIT_STORE=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        num_warps=warps, num_stages=stages)
    return out, a_t, b_t, b_scale_inv


def fp8_gemm_tn_cast_b(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                       b_scale: Optional[torch.Tensor], b_amax: Optional[torch.Tensor],
                       fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None, write_b_t: bool = True,
                       current: Optional[tuple] = None) -> tuple:
    """See `tritium.ref.gemm.fp8_gemm_tn_cast_b`: b's cast and the GEMM, one launch (under
    current scaling, after the launch that measures b's amax)."""
    if current is not None:
        b_amax = _measured(b)
    out, _, b_t, b_scale_inv = _gemm_cast(a, False, None, a_scale_inv, a_scale_inv, False, b,
                                          b_scale, b_amax, fp8_dtype, out_dtype, bias,
                                          write_b_t, current)
    return out, b_t, b_scale_inv


def fp8_gemm_tn_cast_ab(a: torch.Tensor, a_scale: Optional[torch.Tensor],
                        a_amax: Optional[torch.Tensor], b: torch.Tensor,
                        b_scale: Optional[torch.Tensor], b_amax: Optional[torch.Tensor],
                        fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None, write_a_t: bool = True,
                        write_b_t: bool = True, current: Optional[tuple] = None) -> tuple:
    """See `tritium.ref.gemm.fp8_gemm_tn_cast_ab`: both casts and the GEMM, one launch (under
    current scaling, after one launch that measures both amaxes)."""
    if current is not None:
        amaxes = torch.zeros(2, dtype=torch.float32, device=a.device)
        amax_pair_into(a, b, amaxes)
        a_amax, b_amax = amaxes[0:1], amaxes[1:2]
    a_scale_inv = torch.empty(1, dtype=torch.float32, device=a.device)
    out, a_t, b_t, b_scale_inv = _gemm_cast(a, True, a_scale, a_amax, a_scale_inv, write_a_t,
                                            b, b_scale, b_amax, fp8_dtype, out_dtype, bias,
                                            write_b_t, current)
    return out, a_t, a_scale_inv, b_t, b_scale_inv


__all__ = ["fp8_gemm_tn_pair", "fp8_dgrad_wgrad", "fp8_gemm_tn_cast_b", "fp8_gemm_tn_cast_ab",
           "PAIR_CONFIG", "CAST_CONFIG"]
