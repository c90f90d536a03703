"""Triton FP8 casts: cast + amax, cast + transpose + amax in one pass, amax alone (of one tensor,
or of two in one launch), dequantize, and the transpose of data already in FP8
(`transpose_fp8`: FSDP2 gathers a weight's FP8 bytes and dgrad needs them K-major; torch's
strided 1-byte copy runs at a few percent of bandwidth).

Twins: `tritium.ref.cast` (same names, same signatures, same bits). Layout assumptions: the input
is a 2D tensor whose last dim is contiguous; outputs are fresh contiguous tensors, rows padded
with zeros to a multiple of `pad_rows_to` (FP8 GEMMs need both dims divisible by 16).

Numerics, identical to the twin: scale in fp32, clamp to +-fp8_max keeping NaN, round to nearest
even; amax = max|x| of the unscaled input with NaN winning (the float atomic max of Triton orders
NaN above inf), max-accumulated into `amax`; scale_inv = 1/scale by IEEE division (div_rn, never
the approximate reciprocal). The scale is read from device memory, so nothing syncs the host.
With `current=(eps, power_2_scale)` each program derives the scale from the finished amax
(Float8CurrentScaling) instead of reading it.

`skip` (CUDA graphs with FP8 weight caching): an int32 [1] device flag; when it is non-zero every
program returns before reading or writing anything, so the caller's `out` buffers keep what an
earlier launch wrote and no amax is recorded. The flag is read on the device, so a captured
launch is a cast or a no-op depending on what the host wrote into the flag before the replay.

Not done here: tiles of block scaling, fused norms/activations (they live with their ops).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8.formats import fp8_max
from ._launch import Launcher, num_sms

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _current_scale(amax, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    eps = tl.full(amax.shape, EPS, tl.float32)  # an fp32 eps even where EPS is subnormal
    a = tl.where(amax < eps, eps, amax)
    s = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
    s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    return tl.where(bad, 1.0, s)


@triton.jit
def _nan_max(a, b):
    """A max combine (tl.reduce) that propagates NaN."""
    return tl.where((b > a) | (b != b), b, a)


@triton.jit
def _abs_max_nan(x):
    """max|x| over a block, NaN if any element is NaN (tl.max alone would drop NaN)."""
    m = tl.max(tl.abs(x))
    has_nan = tl.max((x != x).to(tl.int32)) > 0
    return tl.where(has_nan, float("nan"), m)


@triton.jit
def _bytes(ptr):
    """`ptr` read as a uint8 pointer: TRANS_T stores the fp8 bytes transposed in registers
    through it (the host passes the fp8 tensor itself: no uint8 view per launch)."""
    return ptr.to(tl.pointer_type(tl.uint8))


@triton.jit
def _scaled_fp8(x, scale, valid, FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = tl.where(valid, y, 0.0)  # padding rows stay 0 even for an inf/NaN scale (0 * inf)
    return y.to(OUT_DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _cast_one(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, N, Mp,
              stride_xm, stride_tn, pid_m, pid_n, FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
              WRITE_DATA: tl.constexpr, WRITE_T: tl.constexpr, TRANS_T: tl.constexpr,
              UPDATE_AMAX: tl.constexpr, CURRENT: tl.constexpr, EPS: tl.constexpr,
              POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of one cast: data, transpose, amax; tile (0, 0) also
    writes scale_inv. Under CURRENT, `amax_ptr` holds the finished amax the scale comes from.
    data_t's rows are stride_tn apart (Mp, or a column block of a wider buffer).
    TRANS_T (16-bit inputs): the transpose is the tile's fp8 bytes transposed in registers
    (stored through `_bytes(data_t_ptr)`); else the tile is read again with transposed indices."""
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    if CURRENT:
        scale = _current_scale(tl.load(amax_ptr), FP8_MAX, EPS, POW2)
    else:
        scale = tl.load(scale_ptr)
    if WRITE_DATA or TRANS_T:
        in_mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=in_mask, other=0.0)
        x = x.to(tl.float32)
        x8 = _scaled_fp8(x, scale, in_mask, FP8_MAX, OUT_DTYPE)
        if WRITE_DATA:
            tl.store(data_ptr + rm[:, None] * N + rn[None, :], x8,
                     mask=(rm[:, None] < Mp) & (rn[None, :] < N))
        if TRANS_T:
            tl.store(_bytes(data_t_ptr) + rn[:, None] * stride_tn + rm[None, :],
                     tl.trans(x8.to(tl.uint8, bitcast=True)),
                     mask=(rn[:, None] < N) & (rm[None, :] < Mp))
        if UPDATE_AMAX:
            tl.atomic_max(amax_ptr, _abs_max_nan(x))
    if WRITE_T and not TRANS_T:
        # fp32 inputs: the tile is read again, transposed (an L1/L2 hit after the read above),
        # instead of tl.trans of the fp8 tile: Triton 3.6 miscompiles that for fp32 inputs
        # when both layouts are written (H200, any tile shape).
        in_mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + rn[:, None], mask=in_mask_t, other=0.0)
        xt = xt.to(tl.float32)
        tl.store(data_t_ptr + rn[:, None] * stride_tn + rm[None, :],
                 _scaled_fp8(xt, scale, in_mask_t, FP8_MAX, OUT_DTYPE),
                 mask=(rn[:, None] < N) & (rm[None, :] < Mp))
        if UPDATE_AMAX and not WRITE_DATA:
            tl.atomic_max(amax_ptr, _abs_max_nan(xt))
    if UPDATE_AMAX and not WRITE_DATA and not WRITE_T:  # (TRANS_T implies WRITE_T)
        in_mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=in_mask, other=0.0)
        tl.atomic_max(amax_ptr, _abs_max_nan(x.to(tl.float32)))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _cast_transpose_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
                           skip_ptr, M, N, Mp, stride_xm, stride_tn,
                           FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                           WRITE_DATA: tl.constexpr, WRITE_T: tl.constexpr,
                           TRANS_T: tl.constexpr, UPDATE_AMAX: tl.constexpr,
                           CURRENT: tl.constexpr,
                           EPS: tl.constexpr, POW2: tl.constexpr, HAS_SKIP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:  # a cached weight on a non-first micro-batch: a no-op
            return
    _cast_one(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, N, Mp,
              stride_xm, stride_tn, tl.program_id(0), tl.program_id(1), FP8_MAX, OUT_DTYPE, WRITE_DATA,
              WRITE_T, TRANS_T, UPDATE_AMAX, CURRENT, EPS, POW2, BLOCK_M, BLOCK_N)


@triton.jit
def _cast_pair_kernel(a_ptr, a_data_ptr, a_data_t_ptr, a_scale_ptr, a_amax_ptr, a_scale_inv_ptr,
                      Ma, Na, Mpa, stride_am,
                      b_ptr, b_data_ptr, b_data_t_ptr, b_scale_ptr, b_amax_ptr, b_scale_inv_ptr,
                      Mb, Nb, Mpb, stride_bm,
                      FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      A_DATA: tl.constexpr, A_T: tl.constexpr, A_TRANS: tl.constexpr,
                      B_DATA: tl.constexpr, B_T: tl.constexpr, B_TRANS: tl.constexpr,
                      A_AMAX: tl.constexpr, B_AMAX: tl.constexpr, CURRENT: tl.constexpr,
                      EPS: tl.constexpr, POW2: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Two casts of one fp8 dtype in one launch (a GEMM's input and weight): the first
    programs do a's tiles, the rest b's, each tile exactly as `_cast_transpose_kernel`."""
    pid = tl.program_id(0)
    tiles_m_a = tl.maximum(tl.cdiv(Mpa, BLOCK_M), 1)
    tiles_a = tiles_m_a * tl.maximum(tl.cdiv(Na, BLOCK_N), 1)
    if pid < tiles_a:
        _cast_one(a_ptr, a_data_ptr, a_data_t_ptr, a_scale_ptr, a_amax_ptr, a_scale_inv_ptr,
                  Ma, Na, Mpa, stride_am, Mpa, pid % tiles_m_a, pid // tiles_m_a, FP8_MAX, OUT_DTYPE,
                  A_DATA, A_T, A_TRANS, A_AMAX, CURRENT, EPS, POW2, BLOCK_M, BLOCK_N)
    else:
        p = pid - tiles_a
        tiles_m_b = tl.maximum(tl.cdiv(Mpb, BLOCK_M), 1)
        _cast_one(b_ptr, b_data_ptr, b_data_t_ptr, b_scale_ptr, b_amax_ptr, b_scale_inv_ptr,
                  Mb, Nb, Mpb, stride_bm, Mpb, p % tiles_m_b, p // tiles_m_b, FP8_MAX, OUT_DTYPE,
                  B_DATA, B_T, B_TRANS, B_AMAX, CURRENT, EPS, POW2, BLOCK_M, BLOCK_N)


@triton.jit
def _walk_amax(x_ptr, numel, program, num_programs, BLOCK: tl.constexpr):
    """max|x| over the blocks program, program + P, ... of x[:numel] (NaN if any is NaN): an
    elementwise running max (a NaN sticks: it wins every later comparison), reduced once."""
    run = tl.zeros([BLOCK], tl.float32)
    step = num_programs * BLOCK
    for start in tl.range(program.to(tl.int64) * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32))
        run = tl.where((a > run) | (a != a), a, run)
    return _abs_max_nan(run)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, num_programs, BLOCK: tl.constexpr):
    """max|x| of x[:numel] into amax_ptr: each program walks its blocks, then does one atomic
    max (a few programs per SM instead of one tiny program, and one atomic on the same
    address, per BLOCK elements)."""
    tl.atomic_max(amax_ptr, _walk_amax(x_ptr, numel, tl.program_id(0), num_programs, BLOCK))


@triton.jit
def _amax_pair_kernel(x_ptr, x_numel, x_programs, y_ptr, y_numel, y_programs, amax_ptr,
                      BLOCK: tl.constexpr):
    """_amax_kernel of two tensors in one launch: programs 0 .. x_programs - 1 walk x into
    amax_ptr[0], the rest walk y into amax_ptr[1]."""
    pid = tl.program_id(0)
    if pid < x_programs:
        tl.atomic_max(amax_ptr, _walk_amax(x_ptr, x_numel, pid, x_programs, BLOCK))
    else:
        tl.atomic_max(amax_ptr + 1, _walk_amax(y_ptr, y_numel, pid - x_programs, y_programs,
                                               BLOCK))


@triton.jit
def _dequantize_kernel(data_ptr, scale_inv_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(data_ptr + offs, mask=mask).to(tl.float32) * tl.load(scale_inv_ptr)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst [N, M] = src [M, N] transposed; both contiguous, one byte per element."""
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(src_ptr + rm[:, None] * N + rn[None, :], mask=mask)
    tl.store(dst_ptr + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=tl.trans(mask))


_launch_cast_transpose = Launcher(_cast_transpose_kernel)
_launch_transpose = Launcher(_transpose_kernel)
_launch_cast_pair = Launcher(_cast_pair_kernel)
_launch_amax = Launcher(_amax_kernel)
_launch_amax_pair = Launcher(_amax_pair_kernel)
_launch_dequantize = Launcher(_dequantize_kernel)


def _tile(m: int, n: int, interpret: bool) -> tuple[int, int, int]:
    if interpret:
        return 16, 16, 1
    return 64, 128, 8


def _amax_grid(x: torch.Tensor) -> tuple:
    """(BLOCK, programs, num_warps) of an amax walk over x. CUDA: up to 8 programs per SM of
    4096 elements a step; the interpreter: at most 3 programs, so that the tests walk several
    blocks per program."""
    block, cap, warps = (4096, 8 * num_sms(x.get_device()), 8) if x.is_cuda else (256, 3, 1)
    return block, min(-(-x.numel() // block), cap), warps


def amax_into(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax[0] = max(amax[0], max|x|)."""
    x = x.contiguous()
    n = x.numel()
    if n == 0:
        return
    block, programs, warps = _amax_grid(x)
    _launch_amax((programs,), x, amax, n, programs, BLOCK=block, num_warps=warps)


def amax_pair_into(x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor) -> None:
    """amax_into(x, amax[0:1]) and amax_into(y, amax[1:2]), one launch (amax: [2] fp32)."""
    x, y = x.contiguous(), y.contiguous()
    if x.numel() == 0 or y.numel() == 0:  # a walk of nothing: the one that is left, alone
        for i, t in enumerate((x, y)):
            if t.numel():
                amax_into(t, amax[i:i + 1])
        return
    block, x_programs, warps = _amax_grid(x)
    y_programs = _amax_grid(y)[1]
    _launch_amax_pair((x_programs + y_programs,), x, x.numel(), x_programs, y, y.numel(),
                      y_programs, amax, BLOCK=block, num_warps=warps)


def _trans_in_registers(x: torch.Tensor, write_transpose: bool) -> bool:
    """TRANS_T: 16-bit inputs transpose the tile's fp8 bytes in registers (an H100: 1.23x the
    re-read in the fused activation cast, bits equal); fp32 inputs re-read (`_cast_one`).
    Shared with the fused activation casts (kernels/act_cast.py)."""
    return write_transpose and x.element_size() == 2


def _outputs(x, fp8_dtype, mp, n, write_data, write_transpose):
    dev = x.device
    return (torch.empty(mp, n, dtype=fp8_dtype, device=dev) if write_data else None,
            torch.empty(n, mp, dtype=fp8_dtype, device=dev) if write_transpose else None,
            torch.empty(1, dtype=torch.float32, device=dev))


def cast_transpose(x: torch.Tensor, scale: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                   fp8_dtype: torch.dtype, *, pad_rows_to: int = 1, write_data: bool = True,
                   write_transpose: bool = False, current: Optional[tuple] = None,
                   skip: Optional[torch.Tensor] = None, out: Optional[tuple] = None):
    """See `tritium.ref.cast.cast_transpose` for the contract."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    if out is not None:
        data, data_t, scale_inv = out
        data, data_t = (data if write_data else None), (data_t if write_transpose else None)
    else:
        data, data_t, scale_inv = _outputs(x, fp8_dtype, mp, n, write_data, write_transpose)
    bm, bn, warps = _tile(mp, n, not x.is_cuda)
    eps, pow2 = current if current is not None else (0.0, False)
    grid = (max(-(-mp // bm), 1), max(-(-n // bn), 1))
    trans = _trans_in_registers(x, write_transpose)
    _launch_cast_transpose(
        grid, x, data if write_data else scale_inv,
        data_t if data_t is not None else scale_inv,
        scale if current is None else amax, amax if amax is not None else scale_inv,
        scale_inv, skip if skip is not None else scale_inv, m, n, mp, x.stride(0),
        data_t.stride(0) if write_transpose else mp,
        FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype], WRITE_DATA=write_data,
        WRITE_T=write_transpose, TRANS_T=trans,
        UPDATE_AMAX=amax is not None and current is None,
        CURRENT=current is not None, EPS=float(eps), POW2=bool(pow2), HAS_SKIP=skip is not None,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return data, data_t, scale_inv


def cast_transpose_pair(a_job: tuple, b_job: tuple, fp8_dtype: torch.dtype,
                        current: Optional[tuple] = None):
    """See `tritium.ref.cast.cast_transpose_pair`: two casts, one launch."""
    bm, bn, warps = _tile(0, 0, not a_job[0].is_cuda)
    launch_args, results, programs, trans = [], [], 0, []
    for x, scale, amax, pad_rows_to, write_data, write_transpose in (a_job, b_job):
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, n = x.shape
        mp = -(-m // pad_rows_to) * pad_rows_to
        data, data_t, scale_inv = _outputs(x, fp8_dtype, mp, n, write_data, write_transpose)
        results.append((data, data_t, scale_inv))
        trans.append(_trans_in_registers(x, write_transpose))
        launch_args += (x, data if write_data else scale_inv,
                        data_t if data_t is not None else scale_inv,
                        scale if current is None else amax,
                        amax if amax is not None else scale_inv, scale_inv, m, n, mp, x.stride(0))
        programs += max(-(-mp // bm), 1) * max(-(-n // bn), 1)  # the kernel counts the same
    eps, pow2 = current if current is not None else (0.0, False)
    _launch_cast_pair(
        (programs,), *launch_args, FP8_MAX=fp8_max(fp8_dtype), OUT_DTYPE=_TL_FP8[fp8_dtype],
        A_DATA=a_job[4], A_T=a_job[5], A_TRANS=trans[0], B_DATA=b_job[4], B_T=b_job[5],
        B_TRANS=trans[1],
        A_AMAX=a_job[2] is not None and current is None,
        B_AMAX=b_job[2] is not None and current is None,
        CURRENT=current is not None, EPS=float(eps), POW2=bool(pow2),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return results[0], results[1]


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    data = data.contiguous()
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    n = data.numel()
    if n:
        block = 1024 if data.is_cuda else 256
        _launch_dequantize((-(-n // block),), data, scale_inv, out, n, BLOCK=block,
                           num_warps=4)
    return out


def transpose_fp8(data: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See `tritium.ref.cast.transpose_fp8`."""
    m, n = data.shape
    if out is None:
        out = torch.empty(n, m, dtype=data.dtype, device=data.device)
    if data.numel():
        bm, bn, warps = (16, 16, 1) if not data.is_cuda else (128, 128, 8)
        _launch_transpose((-(-m // bm), -(-n // bn)), data.contiguous().view(torch.uint8),
                          out.view(torch.uint8), m, n, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return out


__all__ = ["amax_into", "cast_transpose", "cast_transpose_pair", "dequantize", "transpose_fp8"]
