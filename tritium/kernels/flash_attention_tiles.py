"""Device code of the Triton flash attention (launchers, configs and the contract:
`tritium.kernels.flash_attention`).

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

FP8 forward (`flash_attention_fp8_fwd`, the FP8 constexpr; recipe fp8_dpa): q, k, v in E4M3
with a dequant scale each (descale fp32 [3] on the device, read by the kernel: no host sync).
S = tl.dot on the E4M3 tiles (native wgmma on sm90, whose E4M3 accumulator keeps fewer bits
than fp32: the GPU test measures the kernel against exact attention, not bit for bit), the q
and k descales folded into qk_scale; online softmax in fp32 as above; P (in [0, 1], relative to
the running max) times P_SCALE = 448 rounded to E4M3 for an E4M3 P @ V, the scale folded into
the exponent (exp2(s - (m - log2 448)): no multiply per score), so l carries it too; out =
acc * dv / l, written in out_dtype; lse from the unquantized P, log2 448 taken off. E4M3
wgmma reads both operands K-major, so P @ V wants V with the keys contiguous (VT: the layer's
cast writes V that way, in the same pass; the wrapper copies any other V once); read as
[d, keys] tiles and transposed as a view, it ran 3.3x faster than row-major V (H100, 238 -> 785
TFLOPS). Twin: `ref.flash_attention.flash_attention_fp8_fwd` with block_n = `fp8_block_n(...)`
(P's quantization depends on the key tiling). No FP8 backward: the attention layer runs the
backward above on the dequantized inputs.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .cast import _nan_max, _scaled_fp8

LOG2E = 1.4426950408889634
LOG2_P_SCALE = tl.constexpr(math.log2(448.0))  # the FP8 forward's P scale as an exponent


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
    """acc + P @ V: FP8 rounds p (P * 448 already: `_exp_base`) to v's E4M3."""
    if FP8:
        return tl.dot(p.to(v.dtype), v, acc)
    else:
        return _mm(p, v, acc, SPLIT, PREC)


@triton.jit
def _exp_base(m, FP8: tl.constexpr):
    """What P = exp2(s - base) subtracts for row max m: the FP8 forward's P comes out times
    P_SCALE = 448 (base m - log2 448, no multiply per score), else m."""
    if FP8:
        return m - LOG2_P_SCALE
    else:
        return m


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
def _dense_blocks(start_m, s_kv, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """(full, end): key blocks [0, full) every row of the tile starting at start_m sees whole
    (no mask), [full, end) the causal diagonal band and the key tail (masked); causal key
    blocks past the diagonal are never visited."""
    if CAUSAL:
        return ((tl.minimum(start_m, s_kv) // BLOCK_N) * BLOCK_N,
                tl.minimum(s_kv, start_m + BLOCK_M))
    else:
        return (s_kv // BLOCK_N) * BLOCK_N, s_kv


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
    p = tl.exp2(s - _exp_base(m_use, FP8)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _pv(p, v, acc * alpha[:, None], SPLIT, PREC, FP8)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(q_src, k_src, v_src, o_ptr, lse_ptr, descale_ptr,
                s_q, s_kv, H, G, qk_scale,
                sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                sob, sos, soh, sod, slb, slh, sls, band_lo, band_hi, cu_q_ptr, cu_k_ptr,
                o8_ptr, s8b, s8s, s8h, s8d, o8_scale_ptr, o8_amax_ptr,
                CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TMA: tl.constexpr, WS: tl.constexpr, FP8: tl.constexpr = False,
                VT: tl.constexpr = False, WINDOW: tl.constexpr = False,
                VARLEN: tl.constexpr = False, O8: tl.constexpr = False,
                O8_AMAX: tl.constexpr = False, O_HP: tl.constexpr = True):
    """out (in o_ptr's dtype) and lse (fp32, natural log) for BLOCK_M query rows of one head;
    FP8: E4M3 q/k/v with descale_ptr -> fp32 [3] (q, k, v dequant scales); VT: v is
    sequence-contiguous (`_value_rows`); WINDOW: key j visible to query i iff
    band_lo <= j - i <= band_hi (CAUSAL off); VARLEN: axis 1 is (sequence, head) of a packed
    batch (cu_q_ptr / cu_k_ptr: cumulative lengths; s_q the longest), pointers, no TMA.
    O8 (fp8_mha): out also in E4M3 at o8_ptr (strides s8*): the fp32 out times o8_scale_ptr's
    scale, saturated, rounded once; O8_AMAX: this program's max|out| (fp32) at o8_amax_ptr
    [program], for the host to reduce; O_HP=False: no 16-bit out (no backward needs it)."""
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
        full, hi = _dense_blocks(start_m, s_kv, CAUSAL, BLOCK_M, BLOCK_N)
        # key blocks every row of this tile sees whole: no mask
        for n0 in tl.range(0, full, BLOCK_N, warp_specialize=WS):
            k = _rows(k_src, b, hk, skb, skh, sks, skd, n0, s_kv, offs_d, False, TMA, BLOCK_N, D)
            v = _value_rows(v_src, b, hk, svb, svh, svs, svd, n0, s_kv, offs_d, False, TMA, VT,
                            BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * qk_scale - _exp_base(m_new, FP8)[:, None])  # one FMA per score
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

    if FP8:  # l_i and acc carry P_SCALE (their ratio does not)
        acc = acc * tl.load(descale_ptr + 2)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if O8 and O8_AMAX:   # this program's max|out| = max over rows of max|acc| / l (division
        # keeps order), reduced before out exists (no tile-sized temporary); NaN propagates
        row_max = tl.reduce(tl.abs(acc), 1, _nan_max) / l_safe
        tl.store(o8_amax_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                 tl.reduce(row_max, 0, _nan_max))
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (_exp_base(m_i, FP8) + tl.log2(l_safe)) * 0.6931471805599453,
                   float("-inf"))
    if O_HP:
        tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    if O8:
        x8 = _scaled_fp8(out, tl.load(o8_scale_ptr), m_ok[:, None], 448.0,
                         o8_ptr.dtype.element_ty)
        tl.store(o8_ptr + b * s8b + h * s8h + offs_m[:, None] * s8s + offs_d[None, :] * s8d,
                 x8, mask=m_ok[:, None])
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
        full, hi = _dense_blocks(start_m, s_kv, CAUSAL, BLOCK_M, BLOCK_N)
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
