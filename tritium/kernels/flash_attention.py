"""Triton flash attention that reads 16-bit q/k/v and returns fp32 partial results (for the exact
mode of context-parallel attention, tritium/attention/cp/merge.py).

Twin: `tritium.ref.flash_attention` (same names and signatures, plain fp32 math). Contract:
  * q [b, s_q, h, d], k/v [b, s_kv, h_kv, d] (bshd, any strides, d a power of two <= 128, d_v ==
    d_qk), h % h_kv == 0, query head i reads kv head i // (h // h_kv). fp16, bf16 or fp32.
  * causal = top-left (key j visible to query i iff j <= i), any s_q / s_kv; else no mask.
  * forward -> out fp32 [b, s_q, h, d] (never rounded to 16 bits), lse fp32 [b, h, s_q] (natural
    log). backward(dout, q, k, v, out, lse) -> dq, dk, dv fp32 shaped like q, k, v. The backward
    is FlashAttention-2's: P = exp(S - lse), D = rowsum(dO * out), dS = P * (dO v^T - D); it only
    needs an (out, lse) pair of the same softmax rows, so context parallelism passes the merged
    out/lse of the whole ring, not this block's own. GQA sums dk/dv over a group in fp32, inside
    one program (no atomics).

Precision. Scores are exact products of the 16-bit inputs summed in fp32 (tensor cores). The
fp32 operands of the other products (P in P@V and P^T@dO, dS in dS@K and dS^T@Q) are split into
a 16-bit head plus a 16-bit tail (SPLIT=True, the default): two tensor-core products whose sum
carries ~16 (bf16) / ~22 (fp16) bits of the operand instead of 8 / 11, so the partials stay
close to fp32 math (the twin agrees to ~1e-5 relative) at ~1.5x the tensor-core work.
SPLIT=False rounds P / dS once to the input dtype (what cuDNN does; faster, error like a 16-bit
kernel without the final rounding). fp32 inputs use IEEE fp32 products (interpreter tests,
fallback).

Tiling. Forward: a program owns BLOCK_M query rows of one head and walks the key blocks with
the online softmax (exp2 with log2(e) folded into the scale); key blocks strictly below the
diagonal run without a mask, the rest (diagonal band, key tail) with one. Backward: a
preprocess kernel writes D (fp32); the dk/dv kernel owns BLOCK_N keys of one kv head and walks
the query blocks of every head of its group, computing S^T directly (K Q^T) so that no fp32
tile is ever transposed (see the Triton 3.6 note in cast.py); the dq kernel owns BLOCK_M query
rows and walks the key blocks. A row whose lse is -inf (no visible key) gets P = 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _mm(a, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for an fp32 `a` and a `b` in the input dtype (head/tail split of `a`)."""
    hi = a.to(b.dtype)
    acc = tl.dot(hi, b, acc, input_precision=PREC)
    if SPLIT:
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(lo, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _heads(bh, H, G):
    """Program axis 1 -> (batch, query head, kv head) as int64 offsets (G query heads per kv)."""
    h = bh % H
    return (bh // H).to(tl.int64), h.to(tl.int64), (h // G).to(tl.int64)


@triton.jit
def _load_tile(ptr, b, h, sb, sh, ss, sd, rows, offs_d, ok):
    """x[b, rows, h, :] of a [b, s, h, d] tensor with these strides; rows past `ok` read 0."""
    return tl.load(ptr + b * sb + h * sh + rows[:, None] * ss + offs_d[None, :] * sd,
                   mask=ok[:, None], other=0.0)


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                s_q, s_kv, H, G, qk_scale,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                sob, sos, soh, sod, slb, slh, sls,
                CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h, hk = _heads(bh, H, G)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < s_q

    q = _load_tile(q_ptr, b, h, sqb, sqh, sqs, sqd, offs_m, offs_d, m_ok)
    k_base = k_ptr + b * skb + hk * skh + offs_d[None, :] * skd
    v_base = v_ptr + b * svb + hk * svh + offs_d[None, :] * svd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    if CAUSAL:
        hi = tl.minimum(s_kv, start_m + BLOCK_M)
        full = (tl.minimum(start_m, s_kv) // BLOCK_N) * BLOCK_N
    else:
        hi = s_kv
        full = (s_kv // BLOCK_N) * BLOCK_N
    # key blocks every row of this tile sees whole: no mask
    for n0 in range(0, full, BLOCK_N):
        rows = n0 + offs_n
        k = tl.load(k_base + rows[:, None] * sks)
        v = tl.load(v_base + rows[:, None] * svs)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm(p, v, acc * alpha[:, None], SPLIT, PREC)
        m_i = m_new
    # diagonal band and key tail: masked
    for n0 in range(full, hi, BLOCK_N):
        rows = n0 + offs_n
        n_ok = rows < s_kv
        k = tl.load(k_base + rows[:, None] * sks, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * svs, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (rows[None, :] <= offs_m[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm(p, v, acc * alpha[:, None], SPLIT, PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod, out,
             mask=m_ok[:, None])
    tl.store(lse_ptr + b * slb + h * slh + offs_m * sls, lse, mask=m_ok)


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, s_q, H,
                  sob, sos, soh, sod, sdb, sds, sdh, sdd,
                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O in fp32 (delta is contiguous [b, h, s_q])."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h, _ = _heads(bh, H, 1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < s_q
    o = _load_tile(o_ptr, b, h, sob, soh, sos, sod, offs_m, offs_d, m_ok).to(tl.float32)
    do = _load_tile(do_ptr, b, h, sdb, sdh, sds, sdd, offs_m, offs_d, m_ok).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * s_q + offs_m, tl.sum(o * do, 1), mask=m_ok)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                 s_q, s_kv, H_KV, G, qk_scale, scale,
                 sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                 sdb, sds, sdh, sdd, slb, slh, sls,
                 CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv (fp32, contiguous like k) for BLOCK_N keys of one kv head, summed over its group."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, hk, _ = _heads(bh, H_KV, 1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < s_kv
    k = _load_tile(k_ptr, b, hk, skb, skh, sks, skd, offs_n, offs_d, n_ok)
    v = _load_tile(v_ptr, b, hk, svb, svh, svs, svd, offs_n, offs_d, n_ok)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)

    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = lo + tl.cdiv(start_n + BLOCK_N - lo, BLOCK_M) * BLOCK_M
        mid = tl.minimum(mid, s_q)
    else:
        lo = 0
        mid = 0
    for g in range(0, G):
        h = hk * G + g
        q_base = q_ptr + b * sqb + h * sqh + offs_d[None, :] * sqd
        do_base = do_ptr + b * sdb + h * sdh + offs_d[None, :] * sdd
        l_base = lse_ptr + b * slb + h * slh
        dl_base = delta_ptr + (b * (H_KV * G) + h) * s_q
        # the diagonal band (causal only): query i sees key j iff j <= i
        for m0 in range(lo, mid, BLOCK_M):
            rows = m0 + offs_m
            m_ok = rows < s_q
            q = tl.load(q_base + rows[:, None] * sqs, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_base + rows[:, None] * sds, mask=m_ok[:, None], other=0.0)
            lse = tl.load(l_base + rows * sls, mask=m_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            delta = tl.load(dl_base + rows, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
            pt = tl.exp2(st - lse[None, :])
            pt = tl.where(offs_n[:, None] <= rows[None, :], pt, 0.0)
            dv = _mm(pt, do, dv, SPLIT, PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk = _mm(dst, q, dk, SPLIT, PREC)
        # rows that see every key of this block (or no mask at all)
        for m0 in range(mid, s_q, BLOCK_M):
            rows = m0 + offs_m
            m_ok = rows < s_q
            q = tl.load(q_base + rows[:, None] * sqs, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_base + rows[:, None] * sds, mask=m_ok[:, None], other=0.0)
            lse = tl.load(l_base + rows * sls, mask=m_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            delta = tl.load(dl_base + rows, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
            pt = tl.exp2(st - lse[None, :])
            dv = _mm(pt, do, dv, SPLIT, PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk = _mm(dst, q, dk, SPLIT, PREC)

    out_off = b * (s_kv * H_KV * D) + hk * D + offs_n[:, None] * (H_KV * D) + offs_d[None, :]
    tl.store(dk_ptr + out_off, dk * scale, mask=n_ok[:, None])
    tl.store(dv_ptr + out_off, dv, mask=n_ok[:, None])


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
               s_q, s_kv, H, G, qk_scale, scale,
               sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
               sdb, sds, sdh, sdd, slb, slh, sls,
               CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq (fp32, contiguous like q) for BLOCK_M query rows of one head."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h, hk = _heads(bh, H, G)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < s_q
    q = _load_tile(q_ptr, b, h, sqb, sqh, sqs, sqd, offs_m, offs_d, m_ok)
    do = _load_tile(do_ptr, b, h, sdb, sdh, sds, sdd, offs_m, offs_d, m_ok)
    lse = tl.load(lse_ptr + b * slb + h * slh + offs_m * sls, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(delta_ptr + bh.to(tl.int64) * s_q + offs_m, mask=m_ok, other=0.0)
    k_base = k_ptr + b * skb + hk * skh + offs_d[None, :] * skd
    v_base = v_ptr + b * svb + hk * svh + offs_d[None, :] * svd
    dq = tl.zeros([BLOCK_M, D], tl.float32)

    if CAUSAL:
        hi = tl.minimum(s_kv, start_m + BLOCK_M)
        full = (tl.minimum(start_m, s_kv) // BLOCK_N) * BLOCK_N
    else:
        hi = s_kv
        full = (s_kv // BLOCK_N) * BLOCK_N
    for n0 in range(0, full, BLOCK_N):
        rows = n0 + offs_n
        k = tl.load(k_base + rows[:, None] * sks)
        v = tl.load(v_base + rows[:, None] * svs)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = _mm(ds, k, dq, SPLIT, PREC)
    for n0 in range(full, hi, BLOCK_N):
        rows = n0 + offs_n
        n_ok = rows < s_kv
        k = tl.load(k_base + rows[:, None] * sks, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * svs, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (rows[None, :] <= offs_m[:, None])
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = _mm(ds, k, dq, SPLIT, PREC)

    tl.store(dq_ptr + b * (s_q * H * D) + h * D + offs_m[:, None] * (H * D) + offs_d[None, :],
             dq * scale, mask=m_ok[:, None])


# --------------------------------------------------------------------------------------------
# launchers

_HEAD_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim, on the GPU; tuning code
# (benchmarks/bench_flash_attention.py --cfg) may replace entries of this table. D=128 from
# `--sweep` on an H100 (2026-11-22): one CP=2 rank's blocks at S=32768 went from 22.4 to 19.7 ms.
GPU_CFG = {
    "fwd": {128: (64, 64, 4, 3), 64: (128, 64, 4, 3)},
    "dkdv": {128: (64, 64, 4, 2), 64: (64, 128, 8, 2)},
    "dq": {128: (128, 64, 8, 3), 64: (128, 64, 8, 2)},
}
_INTERP_BLOCK = 16  # the interpreter: small tiles (tail masks exercised at s = 16..48)


def _cfg(kind: str, d: int, device_is_cuda: bool):
    if not device_is_cuda:
        return _INTERP_BLOCK, _INTERP_BLOCK, 4, 1
    table = GPU_CFG[kind]
    return table.get(d, table[128] if d > 64 else (64, 64, 4, 2))


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can this kernel run these bshd tensors? (dtype, head dims, GQA ratio)."""
    return (q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in _HEAD_DIMS and k.shape[-1] == q.shape[-1]
            and v.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0] == v.shape[0]
            and k.shape[1] == v.shape[1] and k.shape[2] == v.shape[2]
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def _check(q, k, v):
    if not supported(q, k, v):
        raise ValueError(f"flash_attention: unsupported q{tuple(q.shape)} {q.dtype}, "
                         f"k{tuple(k.shape)} {k.dtype}, v{tuple(v.shape)} {v.dtype} (bshd, same "
                         f"dtype in {_DTYPES}, head dim in {_HEAD_DIMS}, d_v == d_qk, h % h_kv == 0)")


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, split: bool = True):
    """-> (out fp32 [b, s_q, h, d], lse fp32 [b, h, s_q], natural log)."""
    _check(q, k, v)
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    out = torch.empty(b, s_q, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    bm, bn, warps, stages = _cfg("fwd", d, q.is_cuda)
    grid = (triton.cdiv(s_q, bm), b * h)
    _fwd_kernel[grid](q, k, v, out, lse, s_q, s_kv, h, h // h_kv, scale * LOG2E,
                      *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
                      CAUSAL=bool(causal), SPLIT=bool(split), PREC=_prec(q.dtype), D=d,
                      BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return out, lse


def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                        split: bool = True):
    """-> (dq, dk, dv) fp32, shaped like q, k, v. out (any float dtype) and lse (fp32
    [b, h, s_q]) may be any pair for the same softmax rows (e.g. a CP ring's merged ones)."""
    _check(q, k, v)
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, h, s_q):
        raise ValueError("flash_attention_bwd: dout/out must be shaped like q and lse [b, h, s_q]")
    dev, f32 = q.device, torch.float32
    dq = torch.zeros(b, s_q, h, d, dtype=f32, device=dev)
    dk = torch.zeros(b, s_kv, h_kv, d, dtype=f32, device=dev)
    dv = torch.zeros(b, s_kv, h_kv, d, dtype=f32, device=dev)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    lse = lse.to(f32)
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    delta = torch.empty(b, h, s_q, dtype=f32, device=dev)
    cuda = q.is_cuda
    bm, _, _, _ = _cfg("dq", d, cuda)
    _delta_kernel[(triton.cdiv(s_q, bm), b * h)](out, dout, delta, s_q, h, *out.stride(),
                                                  *dout.stride(), D=d, BLOCK_M=bm,
                                                  num_warps=4 if cuda else 1)
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride())
    flags = dict(CAUSAL=bool(causal), SPLIT=bool(split), PREC=_prec(q.dtype), D=d)
    bm, bn, warps, stages = _cfg("dkdv", d, cuda)
    _dkdv_kernel[(triton.cdiv(s_kv, bn), b * h_kv)](
        q, k, v, dout, lse, delta, dk, dv, s_q, s_kv, h_kv, h // h_kv, scale * LOG2E, scale,
        *common, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = _cfg("dq", d, cuda)
    _dq_kernel[(triton.cdiv(s_q, bm), b * h)](
        q, k, v, dout, lse, delta, dq, s_q, s_kv, h, h // h_kv, scale * LOG2E, scale,
        *common, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv


def flops(b: int, s_q: int, s_kv: int, h: int, d: int, causal: bool, backward: bool = False):
    """Useful matmul FLOPs (2 per multiply-add; causal counts the visible half)."""
    f = 4.0 * b * h * s_q * s_kv * d * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


__all__ = ["flash_attention_fwd", "flash_attention_bwd", "supported", "flops"]
