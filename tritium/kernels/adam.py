"""Triton multi-tensor Adam/AdamW step, and the multi-tensor machinery FusedSGD shares.

Twin: `tritium.ref.adam` (same names and signatures; its docstring states the op order). The two
agree bit for bit: same fp32 ops in the same order, IEEE `div_rn`/`sqrt_rn`, and the kernel is
compiled with `enable_fp_fusion=False` (no mul+add contracted into an FMA, which torch's separate
elementwise ops never do).

One launch covers every tensor of one dtype combination (param storage, grad, moment dtypes,
master or not, FP8 or not). The host writes two int64 tables:
  * `table` [T, NCOL]: per tensor its numel and the addresses of grad, param storage (the fp8
    `_data` for FP8 params), exp_avg, exp_avg_sq, master (or the int16 remainder), and for FP8
    params scale, scale_inv, amax (0 = none);
  * `chunks` [C]: (tensor index << 32) | chunk index, one entry per CHUNK elements.
Program c reads its chunk entry and walks its CHUNK elements in steps of BLOCK. Each step reads
its tensor's addresses from the table again (L1 hits): held across the loop, LLVM keeps them as
loop-carried per-element pointers, 15-50 registers more (ptxas, sm_90), one program less per SM.
Full steps take an unmasked path whose loads vectorize to 128 bits (addresses are hinted 16-byte
aligned when the host checked that every one is; a mask on a runtime numel would stop the
vectorization); only the last step of each tensor is masked. The hyperparameters come from a
small fp32 device tensor `hp`, so a launch is the same whether they were computed on the host or
the device (capturable, CUDA graphs) and the compiled kernel never depends on their values.

The tables are cached in a dict the caller owns (`cache`): rebuilt only when an address or a
size changes (grads reallocated by zero_grad(set_to_none=True) rebuild the small [T, NCOL] one,
the chunk list only depends on sizes). Uploads go through pinned memory without a host sync, so
a rebuild is also legal inside CUDA graph capture (the pinned buffer is kept alive).

Scaled states (fp16 / FP8 E4M3 moments, fp16 masters; the scheme is in `tritium.ref.adam`):
the table's QMETA column points at each tensor's fp32 [3, 3] factor table, and the step takes
two launches of the same kernel: PASS=1 computes the update and only max-reduces |new value| of
each scaled state into the table (atomic max; nothing else is written), the host turns the
amaxes into new factors (a few tensor ops on all tables stacked, no sync), and PASS=2 computes
the same update again (same loads, same ops: bitwise the same values) and writes everything
with the new factors.
PASS=0 is the one-launch step without scaled states.

Deliberately not here: per-tensor hyperparameters (a param group is one launch), a no-op flag
for skipped steps (amp's inf checks).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..fp8.formats import FP8_MAX
from ._launch import Launcher
from .cast import _abs_max_nan

# On CUDA a program updates CHUNK elements in steps of BLOCK (8 fp32 per thread per array at
# 4 warps; 16 per thread needs 130-170 registers and leaves one program per SM). Chosen from
# bench_adam.py's sweep on an H200 (1B params): chunk 4096 / block 1024 / 4 warps ran at 96.5%
# (fp32) and 95.6% (bf16 + master) of copy bandwidth, 8192 / 2048 / 8 at 93.3% / 93.6%. The interpreter takes tiny chunks of
# two steps so that small test tensors span several chunks and end inside a step.
CHUNK, BLOCK, NUM_WARPS = 4096, 1024, 4
INTERP_CHUNK, INTERP_BLOCK = 64, 32

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
            torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
            torch.int16: tl.int16}

# Columns of the per-tensor table.
NUMEL, G, P, M, V, MASTER, SCALE, SCALE_INV, AMAX, QMETA = range(10)
NCOL = 10
_NUMEL, _G, _P, _M, _V, _MASTER = (tl.constexpr(c) for c in (NUMEL, G, P, M, V, MASTER))
_SCALE, _SCALE_INV, _AMAX, _NCOL = (tl.constexpr(c) for c in (SCALE, SCALE_INV, AMAX, NCOL))
_QMETA = tl.constexpr(QMETA)
# Scaled states: rows of the [3, 3] factor table (see tritium.ref.adam), columns d, q, amax.
ROW_M, ROW_V, ROW_W = 0, 1, 2
_ROW_M, _ROW_V, _ROW_W = tl.constexpr(ROW_M), tl.constexpr(ROW_V), tl.constexpr(ROW_W)
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0,
                torch.float8_e4m3fn: FP8_MAX[torch.float8_e4m3fn]}


# ---------------------------------------------------------------- shared device helpers
@triton.jit
def _ptr(row, COL: tl.constexpr, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in column COL of this tensor's row, as a DTYPE pointer, moved to `start`."""
    p = tl.load(row + COL).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p + start


@triton.jit
def _ld(ptr, offs, mask, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0)
    return x


@triton.jit
def _st(ptr, offs, x, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr + offs, x)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _to_int16(x):
    return (x - (x >= 0x8000).to(tl.int32) * 0x10000).to(tl.int16)


@triton.jit
def _split_remainder(w):
    """See tritium.ref.adam.split_remainder."""
    b = w.to(tl.int32, bitcast=True)
    hi = (b >> 16) & 0xFFFF
    lo = b & 0xFFFF
    param = tl.where(w != w, hi | 0x40, hi + (lo >= 0x8000).to(tl.int32))
    return _to_int16(param), _to_int16(lo)


@triton.jit
def _join_remainder(param_bits, remainder):
    """See tritium.ref.adam.join_remainder."""
    pb = param_bits.to(tl.int32) & 0xFFFF
    r = remainder.to(tl.int32)
    hi = tl.where((pb & 0x7FFF) > 0x7F80, pb, pb - (r < 0).to(tl.int32))
    hi = hi - (hi >= 0x8000).to(tl.int32) * 0x10000
    return (hi * 0x10000 + (r & 0xFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _chunk(table_ptr, chunks_ptr, BLOCK: tl.constexpr):
    """-> (this tensor's table row, first element of the chunk, elements left from there)."""
    c = tl.load(chunks_ptr + tl.program_id(0))
    row = table_ptr + (c >> 32) * _NCOL
    start = (c & 0xFFFFFFFF) * BLOCK
    return row, start, tl.load(row + _NUMEL) - start


@triton.jit
def _load_weight(row, start, offs, mask, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                 REMAINDER: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """The fp32 weight: from (param bits, remainder), the master, or the param."""
    if REMAINDER:
        pb = _ld(_ptr(row, _P, start, tl.int16, ALIGNED), offs, mask, EVEN)
        r = _ld(_ptr(row, _MASTER, start, tl.int16, ALIGNED), offs, mask, EVEN)
        w = _join_remainder(pb, r)
    elif HAS_MASTER:
        w = _ld(_ptr(row, _MASTER, start, tl.float32, ALIGNED), offs, mask, EVEN)
    else:
        w = _ld(_ptr(row, _P, start, P_DTYPE, ALIGNED), offs, mask, EVEN).to(tl.float32)
    return w


@triton.jit
def _store_weight(row, start, offs, mask, w, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                  REMAINDER: tl.constexpr, FP8_MAX: tl.constexpr, ALIGNED: tl.constexpr,
                  EVEN: tl.constexpr):
    """Write w to master/remainder and the param (RTNE cast, or the FP8 cast and its amax)."""
    if REMAINDER:
        pb, r = _split_remainder(w)
        _st(_ptr(row, _P, start, tl.int16, ALIGNED), offs, pb, mask, EVEN)
        _st(_ptr(row, _MASTER, start, tl.int16, ALIGNED), offs, r, mask, EVEN)
    else:
        if HAS_MASTER:
            _st(_ptr(row, _MASTER, start, tl.float32, ALIGNED), offs, w, mask, EVEN)
        if FP8_MAX > 0:
            scale = tl.load(tl.load(row + _SCALE).to(tl.pointer_type(tl.float32)))
            q = tl.clamp(w * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            _st(_ptr(row, _P, start, P_DTYPE, ALIGNED), offs,
                q.to(P_DTYPE, fp_downcast_rounding="rtne"), mask, EVEN)
            amax_addr = tl.load(row + _AMAX)
            if amax_addr != 0:
                tl.atomic_max(amax_addr.to(tl.pointer_type(tl.float32)),
                              _abs_max_nan(tl.where(mask, w, 0.0)))
        else:
            _st(_ptr(row, _P, start, P_DTYPE, ALIGNED), offs, w.to(P_DTYPE), mask, EVEN)


@triton.jit
def _fp8_scale_inv(row, start, FP8_MAX: tl.constexpr):
    """The first chunk of an FP8 tensor writes scale_inv = 1/scale (IEEE division)."""
    if FP8_MAX > 0:
        if start == 0:
            scale = tl.load(tl.load(row + _SCALE).to(tl.pointer_type(tl.float32)))
            tl.store(tl.load(row + _SCALE_INV).to(tl.pointer_type(tl.float32)),
                     tl.math.div_rn(1.0, scale))


# ---------------------------------------------------------------- scaled states
@triton.jit
def _factor(row, R: tl.constexpr, COL: tl.constexpr):
    """Entry (R, COL) of this tensor's [3, 3] factor table."""
    return tl.load(tl.load(row + _QMETA).to(tl.pointer_type(tl.float32)) + R * 3 + COL)


@triton.jit
def _ld_state(ptr, offs, mask, row, R: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr):
    # No `other=` for masked lanes (an fp8 `other` does not cast in the interpreter); they are
    # never stored, and the amax reduction masks them.
    if EVEN:
        x = tl.load(ptr + offs).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=mask).to(tl.float32)
    if SCALED:
        x = x * _factor(row, R, 0)
    return x


@triton.jit
def _st_state(ptr, offs, x, mask, row, R: tl.constexpr, DTYPE: tl.constexpr,
              SCALED: tl.constexpr, CLAMP: tl.constexpr, PASS: tl.constexpr, EVEN: tl.constexpr):
    """PASS 1: max-reduce |x| into the table (scaled states only); else store (scaled by q)."""
    if PASS == 1:
        if SCALED:
            amax_ptr = tl.load(row + _QMETA).to(tl.pointer_type(tl.float32)) + R * 3 + 2
            tl.atomic_max(amax_ptr, _abs_max_nan(tl.where(mask, x, 0.0)))
    else:
        if SCALED:
            y = x * _factor(row, R, 1)
            if CLAMP > 0:
                y = tl.clamp(y, -CLAMP, CLAMP, propagate_nan=tl.PropagateNan.ALL)
            _st(ptr, offs, y.to(DTYPE, fp_downcast_rounding="rtne"), mask, EVEN)
        else:
            _st(ptr, offs, x.to(DTYPE), mask, EVEN)


# ---------------------------------------------------------------- the Adam kernel
@triton.jit
def _adam_block(row, start, left, lr, bc1, bc2, b1, omb1, b2, omb2, eps, wd,
                P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr,
                V_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, REMAINDER: tl.constexpr,
                FP8_MAX: tl.constexpr, DECAY_GRAD: tl.constexpr, DECAY_UPDATE: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                PASS: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                W_DTYPE: tl.constexpr, W_SCALED: tl.constexpr, M_CLAMP: tl.constexpr,
                V_CLAMP: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < left
    m_ptr = _ptr(row, _M, start, M_DTYPE, ALIGNED)
    v_ptr = _ptr(row, _V, start, V_DTYPE, ALIGNED)
    g = _ld(_ptr(row, _G, start, G_DTYPE, ALIGNED), offs, mask, EVEN).to(tl.float32)
    m = _ld_state(m_ptr, offs, mask, row, _ROW_M, M_SCALED, EVEN)
    v = _ld_state(v_ptr, offs, mask, row, _ROW_V, V_SCALED, EVEN)
    if W_SCALED:
        w_ptr = _ptr(row, _MASTER, start, W_DTYPE, ALIGNED)
        w = _ld_state(w_ptr, offs, mask, row, _ROW_W, True, EVEN)
    else:
        w = _load_weight(row, start, offs, mask, P_DTYPE, HAS_MASTER, REMAINDER, ALIGNED, EVEN)
    if DECAY_GRAD:
        g = g + w * wd
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    denom = tl.sqrt_rn(tl.math.div_rn(v, bc2)) + eps
    u = tl.math.div_rn(tl.math.div_rn(m, bc1), denom)
    if DECAY_UPDATE:
        u = u + w * wd
    w = w - u * lr
    _st_state(m_ptr, offs, m, mask, row, _ROW_M, M_DTYPE, M_SCALED, M_CLAMP, PASS, EVEN)
    _st_state(v_ptr, offs, v, mask, row, _ROW_V, V_DTYPE, V_SCALED, V_CLAMP, PASS, EVEN)
    if W_SCALED:
        _st_state(w_ptr, offs, w, mask, row, _ROW_W, W_DTYPE, True, 0.0, PASS, EVEN)
        if PASS != 1:  # the param from the fp32 weight (not from the rounded master)
            _store_weight(row, start, offs, mask, w, P_DTYPE, False, False, FP8_MAX, ALIGNED,
                          EVEN)
    elif PASS != 1:
        _store_weight(row, start, offs, mask, w, P_DTYPE, HAS_MASTER, REMAINDER, FP8_MAX,
                      ALIGNED, EVEN)


@triton.jit
def _adam_kernel(table_ptr, chunks_ptr, hp_ptr,
                 P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr,
                 V_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, REMAINDER: tl.constexpr,
                 FP8_MAX: tl.constexpr, DECAY_GRAD: tl.constexpr, DECAY_UPDATE: tl.constexpr,
                 ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 PASS: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                 W_DTYPE: tl.constexpr, W_SCALED: tl.constexpr, M_CLAMP: tl.constexpr,
                 V_CLAMP: tl.constexpr):
    row, start, left = _chunk(table_ptr, chunks_ptr, CHUNK)
    lr = tl.load(hp_ptr + 0)
    bc1 = tl.load(hp_ptr + 1)
    bc2 = tl.load(hp_ptr + 2)
    b1 = tl.load(hp_ptr + 3)
    omb1 = tl.load(hp_ptr + 4)
    b2 = tl.load(hp_ptr + 5)
    omb2 = tl.load(hp_ptr + 6)
    eps = tl.load(hp_ptr + 7)
    wd = tl.load(hp_ptr + 8)
    for i in range(0, CHUNK, BLOCK):
        if left - i >= BLOCK:
            _adam_block(row, start + i, left - i, lr, bc1, bc2, b1, omb1, b2, omb2, eps, wd,
                        P_DTYPE, G_DTYPE, M_DTYPE, V_DTYPE, HAS_MASTER, REMAINDER, FP8_MAX,
                        DECAY_GRAD, DECAY_UPDATE, ALIGNED, BLOCK, True, PASS, M_SCALED,
                        V_SCALED, W_DTYPE, W_SCALED, M_CLAMP, V_CLAMP)
        elif left - i > 0:
            _adam_block(row, start + i, left - i, lr, bc1, bc2, b1, omb1, b2, omb2, eps, wd,
                        P_DTYPE, G_DTYPE, M_DTYPE, V_DTYPE, HAS_MASTER, REMAINDER, FP8_MAX,
                        DECAY_GRAD, DECAY_UPDATE, ALIGNED, BLOCK, False, PASS, M_SCALED,
                        V_SCALED, W_DTYPE, W_SCALED, M_CLAMP, V_CLAMP)
    if PASS != 1:
        _fp8_scale_inv(row, start, FP8_MAX)


_launch_adam = Launcher(_adam_kernel)


# ---------------------------------------------------------------- host side: tables, launch
def block_config(interpret: bool) -> tuple[int, int, int]:
    """(elements per program, elements per step, num_warps)."""
    return (INTERP_CHUNK, INTERP_BLOCK, 1) if interpret else (CHUNK, BLOCK, NUM_WARPS)


def _upload(rows: list, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return host, None
    host = host.pin_memory()
    return host.to(device, non_blocking=True), host  # keep the pinned source alive (graphs)


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def build_tables(cache: Optional[dict], block: int, params: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor], col_m: Optional[Sequence[torch.Tensor]],
                 col_v: Optional[Sequence[torch.Tensor]],
                 col_master: Optional[Sequence[torch.Tensor]], fp8_meta: Optional[Sequence],
                 qmeta: Optional[Sequence[torch.Tensor]] = None):
    """-> (table, chunks, number of chunks, all addresses 16-byte aligned) or None if empty.

    Tensors with no elements are left out. Every tensor must be contiguous (checked)."""
    flat, numels = [], []
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        ts = (grads[i], p, None if col_m is None else col_m[i], None if col_v is None else col_v[i],
              None if col_master is None else col_master[i])
        scale = scale_inv = amax = None
        if fp8_meta is not None:
            scale, scale_inv, amax = fp8_meta[i]
        for t in ts:
            if t is not None and (not t.is_contiguous() or t.numel() != n):
                raise ValueError(f"tensor {i} of a multi-tensor step: every tensor must be "
                                 f"contiguous with {n} elements, got shape {tuple(t.shape)}")
        flat += [n, *map(_addr, ts), _addr(scale), _addr(scale_inv), _addr(amax),
                 _addr(None if qmeta is None else qmeta[i])]
        numels.append(n)
    if not numels:
        return None
    cache = {} if cache is None else cache
    key = tuple(flat)
    if cache.get("key") != key:
        device = params[0].device
        table, pinned = _upload(flat, device)
        # Only the arrays are loaded as vectors (scale, scale_inv, amax are single floats).
        aligned = all(flat[r * NCOL + c] % 16 == 0 for r in range(len(numels))
                      for c in range(G, MASTER + 1))
        cache.update(key=key, table=table, table_pinned=pinned, aligned=aligned)
    chunk_key = (block, tuple(numels))
    if cache.get("chunk_key") != chunk_key:
        entries = [(t << 32) | j for t, n in enumerate(numels) for j in range(-(-n // block))]
        chunks, pinned = _upload(entries, params[0].device)
        cache.update(chunk_key=chunk_key, chunks=chunks, chunks_pinned=pinned,
                     n_chunks=len(entries))
    return cache["table"], cache["chunks"], cache["n_chunks"], cache["aligned"]


def on_device(t: torch.Tensor):
    """Context that makes t's GPU current: the Launcher launches on the current device."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _one(dtypes: set, what: str):
    if len(dtypes) != 1:
        raise ValueError(f"one multi-tensor launch needs one {what} dtype, "
                         f"got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
              masters: Optional[Sequence[torch.Tensor]], fp8_meta: Optional[Sequence],
              remainders: Optional[Sequence[torch.Tensor]], hp: torch.Tensor, *,
              adam_w_mode: bool, weight_decay: bool, cache: Optional[dict] = None,
              state_scales: Optional[Sequence[torch.Tensor]] = None) -> None:
    """See `tritium.ref.adam.adam_step`."""
    if not params:
        return
    chunk, block, warps = block_config(not params[0].is_cuda)
    tables = build_tables(cache, chunk, params, grads, exp_avgs, exp_avg_sqs,
                          remainders if remainders is not None else masters, fp8_meta,
                          state_scales)
    if tables is None:
        return
    table, chunks, n_chunks, aligned = tables
    p_dtype = _one({p.dtype for p in params}, "param")
    m_dtype = _one({m.dtype for m in exp_avgs}, "exp_avg")
    v_dtype = _one({v.dtype for v in exp_avg_sqs}, "exp_avg_sq")
    w_dtype = torch.float32 if masters is None else _one({w.dtype for w in masters}, "master")
    is_fp8 = fp8_meta is not None
    scaled = [dt in SCALED_RANGE for dt in (m_dtype, v_dtype, w_dtype)]
    if any(scaled) and state_scales is None:
        raise ValueError("adam_step: fp16 / fp8 moments or fp16 masters need state_scales")
    consts = dict(
        P_DTYPE=TL_DTYPE[torch.int16 if remainders is not None else p_dtype],
        G_DTYPE=TL_DTYPE[_one({g.dtype for g in grads}, "grad")],
        M_DTYPE=TL_DTYPE[m_dtype], V_DTYPE=TL_DTYPE[v_dtype],
        HAS_MASTER=masters is not None, REMAINDER=remainders is not None,
        FP8_MAX=FP8_MAX[p_dtype] if is_fp8 else 0.0,
        DECAY_GRAD=bool(weight_decay and not adam_w_mode),
        DECAY_UPDATE=bool(weight_decay and adam_w_mode),
        ALIGNED=aligned, CHUNK=chunk, BLOCK=block, M_SCALED=scaled[0], V_SCALED=scaled[1],
        W_DTYPE=TL_DTYPE[w_dtype], W_SCALED=scaled[2],
        M_CLAMP=FP8_MAX.get(m_dtype, 0.0), V_CLAMP=FP8_MAX.get(v_dtype, 0.0),
        num_warps=warps, enable_fp_fusion=False)
    with on_device(params[0]):
        if not any(scaled):
            _launch_adam((n_chunks,), table, chunks, hp, PASS=0, **consts)
            return
        live = [t for p, t in zip(params, state_scales) if p.numel()]
        tables = torch.stack(live)               # [T, 3, 3]: a few launches for all tensors
        tables[:, :, 2] = 0.0
        torch._foreach_copy_(live, list(tables.unbind(0)))
        _launch_adam((n_chunks,), table, chunks, hp, PASS=1, **consts)
        key = ("ranges", m_dtype, v_dtype, w_dtype)
        ranges = None if cache is None else cache.get(key)
        if ranges is None:  # made once per table cache (no upload inside a graph capture)
            ranges = torch.tensor([SCALED_RANGE.get(dt, 1.0) for dt in (m_dtype, v_dtype, w_dtype)],
                                  dtype=torch.float32).to(params[0].device)
            if cache is not None:
                cache[key] = ranges
        tables = torch.stack(live)
        d = tables[:, :, 2] / ranges             # the twin's new_scale_factors, for all tensors
        tables[:, :, 1] = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
        torch._foreach_copy_(live, list(tables.unbind(0)))
        _launch_adam((n_chunks,), table, chunks, hp, PASS=2, **consts)
        tables[:, :, 0] = d
        torch._foreach_copy_(live, list(tables.unbind(0)))


__all__ = ["adam_step", "build_tables", "block_config", "CHUNK", "BLOCK", "NUM_WARPS"]
