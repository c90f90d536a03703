"""Triton flash attention: 16-bit q/k/v in; fp32 partial results for the exact mode of
context-parallel attention (tritium/attention/cp/merge.py), or 16-bit results (the speed mode,
what an attention backend returns).

Twin: `tritium.ref.flash_attention` (same names and signatures, plain fp32 math). Contract:
  * q [b, s_q, h, d], k/v [b, s_kv, h_kv, d] (bshd, any strides, d a power of two <= 128, or
    256 for the forward alone, d_v == d_qk), h % h_kv == 0, query head i reads kv head
    i // (h // h_kv) (K/V are never repeated). fp16, bf16 or fp32.
  * causal = top-left (key j visible to query i iff j <= i), any s_q / s_kv; else no mask.
    `band` (lo, hi) instead: key j visible to query i iff lo <= j - i <= hi (sliding windows,
    bottom-right alignment: the attention layer's window (left, right) with its diagonal offset
    o is (o - left, o + right)); each row block visits only the key blocks the band reaches
    (masked where it cuts a block), each key block of the backward only the query blocks.
  * `varlen` (cu_q, cu_kv, max_s_q, max_s_kv): packed sequences (thd), q [t_q, h, d], k / v
    [t_kv, h_kv, d]; grid axis 1 runs (sequence, head), each program moves its pointers to its
    sequence's first rows (int32 cumulative lengths read on the device: no host sync) and
    exits past the sequence's end; masks and bands apply within each sequence; pointer loads
    (a TMA box would need per-sequence descriptors); lse [h, t_q].
  * forward -> out [b, s_q, h, d] in out_dtype (None = fp32, never rounded to 16 bits; or the
    input dtype, rounded once), lse fp32 [b, h, s_q] (natural log). backward(dout, q, k, v,
    out, lse) -> dq, dk, dv shaped like q, k, v in grad_dtype (same choice). The backward is
    FlashAttention-2's: P = exp(S - lse), D = rowsum(dO * out), dS = P * (dO v^T - D); it only
    needs an (out, lse) pair of the same softmax rows, so context parallelism passes the merged
    out/lse of the whole ring, not this block's own. GQA sums dk/dv over a group in fp32,
    inside one program.

Precision. Scores are exact products of the 16-bit inputs summed in fp32 (tensor cores). The
fp32 operands of the other products (P in P@V and P^T@dO, dS in dS@K and dS^T@Q) are split into
a 16-bit head plus a 16-bit tail (SPLIT=True, the default): two tensor-core products whose sum
carries ~16 (bf16) / ~22 (fp16) bits of the operand instead of 8 / 11, so the partials stay
close to fp32 math (the twin agrees to ~1e-5 relative) at ~1.5x the tensor-core work.
SPLIT=False rounds P / dS once to the input dtype (what cuDNN does; faster, error like a 16-bit
kernel). fp32 inputs use IEEE fp32 products (interpreter tests, fallback).

Tiling. Forward: a program owns BLOCK_M query rows of one head and walks the key blocks with
the online softmax (exp2, log2(e) folded into the scale, one FMA per score); key blocks strictly
below the diagonal run without a mask, the rest (diagonal band, key tail) with one; causal key
blocks past the diagonal are never visited, and the busiest row blocks are launched first.
Backward: a preprocess kernel writes D (fp32); the dk/dv kernel owns BLOCK_N keys of one kv head
and walks the query blocks of every head of its group (causal: from the first that sees one of
its keys, masked in one loop), computing S^T directly (K Q^T) so that no fp32 tile is ever
transposed (see the Triton 3.6 note in cast.py). dq comes either from a dq kernel that owns
BLOCK_M query rows and walks the key blocks (no atomics, deterministic, 7 matmuls per tile pair
in the whole backward) or (Cfg.atomic_dq) from the dk/dv kernel itself: dS K by fp32 atomic
adds into a zeroed buffer, dS^T's 16-bit head / tail transposed, never an fp32 tile (5 matmuls,
order of the sums not fixed). A row whose lse is -inf (no visible key) gets P = 0.

Launch options (`Cfg`, per kernel and (head dim, split) in GPU_CFG; benchmarks/
bench_flash_attention.py --sweep picks them on a GPU): tile sizes, warps, pipeline stages,
q/k/v/dO loaded through TMA descriptors of their [b, s, h * d] views (where the layout allows:
unit-stride d, packed heads, 16-byte aligned strides; pointer loads otherwise: their address
tiles cost registers, a 128 x 128 forward tile spills on sm90 without TMA), and
`tl.range(warp_specialize=True)` on the forward's unmasked loop (with TMA; Triton 3.6 compiles
it for sm90 at 8 warps, not at 4).
FP8 forward (`flash_attention_fp8_fwd`, the FP8 constexpr; recipe fp8_dpa): q, k, v in E4M3
with a dequant scale each (descale fp32 [3] on the device, read by the kernel: no host sync).
S = tl.dot on the E4M3 tiles (native wgmma on sm90, whose E4M3 accumulator keeps fewer bits
than fp32: the GPU test measures the kernel against exact attention, not bit for bit), the q
and k descales folded into qk_scale; online softmax in fp32 as above; P (in [0, 1], relative to
the running max) times P_SCALE = 448 rounded to E4M3 for an E4M3 P @ V; out = acc * dv / 448 /
l, written in out_dtype; lse from the unquantized P. E4M3 wgmma reads both operands K-major, so
P @ V wants V with the keys contiguous (VT: the layer's cast writes V that way, in the same pass;
the wrapper copies any other V once); read as [d, keys] tiles and transposed as a view, it ran
3.3x faster than row-major V (H100, 238 -> 785 TFLOPS). Twin:
`ref.flash_attention.flash_attention_fp8_fwd` with block_n = `fp8_block_n(...)` (P's
quantization depends on the key tiling). No FP8
backward: the attention layer runs the backward above on the dequantized inputs.
Deliberately not here: dropout, padding masks, packed sequences in the FP8 forward, autotuning
at run time (configs are fixed per shape class so launches stay cheap).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

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
def _mm_t(at, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """acc + at^T @ b for an fp32 `at`: only its 16-bit head / tail are transposed."""
    hi = at.to(b.dtype)
    acc = tl.dot(tl.trans(hi), b, acc, input_precision=PREC)
    if SPLIT:
        lo = (at - hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(tl.trans(lo), b, acc, input_precision=PREC)
    return acc


@triton.jit
def _pv(p, v, acc, SPLIT: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    """acc + P @ V: FP8 rounds P * 448 to v's E4M3 (P_SCALE, undone at the end)."""
    if FP8:
        return tl.dot((p * 448.0).to(v.dtype), v, acc)
    else:
        return _mm(p, v, acc, SPLIT, PREC)


@triton.jit
def _heads(bh, H, G):
    """Program axis 1 -> (batch, query head, kv head) as int64 offsets (G query heads per kv)."""
    h = bh % H
    return (bh // H).to(tl.int64), h.to(tl.int64), (h // G).to(tl.int64)


@triton.jit
def _row_block(s_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query row of this program; causal: the last (busiest) row blocks start first."""
    pid = tl.program_id(0)
    if CAUSAL:
        pid = tl.cdiv(s_q, BLOCK_M) - 1 - pid
    return pid * BLOCK_M


@triton.jit
def _load_tile(ptr, b, h, sb, sh, ss, sd, rows, offs_d, ok):
    """x[b, rows, h, :] of a [b, s, h, d] tensor with these strides; rows past `ok` read 0."""
    return tl.load(ptr + b * sb + h * sh + rows[:, None] * ss + offs_d[None, :] * sd,
                   mask=ok[:, None], other=0.0)


@triton.jit
def _rows(src, b, h, sb, sh, ss, sd, r0, n, offs_d,
          MASK: tl.constexpr, TMA: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    """Rows r0 .. r0 + BLOCK of head h, batch b: through a TMA descriptor of the [b, s, h * d]
    view (rows past n read 0 by the descriptor's bounds) or by pointers (masked if MASK)."""
    if TMA:
        return src.load([b.to(tl.int32), r0, (h * D).to(tl.int32)]).reshape(BLOCK, D)
    else:
        rows = r0 + tl.arange(0, BLOCK)
        ptrs = src + b * sb + h * sh + rows[:, None] * ss + offs_d[None, :] * sd
        if MASK:
            return tl.load(ptrs, mask=(rows < n)[:, None], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _value_rows(src, b, h, sb, sh, ss, sd, r0, n, offs_d, MASK: tl.constexpr, TMA: tl.constexpr,
                VT: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    """V rows r0 .. r0 + BLOCK of head h as a [BLOCK, D] operand. VT (the FP8 forward): V is
    sequence-contiguous, the tile is read as [D, BLOCK] (keys contiguous: the K-major layout
    that E4M3 wgmma needs for P @ V) and transposed as a view; TMA: a descriptor of the
    [b, h, d, s] view. Else `_rows`."""
    if VT:
        if TMA:
            vt = src.load([b.to(tl.int32), h.to(tl.int32), 0, r0]).reshape(D, BLOCK)
        else:
            rows = r0 + tl.arange(0, BLOCK)
            ptrs = src + b * sb + h * sh + offs_d[:, None] * sd + rows[None, :] * ss
            if MASK:
                vt = tl.load(ptrs, mask=(rows < n)[None, :], other=0.0)
            else:
                vt = tl.load(ptrs)
        return tl.trans(vt)
    else:
        return _rows(src, b, h, sb, sh, ss, sd, r0, n, offs_d, MASK, TMA, BLOCK, D)


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b):
    """(q0, s_q, k0, s_kv) of sequence b of a packed (thd) batch: first rows (int64) and
    lengths, from the cumulative lengths."""
    q0 = tl.load(cu_q_ptr + b).to(tl.int64)
    k0 = tl.load(cu_k_ptr + b).to(tl.int64)
    return (q0, (tl.load(cu_q_ptr + b + 1) - q0).to(tl.int32), k0,
            (tl.load(cu_k_ptr + b + 1) - k0).to(tl.int32))


@triton.jit
def _backward_rows(q_src, do_src, k_src, v_src, lse_ptr, delta_ptr, q0, k0, sqs, sds, sks, svs,
                   sls):
    """The backward's inputs moved to a packed sequence's first rows (q0 queries, k0 keys)."""
    return (q_src + q0 * sqs, do_src + q0 * sds, k_src + k0 * sks, v_src + k0 * svs,
            lse_ptr + q0 * sls, delta_ptr + q0)


@triton.jit
def _band_blocks(start_m, s_kv, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks that rows start_m .. start_m + BLOCK_M - 1 see through the band
    band_lo <= j - i <= band_hi: (first, mid_lo, mid_hi, end), multiples of BLOCK_N but `end`
    (<= s_kv): [first, mid_lo) and [mid_hi, end) partly visible, [mid_lo, mid_hi) wholly
    visible to every row (and inside s_kv). Empty ranges where the band misses every key."""
    end = tl.minimum(tl.maximum(start_m + BLOCK_M + band_hi, 0), s_kv)
    first = (tl.maximum(start_m + band_lo, 0) // BLOCK_N) * BLOCK_N
    first = tl.minimum(first, end)
    # wholly visible: j >= the last row's lower edge and j + BLOCK_N - 1 <= the first row's upper
    whole_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + band_lo, 0), BLOCK_N) * BLOCK_N
    whole_hi = tl.minimum((tl.maximum(start_m + band_hi + 1, 0) // BLOCK_N) * BLOCK_N,
                          (s_kv // BLOCK_N) * BLOCK_N)
    mid_lo = tl.minimum(tl.maximum(whole_lo, first), end)
    mid_hi = tl.minimum(tl.maximum(whole_hi, mid_lo), end)
    return first, mid_lo, mid_hi, end


@triton.jit
def _fwd_block(q, k_src, v_src, m_i, l_i, acc, b, hk, n0, s_kv, offs_m, offs_n, offs_d,
               skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, band_lo, band_hi,
               MASKED: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr, VT: tl.constexpr, FP8: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The online softmax over key block n0 under a band (the windowed forward); MASKED: the
    band and the key tail masked, rows with nothing visible yet kept at -inf."""
    rows = n0 + offs_n
    k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, MASKED, TMA, BLOCK_N, D)
    v = _value_rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, MASKED, TMA, VT,
                    BLOCK_N, D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if MASKED:
        rel = rows[None, :] - offs_m[:, None]
        s = tl.where((rows < s_kv)[None, :] & (rel >= band_lo) & (rel <= band_hi), s,
                     float("-inf"))
    return _masked_softmax_step(s, v, m_i, l_i, acc, SPLIT, PREC, FP8)


@triton.jit
def _masked_softmax_step(s, v, m_i, l_i, acc, SPLIT: tl.constexpr, PREC: tl.constexpr,
                         FP8: tl.constexpr):
    """The online softmax over one block of scaled scores s (-inf where masked; a row with
    nothing visible so far stays at max -inf and adds nothing) -> (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _pv(p, v, acc * alpha[:, None], SPLIT, PREC, FP8)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(q_src, k_src, v_src, o_ptr, lse_ptr, descale_ptr,
                s_q, s_kv, H, G, qk_scale,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                sob, sos, soh, sod, slb, slh, sls, band_lo, band_hi, cu_q_ptr, cu_k_ptr,
                CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TMA: tl.constexpr, WS: tl.constexpr, FP8: tl.constexpr = False,
                VT: tl.constexpr = False, WINDOW: tl.constexpr = False,
                VARLEN: tl.constexpr = False):
    """out (in o_ptr's dtype) and lse (fp32, natural log) for BLOCK_M query rows of one head;
    FP8: E4M3 q/k/v with descale_ptr -> fp32 [3] (q, k, v dequant scales); VT: v is
    sequence-contiguous (`_value_rows`); WINDOW: key j visible to query i iff
    band_lo <= j - i <= band_hi (CAUSAL off); VARLEN: axis 1 is (sequence, head) of a packed
    batch (cu_q_ptr / cu_k_ptr: cumulative lengths; s_q the longest), pointers, no TMA."""
    start_m = _row_block(s_q, CAUSAL, BLOCK_M)
    bh = tl.program_id(1)
    b, h, hk = _heads(bh, H, G)
    if VARLEN:  # every pointer moved to the sequence's first row; then as one dense sequence
        q0, s_q, k0, s_kv = _sequence(cu_q_ptr, cu_k_ptr, b)
        if start_m >= s_q:
            return
        q_src += q0 * sqs
        k_src += k0 * sks
        v_src += k0 * svs
        o_ptr += q0 * sos
        lse_ptr += q0 * sls
        b = b * 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < s_q
    q = _rows(q_src, b, h, sqb, sqh, sqs, sqd, start_m, s_q, offs_d, True, TMA, BLOCK_M, D)
    if FP8:
        qk_scale = qk_scale * tl.load(descale_ptr) * tl.load(descale_ptr + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    if WINDOW:
        # the band's key blocks: masked where a row sees part of one, unmasked where every
        # row sees all of it
        first, mid_lo, mid_hi, hi = _band_blocks(start_m, s_kv, band_lo, band_hi, BLOCK_M,
                                                 BLOCK_N)
        for n0 in range(first, mid_lo, BLOCK_N):
            m_i, l_i, acc = _fwd_block(q, k_src, v_src, m_i, l_i, acc, b, hk, n0, s_kv, offs_m,
                                       offs_n, offs_d, skb, skh, sks, skd, svb, svh, svs, svd,
                                       qk_scale, band_lo, band_hi, True, SPLIT, PREC, TMA, VT,
                                       FP8, D, BLOCK_N)
        for n0 in range(mid_lo, mid_hi, BLOCK_N):
            m_i, l_i, acc = _fwd_block(q, k_src, v_src, m_i, l_i, acc, b, hk, n0, s_kv, offs_m,
                                       offs_n, offs_d, skb, skh, sks, skd, svb, svh, svs, svd,
                                       qk_scale, band_lo, band_hi, False, SPLIT, PREC, TMA, VT,
                                       FP8, D, BLOCK_N)
        for n0 in range(mid_hi, hi, BLOCK_N):
            m_i, l_i, acc = _fwd_block(q, k_src, v_src, m_i, l_i, acc, b, hk, n0, s_kv, offs_m,
                                       offs_n, offs_d, skb, skh, sks, skd, svb, svh, svs, svd,
                                       qk_scale, band_lo, band_hi, True, SPLIT, PREC, TMA, VT,
                                       FP8, D, BLOCK_N)
    else:
        if CAUSAL:
            hi = tl.minimum(s_kv, start_m + BLOCK_M)
            full = (tl.minimum(start_m, s_kv) // BLOCK_N) * BLOCK_N
        else:
            hi = s_kv
            full = (s_kv // BLOCK_N) * BLOCK_N
        # key blocks every row of this tile sees whole: no mask
        for n0 in tl.range(0, full, BLOCK_N, warp_specialize=WS):
            k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, False, TMA, BLOCK_N, D)
            v = _value_rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, False, TMA, VT,
                            BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _pv(p, v, acc * alpha[:, None], SPLIT, PREC, FP8)
            m_i = m_new
        # diagonal band and key tail: masked
        for n0 in range(full, hi, BLOCK_N):
            rows = n0 + offs_n
            n_ok = rows < s_kv
            k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, True, TMA, BLOCK_N, D)
            v = _value_rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, True, TMA, VT,
                            BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (rows[None, :] <= offs_m[:, None])
            m_i, l_i, acc = _masked_softmax_step(tl.where(ok, s, float("-inf")), v, m_i, l_i,
                                                 acc, SPLIT, PREC, FP8)

    if FP8:
        acc = acc * (tl.load(descale_ptr + 2) / 448.0)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
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
def _dkdv_step(k, v, dk, dv, q_src, do_src, l_base, dl_base, dq_base, b, h, m0, s_q, offs_n,
               offs_d, sqb, sqs, sqh, sqd, sdb, sds, sdh, sdd, sls, dq_rows, qk_scale, scale,
               band_lo, band_hi,
               CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
               ATOMIC_DQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               WINDOW: tl.constexpr):
    """dk, dv += one query block's share (S^T = K Q^T: no fp32 tile is transposed); with
    ATOMIC_DQ also dq (fp32) += scale * dS K for these rows, by atomic adds."""
    rows = m0 + tl.arange(0, BLOCK_M)
    m_ok = rows < s_q
    q = _rows(q_src, b, h, sqb, sqh, sqs, sqd, m0, s_q, offs_d, True, TMA, BLOCK_M, D)
    do = _rows(do_src, b, h, sdb, sdh, sds, sdd, m0, s_q, offs_d, True, TMA, BLOCK_M, D)
    lse = tl.load(l_base + rows * sls, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(dl_base + rows, mask=m_ok, other=0.0)
    st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
    pt = tl.exp2(st - lse[None, :])
    if WINDOW:  # query i sees key j iff band_lo <= j - i <= band_hi
        rel = offs_n[:, None] - rows[None, :]
        pt = tl.where((rel >= band_lo) & (rel <= band_hi), pt, 0.0)
    elif CAUSAL:  # query i sees key j iff j <= i
        pt = tl.where(offs_n[:, None] <= rows[None, :], pt, 0.0)
    dv = _mm(pt, do, dv, SPLIT, PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - delta[None, :])
    dk = _mm(dst, q, dk, SPLIT, PREC)
    if ATOMIC_DQ:
        dq = _mm_t(dst, k, tl.zeros([BLOCK_M, D], tl.float32), SPLIT, PREC)
        tl.atomic_add(dq_base + rows[:, None] * dq_rows + offs_d[None, :], dq * scale,
                      mask=m_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(q_src, k_src, v_src, do_src, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
                 s_q, s_kv, H_KV, G, qk_scale, scale,
                 sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                 sdb, sds, sdh, sdd, slb, slh, sls, band_lo, band_hi, cu_q_ptr, cu_k_ptr,
                 s_delta,
                 CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, WINDOW: tl.constexpr = False,
                 VARLEN: tl.constexpr = False):
    """dk, dv (dk_ptr's dtype, contiguous like k) for BLOCK_N keys of one kv head, summed over
    its group; with ATOMIC_DQ also adds this block's share of dq into a zeroed fp32 dq
    (contiguous like q)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, hk, _ = _heads(bh, H_KV, 1)
    if VARLEN:  # as the forward: pointers moved to the sequence's first rows
        q0, s_q, k0, s_kv = _sequence(cu_q_ptr, cu_k_ptr, b)
        if start_n >= s_kv:
            return
        q_src, do_src, k_src, v_src, lse_ptr, delta_ptr = _backward_rows(
            q_src, do_src, k_src, v_src, lse_ptr, delta_ptr, q0, k0, sqs, sds, sks, svs, sls)
        dq_ptr += q0 * (H_KV * G * D)
        dk_ptr += k0 * (H_KV * D)
        dv_ptr += k0 * (H_KV * D)
        b = b * 0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < s_kv
    k = _rows(k_src, b, hk, skb, skh, sks, skd, start_n, s_kv, offs_d, True, TMA, BLOCK_N, D)
    v = _rows(v_src, b, hk, svb, svh, svs, svd, start_n, s_kv, offs_d, True, TMA, BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)

    # causal: query blocks before the first that sees a key of this block are skipped; the
    # mask is applied to every tile after that (one loop: two, diagonal and below, as in the
    # forward, hold more registers than the sm90 register file has: spills)
    # a band: the query rows i that see a key j of this block, j - band_hi <= i <= j - band_lo
    if WINDOW:
        lo = (tl.maximum(start_n - band_hi, 0) // BLOCK_M) * BLOCK_M
        hi = tl.minimum(tl.maximum(start_n + BLOCK_N - band_lo, 0), s_q)
    else:
        lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        hi = s_q
    for g in range(0, G):
        h = hk * G + g
        l_base = lse_ptr + b * slb + h * slh
        dl_base = delta_ptr + (b * (H_KV * G) + h) * s_delta
        dq_base = dq_ptr + b * (s_q * H_KV * G * D) + h * D
        for m0 in range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_step(k, v, dk, dv, q_src, do_src, l_base, dl_base, dq_base, b, h, m0,
                                s_q, offs_n, offs_d, sqb, sqs, sqh, sqd, sdb, sds, sdh, sdd, sls,
                                H_KV * G * D, qk_scale, scale, band_lo, band_hi, CAUSAL, SPLIT,
                                PREC, TMA, ATOMIC_DQ, D, BLOCK_M, WINDOW)

    out_off = b * (s_kv * H_KV * D) + hk * D + offs_n[:, None] * (H_KV * D) + offs_d[None, :]
    tl.store(dk_ptr + out_off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
    tl.store(dv_ptr + out_off, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _dq_block(q, do, lse, delta, dq, k_src, v_src, b, hk, n0, s_kv, offs_m, offs_n, offs_d,
              skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, band_lo, band_hi,
              MASKED: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
              D: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq += dS K over key block n0 under a band (the windowed backward); MASKED: the band and
    the key tail masked."""
    k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, MASKED, TMA, BLOCK_N, D)
    v = _rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, MASKED, TMA, BLOCK_N, D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        rows = n0 + offs_n
        rel = rows[None, :] - offs_m[:, None]
        p = tl.where((rows < s_kv)[None, :] & (rel >= band_lo) & (rel <= band_hi), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return _mm(p * (dp - delta[:, None]), k, dq, SPLIT, PREC)


@triton.jit
def _dq_kernel(q_src, k_src, v_src, do_src, lse_ptr, delta_ptr, dq_ptr,
               s_q, s_kv, H, G, qk_scale, scale,
               sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
               sdb, sds, sdh, sdd, slb, slh, sls, band_lo, band_hi, cu_q_ptr, cu_k_ptr,
               s_delta,
               CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TMA: tl.constexpr, WINDOW: tl.constexpr = False, VARLEN: tl.constexpr = False):
    """dq (dq_ptr's dtype, contiguous like q) for BLOCK_M query rows of one head."""
    start_m = _row_block(s_q, CAUSAL, BLOCK_M)
    bh = tl.program_id(1)
    b, h, hk = _heads(bh, H, G)
    if VARLEN:  # as the forward: pointers moved to the sequence's first rows
        q0, s_q, k0, s_kv = _sequence(cu_q_ptr, cu_k_ptr, b)
        if start_m >= s_q:
            return
        q_src, do_src, k_src, v_src, lse_ptr, delta_ptr = _backward_rows(
            q_src, do_src, k_src, v_src, lse_ptr, delta_ptr, q0, k0, sqs, sds, sks, svs, sls)
        dq_ptr += q0 * (H * D)
        b = b * 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < s_q
    q = _rows(q_src, b, h, sqb, sqh, sqs, sqd, start_m, s_q, offs_d, True, TMA, BLOCK_M, D)
    do = _rows(do_src, b, h, sdb, sdh, sds, sdd, start_m, s_q, offs_d, True, TMA, BLOCK_M, D)
    lse = tl.load(lse_ptr + b * slb + h * slh + offs_m * sls, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(delta_ptr + (b * H + h) * s_delta + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)

    if WINDOW:  # the forward's blocks of the band (`_band_blocks`)
        first, mid_lo, mid_hi, hi = _band_blocks(start_m, s_kv, band_lo, band_hi, BLOCK_M,
                                                 BLOCK_N)
        for n0 in range(first, mid_lo, BLOCK_N):
            dq = _dq_block(q, do, lse, delta, dq, k_src, v_src, b, hk, n0, s_kv, offs_m, offs_n,
                           offs_d, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, band_lo,
                           band_hi, True, SPLIT, PREC, TMA, D, BLOCK_N)
        for n0 in range(mid_lo, mid_hi, BLOCK_N):
            dq = _dq_block(q, do, lse, delta, dq, k_src, v_src, b, hk, n0, s_kv, offs_m, offs_n,
                           offs_d, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, band_lo,
                           band_hi, False, SPLIT, PREC, TMA, D, BLOCK_N)
        for n0 in range(mid_hi, hi, BLOCK_N):
            dq = _dq_block(q, do, lse, delta, dq, k_src, v_src, b, hk, n0, s_kv, offs_m, offs_n,
                           offs_d, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, band_lo,
                           band_hi, True, SPLIT, PREC, TMA, D, BLOCK_N)
    else:
        if CAUSAL:
            hi = tl.minimum(s_kv, start_m + BLOCK_M)
            full = (tl.minimum(start_m, s_kv) // BLOCK_N) * BLOCK_N
        else:
            hi = s_kv
            full = (s_kv // BLOCK_N) * BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, False, TMA, BLOCK_N, D)
            v = _rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, False, TMA, BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq = _mm(ds, k, dq, SPLIT, PREC)
        for n0 in range(full, hi, BLOCK_N):
            rows = n0 + offs_n
            n_ok = rows < s_kv
            k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, True, TMA, BLOCK_N, D)
            v = _rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, True, TMA, BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (rows[None, :] <= offs_m[:, None])
            p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq = _mm(ds, k, dq, SPLIT, PREC)

    tl.store(dq_ptr + b * (s_q * H * D) + h * D + offs_m[:, None] * (H * D) + offs_d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])


# --------------------------------------------------------------------------------------------
# launchers

_HEAD_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Cfg(NamedTuple):
    """One kernel's launch: tile sizes, warps, pipeline stages, q/k/v/dO loads through TMA
    descriptors, warp specialization of the forward's unmasked loop (fwd, with tma), dq by fp32
    atomic adds from the dk/dv kernel instead of the dq kernel (dkdv)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    ws: bool = False
    atomic_dq: bool = False


# per kernel, by (head dim, split), on the GPU; tuning code (benchmarks/bench_flash_attention.py
# --cfg / --sweep) may replace entries. split=True at D=128 from a sweep on an H100 (2026-11-22,
# one CP=2 rank's blocks at S=32768: 22.4 -> 19.7 ms). split=False (the speed mode): TMA loads,
# chosen by what Triton 3.6 makes of them for sm90 (scripts/flash_regs.py; no GPU timing yet).
# Two rules: 8 warps need >= 128 rows in every product's output (BLOCK_M of the forward and dq,
# BLOCK_N of dk/dv: S^T is [BLOCK_N, BLOCK_M]), else Triton lays 8 warps along 64 rows and the
# second warpgroup repeats the first's wgmma; and pointer loads cost registers (address tiles:
# 255 registers at the tiles below). D=128: forward 128 x 64 169 registers, no spill; dk/dv
# 128 keys x 32 query rows 255 registers, 100 bytes spilled (dk + dv accumulators alone are 128
# registers a thread; 64 rows: 340); dq 128 x 64 173 registers. D=64: forward 128 x 128 161,
# dk/dv 241, dq 123, none spilling. D=256 forward 128 x 64: 572 bytes spilled.
GPU_CFG = {
    "fwd": {(128, True): Cfg(64, 64, 4, 3), (128, False): Cfg(128, 64, 8, 3, tma=True),
            (64, True): Cfg(128, 64, 4, 3), (64, False): Cfg(128, 128, 8, 3, tma=True),
            (256, True): Cfg(64, 32, 4, 2), (256, False): Cfg(128, 64, 8, 2, tma=True)},
    "dkdv": {(128, True): Cfg(64, 64, 4, 2), (128, False): Cfg(32, 128, 8, 2, tma=True),
             (64, True): Cfg(64, 128, 8, 2), (64, False): Cfg(64, 128, 8, 2, tma=True)},
    "dq": {(128, True): Cfg(128, 64, 8, 3), (128, False): Cfg(128, 64, 8, 3, tma=True),
           (64, True): Cfg(128, 64, 8, 2), (64, False): Cfg(128, 64, 8, 3, tma=True)},
}
# FP8 forward by head dim, from a sweep on an H100 (2026-11-26, B4 S4096, V keys-contiguous):
# at D=128 128 x 128 tiles with 4 warps run 785 TFLOPS without a mask (128 x 64 at 8 warps, the
# bf16 speed mode's tiles: 572), 652 causal; at D=64 the same tiles are fastest too.
GPU_CFG["fwd_fp8"] = {128: Cfg(128, 128, 4, 3, tma=True), 64: Cfg(128, 128, 4, 3, tma=True)}
# the interpreter: small tiles (tail masks exercised at s = 16..48); tests may set tma=True
INTERP_CFG = Cfg(16, 16, 4, 1)


def _cfg(kind: str, d: int, split: bool, device_is_cuda: bool) -> Cfg:
    if not device_is_cuda:
        return INTERP_CFG
    table = GPU_CFG[kind]
    return table.get((d, split)) or table[(128 if d > 64 else 64, split)]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = True) -> bool:
    """Can this kernel run these bshd tensors? (dtype, head dims, GQA ratio); backward=False:
    the forward alone (which also takes head dim 256)."""
    dims = _HEAD_DIMS if backward else _HEAD_DIMS + (256,)
    return (q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in dims and k.shape[-1] == q.shape[-1]
            and v.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0] == v.shape[0]
            and k.shape[1] == v.shape[1] and k.shape[2] == v.shape[2]
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def deterministic(q: torch.Tensor, split: bool) -> bool:
    """Is the backward for q's head dim and device bit-reproducible (no atomic dq)?"""
    return not _cfg("dkdv", q.shape[-1], split, q.is_cuda).atomic_dq


def _check(q, k, v, out_dtype, name, backward=True):
    if not supported(q, k, v, backward):
        dims = _HEAD_DIMS if backward else _HEAD_DIMS + (256,)
        raise ValueError(f"flash_attention: unsupported q{tuple(q.shape)} {q.dtype}, "
                         f"k{tuple(k.shape)} {k.dtype}, v{tuple(v.shape)} {v.dtype} (bshd, same "
                         f"dtype in {_DTYPES}, head dim in {dims}"
                         f"{'' if backward else ' (forward)'}, d_v == d_qk, h % h_kv == 0)")
    if out_dtype not in (None, torch.float32, q.dtype):
        raise ValueError(f"flash_attention: {name}={out_dtype} must be None, torch.float32 or "
                         f"the input dtype {q.dtype}")
    return out_dtype or torch.float32


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _srcs(cfg: Cfg, *tensors):
    """(q, k, v[, dout]) as the kernels read them: with cfg.tma and a TMA-compatible layout for
    all (unit-stride d, heads packed, 16-byte aligned base and strides), TMA descriptors of
    each's [b, s, h * d] view with [1, rows, d] boxes (q / dout: block_m rows, k / v: block_n);
    else the tensors themselves (pointer loads). -> (sources, tma)."""
    descs = []
    for i, x in enumerate(tensors):
        b, s, h, d = x.shape
        sb, ss, sh, sd = x.stride()
        esz = x.element_size()
        if not (cfg.tma and sd == 1 and (sh == d or h == 1) and (sb * esz) % 16 == 0
                and (ss * esz) % 16 == 0 and x.data_ptr() % 16 == 0):
            return tensors, False
        rows = cfg.block_n if i in (1, 2) else cfg.block_m
        descs.append(TensorDescriptor(x, [b, s, h * d], [sb, ss, 1], [1, rows, d]))
    return tuple(descs), True


def _band(band, causal: bool, s_q: int, s_kv: int):
    """(WINDOW, CAUSAL, band_lo, band_hi) for the kernels: a band (lo, hi), None sides
    unbounded, key j visible to query i iff lo <= j - i <= hi, causal folded in as hi <= 0."""
    if band is None:
        return False, bool(causal), 0, 0
    lo, hi = band
    reach = s_q + s_kv  # past every key: unbounded
    lo = -reach if lo is None else max(int(lo), -reach)
    hi = reach if hi is None else min(int(hi), reach)
    if causal:
        hi = min(hi, 0)
    return True, False, lo, hi


class _Layout(NamedTuple):
    """A call's sequences: `batch` dense ones of (s_q, s_kv) rows, or (varlen) cu_q / cu_kv's
    packed ones, s_q / s_kv their longest, the tensors [t, h, d] seen as [1, t, h, d]."""
    batch: int
    s_q: int
    s_kv: int
    cu_q: Optional[torch.Tensor]
    cu_kv: Optional[torch.Tensor]


def _layout(q, k, varlen) -> _Layout:
    if varlen is None:
        return _Layout(q.shape[0], q.shape[1], k.shape[1], None, None)
    cu_q, cu_kv, s_q, s_kv = varlen
    for name, cu, t in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_kv", cu_kv, k.shape[0])):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != cu_q.numel() \
                or cu.device != q.device:
            raise ValueError(f"flash_attention: {name} must be int32 [batch + 1] on {q.device} "
                             "(the same batch for q and kv)")
    return _Layout(cu_q.numel() - 1, int(s_q), int(s_kv), cu_q, cu_kv)


def _batched(varlen, *tensors):
    """thd tensors [t, h, d] as [1, t, h, d] (dense ones as they are)."""
    return tensors if varlen is None else tuple(x.unsqueeze(0) for x in tensors)


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, split: bool = True,
                        out_dtype: Optional[torch.dtype] = None, band: Optional[tuple] = None,
                        varlen: Optional[tuple] = None):
    """-> (out [b, s_q, h, d] in out_dtype (None: fp32), lse fp32 [b, h, s_q], natural log).
    band (lo, hi): key j visible to query i iff lo <= j - i <= hi (a None side unbounded; with
    causal also j <= i): sliding windows and bottom-right alignment; only its key blocks run.
    varlen (cu_q, cu_kv, max_s_q, max_s_kv): packed sequences (thd): q [t_q, h, d], k / v
    [t_kv, h_kv, d], int32 cumulative lengths; masks and bands apply within each sequence;
    -> out [t_q, h, d], lse [h, t_q]."""
    lay = _layout(q, k, varlen)
    q, k, v = _batched(varlen, q, k, v)
    out_dtype = _check(q, k, v, out_dtype, "out_dtype", backward=False)
    b, t_q, h, d = q.shape
    t_kv, h_kv = k.shape[1], k.shape[2]
    window, causal, band_lo, band_hi = _band(band, causal, lay.s_q, lay.s_kv)
    out = torch.empty(b, t_q, h, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h, t_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or t_kv == 0 or lay.batch == 0:
        out, lse = out.zero_(), lse.fill_(float("-inf"))
    else:
        cfg = _cfg("fwd", d, split, q.is_cuda)
        srcs, tma = (q, k, v), False
        if varlen is None:
            srcs, tma = _srcs(cfg, q, k, v)
        grid = (triton.cdiv(lay.s_q, cfg.block_m), lay.batch * h)
        _fwd_kernel[grid](*srcs, out, lse, lse, lay.s_q, lay.s_kv, h, h // h_kv, scale * LOG2E,
                          *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
                          band_lo, band_hi, lay.cu_q if varlen else lse,
                          lay.cu_kv if varlen else lse, CAUSAL=causal, SPLIT=bool(split),
                          PREC=_prec(q.dtype), D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          TMA=tma, WS=cfg.ws and tma, WINDOW=window, VARLEN=varlen is not None,
                          num_warps=cfg.warps, num_stages=cfg.stages)
    return (out, lse) if varlen is None else (out[0], lse[0])


FP8_HEAD_DIMS = (64, 128)
FP8_DTYPES = (torch.float8_e4m3fn,)


def fp8_block_n(d: int, device_is_cuda: bool) -> int:
    """The FP8 forward's key tile (the twin's block_n) for head dim d."""
    return _fp8_cfg(d, device_is_cuda).block_n


def _fp8_cfg(d: int, device_is_cuda: bool) -> Cfg:
    return GPU_CFG["fwd_fp8"][d] if device_is_cuda else INTERP_CFG


def fp8_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can the FP8 forward run these bshd E4M3 tensors? (head dim 64/128, GQA ratio)"""
    return (q.dim() == k.dim() == v.dim() == 4 and q.dtype in FP8_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[-1] in FP8_HEAD_DIMS
            and k.shape[-1] == q.shape[-1] == v.shape[-1] and q.shape[0] == k.shape[0]
            and k.shape == v.shape and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def flash_attention_fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            descale: torch.Tensor, causal: bool, scale: float,
                            out_dtype: Optional[torch.dtype] = None,
                            block_n: Optional[int] = None, band: Optional[tuple] = None):
    """E4M3 q/k/v (bshd, any strides), descale fp32 [3] (q, k, v) -> (out [b, s_q, h, d] in
    out_dtype (None: fp32; or bf16 / fp16), lse fp32 [b, h, s_q]). block_n: the key tile
    (None: `fp8_block_n`); the twin takes the same to quantize P at the same running maxima.
    band: as `flash_attention_fwd`'s (the key blocks the band skips hold no visible key, so P
    is quantized at the same running maxima as the twin's walk over every block)."""
    if not fp8_supported(q, k, v):
        raise ValueError(f"flash_attention_fp8_fwd: unsupported q{tuple(q.shape)} {q.dtype}, "
                         f"k{tuple(k.shape)} {k.dtype}, v{tuple(v.shape)} {v.dtype} (bshd E4M3, "
                         f"head dim in {FP8_HEAD_DIMS}, h % h_kv == 0)")
    if (not isinstance(descale, torch.Tensor) or descale.shape != (3,)
            or descale.dtype != torch.float32 or descale.device != q.device):
        raise ValueError("flash_attention_fp8_fwd: descale must be a float32 [3] tensor (q, k, "
                         f"v dequant scales) on {q.device}")
    if out_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"flash_attention_fp8_fwd: out_dtype={out_dtype} must be None, float32, "
                         "bfloat16 or float16")
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    window, causal, band_lo, band_hi = _band(band, causal, s_q, s_kv)
    out = torch.empty(b, s_q, h, d, dtype=out_dtype or torch.float32, device=q.device)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or s_kv == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    cfg = _fp8_cfg(d, q.is_cuda)
    if block_n is not None:
        cfg = cfg._replace(block_n=int(block_n))
    if v.stride(1) != 1 and s_kv > 1:   # P @ V wants V's keys contiguous: one copy here
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    (q_src, k_src), tma = _srcs(cfg, q, k)
    v_src = _value_src(cfg, v) if tma else None
    if v_src is None:
        q_src, k_src, v_src, tma = q, k, v, False
    grid = (triton.cdiv(s_q, cfg.block_m), b * h)
    _fwd_kernel[grid](q_src, k_src, v_src, out, lse, descale, s_q, s_kv, h, h // h_kv,
                      scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                      *lse.stride(), band_lo, band_hi, lse, lse, CAUSAL=causal, SPLIT=False,
                      PREC="tf32", D=d, WINDOW=window,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, WS=cfg.ws and tma,
                      FP8=True, VT=True, num_warps=cfg.warps, num_stages=cfg.stages)
    return out, lse


def _value_src(cfg: Cfg, v: torch.Tensor):
    """A TMA descriptor of sequence-contiguous V's [b, h, d, s] view with [1, 1, d, block_n]
    boxes, or None where TMA cannot read it (16-byte aligned base and strides)."""
    b, s, h, d = v.shape
    sb, ss, sh, sd = v.stride()
    esz = v.element_size()
    if ss != 1 or v.data_ptr() % 16 or any((x * esz) % 16 for x in (sb, sh, sd)):
        return None
    return TensorDescriptor(v, [b, h, d, s], [sb, sh, sd, 1], [1, 1, d, cfg.block_n])


def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                        split: bool = True, grad_dtype: Optional[torch.dtype] = None,
                        band: Optional[tuple] = None, varlen: Optional[tuple] = None):
    """-> (dq, dk, dv) in grad_dtype (None: fp32), shaped like q, k, v. out (any float dtype)
    and lse (fp32 [b, h, s_q]; varlen: [h, t_q]) may be any pair for the same softmax rows
    (e.g. a CP ring's merged ones). band, varlen: as the forward's."""
    lay = _layout(q, k, varlen)
    dout, q, k, v, out = _batched(varlen, dout, q, k, v, out)
    if varlen is not None:
        lse = lse.unsqueeze(0)
    grad_dtype = _check(q, k, v, grad_dtype, "grad_dtype")
    b, t_q, h, d = q.shape
    t_kv, h_kv = k.shape[1], k.shape[2]
    window, causal, band_lo, band_hi = _band(band, causal, lay.s_q, lay.s_kv)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, h, t_q):
        raise ValueError("flash_attention_bwd: dout/out must be shaped like q and lse "
                         f"{'[h, t_q]' if varlen else '[b, h, s_q]'}")
    dev, f32 = q.device, torch.float32
    cuda = q.is_cuda
    dq_cfg, dkdv_cfg = _cfg("dq", d, split, cuda), _cfg("dkdv", d, split, cuda)
    atomic = dkdv_cfg.atomic_dq  # dq summed in fp32 over the key blocks: zeroed first
    dq = torch.empty(b, t_q, h, d, dtype=f32 if atomic else grad_dtype, device=dev)
    dk = torch.empty(b, t_kv, h_kv, d, dtype=grad_dtype, device=dev)
    dv = torch.empty(b, t_kv, h_kv, d, dtype=grad_dtype, device=dev)
    unbatch = (lambda *g: g) if varlen is None else (lambda *g: tuple(x[0] for x in g))
    if atomic or dq.numel() == 0 or dk.numel() == 0 or lay.batch == 0 or varlen is not None:
        dq.zero_()  # varlen: a row block past its sequence's end writes nothing
    if dq.numel() == 0 or dk.numel() == 0 or lay.batch == 0:
        return unbatch(dq.to(grad_dtype), dk.zero_(), dv.zero_())
    if varlen is not None:
        dk.zero_()
        dv.zero_()
    lse = lse.to(f32)
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    delta = torch.empty(b, h, t_q, dtype=f32, device=dev)
    _delta_kernel[(triton.cdiv(t_q, dq_cfg.block_m), b * h)](
        out, dout, delta, t_q, h, *out.stride(), *dout.stride(), D=d, BLOCK_M=dq_cfg.block_m,
        num_warps=4 if cuda else 1)
    cu_q, cu_kv = (lay.cu_q, lay.cu_kv) if varlen is not None else (delta, delta)
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), band_lo,
              band_hi, cu_q, cu_kv, t_q)
    flags = dict(CAUSAL=causal, SPLIT=bool(split), PREC=_prec(q.dtype), D=d, WINDOW=window,
                 VARLEN=varlen is not None)

    cfg = dkdv_cfg
    srcs, tma = ((q, k, v, dout), False) if varlen is not None else _srcs(cfg, q, k, v, dout)
    _dkdv_kernel[(triton.cdiv(lay.s_kv, cfg.block_n), lay.batch * h_kv)](
        *srcs, lse, delta, dk, dv, dq, lay.s_q, lay.s_kv, h_kv, h // h_kv,
        scale * LOG2E, scale, *common, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        TMA=tma, ATOMIC_DQ=atomic, num_warps=cfg.warps, num_stages=cfg.stages)
    if atomic:
        return unbatch(dq.to(grad_dtype), dk, dv)

    cfg = dq_cfg
    srcs, tma = ((q, k, v, dout), False) if varlen is not None else _srcs(cfg, q, k, v, dout)
    _dq_kernel[(triton.cdiv(lay.s_q, cfg.block_m), lay.batch * h)](
        *srcs, lse, delta, dq, lay.s_q, lay.s_kv, h, h // h_kv, scale * LOG2E, scale,
        *common, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return unbatch(dq, dk, dv)


def flops(b: int, s_q: int, s_kv: int, h: int, d: int, causal: bool, backward: bool = False):
    """Useful matmul FLOPs (2 per multiply-add; causal counts the visible half)."""
    f = 4.0 * b * h * s_q * s_kv * d * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


__all__ = ["flash_attention_fwd", "flash_attention_bwd", "flash_attention_fp8_fwd",
           "fp8_supported", "fp8_block_n", "supported", "deterministic", "flops",
           "Cfg", "GPU_CFG"]
