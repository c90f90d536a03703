"""Hopper (sm90) flash-attention backward in Gluon: the speed mode's backward where it applies.

`flash_attention_bwd` runs two kernels. `_dq_kernel` first, per
128-row query tile as the forward (K / V streamed): S = Q K^T and dP = dO V^T in a warpgroup's
first turn, dQ += dS K in its second; its prologue writes delta = rowsum(dO * out) of its rows.
Then `_dkdv_kernel`, one 128-key block per program: the loader brings K / V once and Q / dO per
(head of the GQA group, 64-row query block) into a 2-slot ring; each consumer warpgroup owns 64
keys (dK, dV accumulators of 64 x 128 in fp32) and, in its turn, issues S^T = K Q^T and
dP^T = V dO^T, then (P^T, dS^T rounded to 16 bits, as the Triton speed mode) dV += P^T dO and
dK += dS^T Q. 7 products per tile pair in all (as the Triton backward; no atomics).
The loader warp, the two consumer warpgroups (240 registers each), the turn mbarriers and the
K / V ring are the forward's (`flash_attention_sm90`, which also holds `applies`, `ENABLED` and
the descriptors). Contract: `applies_bwd`; grads in the input dtype or fp32 (`_store_half`),
shaped like q, k, v.
Twin: `tritium.ref.flash_attention.flash_attention_bwd` (the GPU tier compares them; Gluon
does not run under TRITON_INTERPRET). Measured on an H200 (B4 H32 S4096 D128, causal / no
mask): dQ 1.40 / 2.55 ms, dK/dV 2.03 / 3.77 ms, the backward 3.48 / 6.32 ms against cuDNN's
3.00 / 5.34 (docs/attention.md, "The Hopper kernels in Gluon").
"""
from __future__ import annotations

import torch

from .flash_attention_sm90 import (
    BLOCK_M, BLOCK_N, CONSUMER_REGS, LOADER_REGS, LOG2E, STAGES, _desc, _descriptors, applies,
    gluon, launch_grid, output, tma_view)

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

    from .flash_attention_sm90 import _grouped, _kv_ring, _store_half, _stream_kv, _tile

# --------------------------------------------------------------------------------------------
# dK / dV of one 128-key block (two warpgroups of 64 keys), Q / dO streamed

BWD_BLOCK_M, BWD_STAGES = 64, 2

if gluon is not None:
    @gluon.jit
    def _dkdv_loader(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar,
                     q_ready, q_empty, off_b, n0, kv_col, q_col0, G, i_start, n_qblocks):
        """K / V of the key block once, then Q and dO of each (head of the group, query block)
        into ring slot it % stages once both consumers released it."""
        NSTAGE: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = q_smem.shape[2]
        D: gl.constexpr = q_smem.shape[3]
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, n0, kv_col], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [off_b, n0, kv_col], kv_bar, v_smem)
        it = 0
        for g in range(G):
            for i in range(i_start, n_qblocks):
                st = it % NSTAGE
                mbarrier.wait(q_empty.index(st), ((it // NSTAGE) & 1) ^ 1)
                mbarrier.expect(q_ready.index(st),
                                q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [off_b, i * BM, q_col0 + g * D],
                                                q_ready.index(st), q_smem.index(st))
                tma.async_copy_global_to_shared(do_desc, [off_b, i * BM, q_col0 + g * D],
                                                q_ready.index(st), do_smem.index(st))
                it += 1

    @gluon.jit
    def _dkdv_step(q_smem, k_half, v_half, do_smem, q_ready, q_empty, turn, lse_ptr, delta_ptr,
                   lse_base, m, it, dk, dv, keys, cols, S_Q, qk_scale, HALF: gl.constexpr,
                   MASK: gl.constexpr):
        """One query block (rows m.., ring slot it % stages) into this warpgroup's dK, dV."""
        NSTAGE: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = q_smem.shape[2]
        D: gl.constexpr = q_smem.shape[3]
        HN: gl.constexpr = k_half.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                     k_width=2)
        st = it % NSTAGE
        # rows past S_Q: their Q and dO rows are TMA's zeros, so whatever P they get adds
        # nothing to dV or dK; their lse / delta are read at the last row (a mask spills)
        rows = gl.minimum(m + cols, S_Q - 1)
        lse = gl.load(lse_ptr + lse_base + rows)
        lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = gl.load(delta_ptr + lse_base + rows)
        q_t = q_smem.index(st).reshape([BM, D])
        do_t = do_smem.index(st).reshape([BM, D])
        zero_s = gl.zeros([HN, BM], gl.float32, layout=s_layout)
        mbarrier.wait(q_ready.index(st), (it // NSTAGE) & 1)
        mbarrier.wait(turn.index(HALF), 1 - HALF)      # this warpgroup's turn (1 / 2)
        st_acc = warpgroup_mma(k_half, q_t.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        dpt_acc = warpgroup_mma(v_half, do_t.permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(st_acc, dpt_acc))
        if MASK:   # key j seen by row i iff j <= i (this form: 180 bytes spilled, not 2.6 KB)
            s_t = gl.where(cols[None, :] >= (keys - m)[:, None], s_t, -float("inf"))
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        ds_t = p_t * (dp_t - delta[None, :])
        p16 = gl.convert_layout(p_t.to(dtype), a_layout)
        ds16 = gl.convert_layout(ds_t.to(dtype), a_layout)
        mbarrier.wait(turn.index(HALF), HALF)          # this warpgroup's turn (2 / 2)
        dv = warpgroup_mma(p16, do_t, dv, is_async=True)
        dk = warpgroup_mma(ds16, q_t, dk, is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(st), count=1)
        return warpgroup_mma_init(dk), warpgroup_mma_init(dv)

    @gluon.jit
    def _store_dkdv(dk, dv, k_smem, v_smem, dk_dst, dv_dst, S_KV, kv_ss, off_b, n0, kv_col,
                    HALF: gl.constexpr):
        """This warpgroup's keys of dK, dV (fp32, final; the keys below S_KV): 16-bit through
        its half of the K / V buffers (no longer read) by TMA, fp32 from registers."""
        _store_half(dk, k_smem, dk_dst, off_b, n0, kv_col, S_KV, kv_ss, HALF)
        _store_half(dv, v_smem, dv_dst, off_b, n0, kv_col, S_KV, kv_ss, HALF)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dkdv_consumer(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale, HALF: gl.constexpr,
                       CAUSAL: gl.constexpr):
        """One warpgroup's 64 keys of the block: S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO,
        dK += dS^T Q, each pair of products issued in this warpgroup's turn."""
        BM: gl.constexpr = q_smem.shape[2]
        D: gl.constexpr = q_smem.shape[3]
        BN: gl.constexpr = k_smem.shape[1]
        HN: gl.constexpr = BN // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        k_half = k_smem.reshape([BN, D]).slice(HALF * HN, HN)
        v_half = v_smem.reshape([BN, D]).slice(HALF * HN, HN)
        keys = n0 + HALF * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
        dk = warpgroup_mma_init(gl.zeros([HN, D], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([HN, D], gl.float32, layout=acc_layout))
        mbarrier.wait(kv_bar, 0)
        it = 0
        for g in range(G):
            lse_base = lse_base0 + g * S_Q
            if CAUSAL:   # the diagonal's query blocks first, masked: key j seen by row i iff j <= i
                i_free = gl.minimum(i_start + BN // BM, n_qblocks)
                for i in range(i_start, i_free):
                    dk, dv = _dkdv_step(q_smem, k_half, v_half, do_smem, q_ready, q_empty, turn,
                                        lse_ptr, delta_ptr, lse_base, i * BM, it, dk, dv, keys,
                                        cols, S_Q, qk_scale, HALF, True)
                    it += 1
            else:
                i_free = i_start
            for i in range(i_free, n_qblocks):
                dk, dv = _dkdv_step(q_smem, k_half, v_half, do_smem, q_ready, q_empty, turn,
                                    lse_ptr, delta_ptr, lse_base, i * BM, it, dk, dv, keys, cols,
                                    S_Q, qk_scale, HALF, False)
                it += 1
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        _store_dkdv(dk * scale, dv, k_smem, v_smem, dk_dst, dv_dst, S_KV, kv_ss, off_b, n0, kv_col,
                    HALF)

    @gluon.jit
    def _keys_0(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem, do_smem,
                kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q, G, i_start,
                n_qblocks, qk_scale, scale):
        _dkdv_consumer(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale, 0, False)

    @gluon.jit
    def _keys_1(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem, do_smem,
                kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q, G, i_start,
                n_qblocks, qk_scale, scale):
        _dkdv_consumer(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale, 1, False)

    @gluon.jit
    def _keys_0_causal(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale):
        _dkdv_consumer(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale, 0, True)

    @gluon.jit
    def _keys_1_causal(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale):
        _dkdv_consumer(dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                       do_smem, kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q,
                       G, i_start, n_qblocks, qk_scale, scale, 1, True)

    @gluon.jit
    def _q_ring(q_desc, do_desc, k_desc, v_desc, BM: gl.constexpr, BN: gl.constexpr,
                D: gl.constexpr, NSTAGE: gl.constexpr):
        """A key block's shared memory: the Q / dO ring, K / V of the block and their
        mbarriers (each ring slot released by both consumers), the consumers' turns,
        initialized."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [1, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, BN, D], v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for s in gl.static_range(NSTAGE):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=2)
        return q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, turn

    @gluon.jit
    def _key_block(S_KV, H_KV, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """This key-block program's (batch, kv head, first key, first query block to visit);
        causal (a 1D grid, `_grouped`): the longest key blocks (the first) first, and the query
        blocks wholly above the diagonal skipped."""
        if CAUSAL:
            pid_n, pid_bh = _grouped(gl.cdiv(S_KV, BN))
        else:
            pid_n = gl.program_id(0)
            pid_bh = gl.program_id(1)          # (batch, kv head)
        n0 = pid_n * BN
        if CAUSAL:
            i_start = n0 // BM
        else:
            i_start = 0
        return pid_bh // H_KV, pid_bh % H_KV, n0, i_start

    @gluon.jit
    def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_dst, dv_dst, kv_ss, lse_ptr,
                     delta_ptr, S_Q, S_KV, H_KV, G, qk_scale, scale, CAUSAL: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                     NSTAGE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
        off_b, off_hk, n0, i_start = _key_block(S_KV, H_KV, BM, BN, CAUSAL)
        n_qblocks = gl.cdiv(S_Q, BM)

        q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, turn = _q_ring(
            q_desc, do_desc, k_desc, v_desc, BM, BN, D, NSTAGE)

        kv_col = off_hk * D
        lse_base0 = (off_b * H_KV * G + off_hk * G) * S_Q
        args = (dk_dst, dv_dst, S_KV, kv_ss, lse_ptr, delta_ptr, q_smem, k_smem, v_smem, do_smem,
                kv_bar, q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, S_Q, G, i_start,
                n_qblocks, qk_scale, scale)
        load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar,
                     q_ready, q_empty, off_b, n0, kv_col, off_hk * G * D, G, i_start,
                     n_qblocks)
        if CAUSAL:
            gl.warp_specialize([(_keys_0_causal, args), (_keys_1_causal, args),
                                (_dkdv_loader, load_args)], [4, 1],
                               [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([(_keys_0, args), (_keys_1, args), (_dkdv_loader, load_args)],
                               [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _bwd_descriptors(q, k, v, dout):
    """[b * s, h * d] views: q / dout boxes of BWD_BLOCK_M rows, k / v of BLOCK_N."""
    return (_desc(q, BWD_BLOCK_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(dout, BWD_BLOCK_M))


def _grad(x: torch.Tensor, grad_dtype) -> torch.Tensor:
    """x's gradient, empty: 16-bit in x's memory layout, fp32 contiguous (`output`)."""
    if grad_dtype == torch.float32:
        return torch.empty(x.shape, dtype=grad_dtype, device=x.device)
    return torch.empty_like(x)


def dkdv_outputs(k, v, grad_dtype):
    """(dk, dv) in grad_dtype and their kernel arguments (dk, dv destinations with boxes of
    half a key block: each consumer stores its own keys; the fp32 ones' row stride)."""
    dk, dv = _grad(k, grad_dtype), _grad(v, grad_dtype)
    return (dk, dv), (output(dk, BLOCK_N // 2), output(dv, BLOCK_N // 2), dk.stride(1))


def _dkdv(q, k, v, dout, lse, delta, causal: bool, scale: float, grad_dtype):
    """dK, dV (grad_dtype: q's or fp32; shaped like k / v); lse, delta fp32 [b, h, s_q]
    contiguous."""
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    grads, dsts = dkdv_outputs(k, v, grad_dtype)
    grid = launch_grid(-(-s_kv // BLOCK_N), b * h_kv, causal)
    _dkdv_kernel[grid](*_bwd_descriptors(q, k, v, dout), *dsts, lse, delta, s_q, s_kv, h_kv,
                       h // h_kv, scale * LOG2E, scale, CAUSAL=bool(causal), BM=BWD_BLOCK_M,
                       BN=BLOCK_N, D=d, NSTAGE=BWD_STAGES, CONSUMER_REGS=CONSUMER_REGS,
                       LOADER_REGS=LOADER_REGS, num_warps=4)
    return grads


# --------------------------------------------------------------------------------------------
# dQ of one 128-row query tile (two warpgroups of 64 rows), K / V streamed

if gluon is not None:
    @gluon.jit
    def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar,
                   k_ready, v_ready, k_empty, v_empty, off_b, m0, q_col, kv_col, n_blocks):
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, m0, q_col], q_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [off_b, m0, q_col], q_bar, do_smem)
        _stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b,
                   kv_col, n_blocks)

    @gluon.jit
    def _dq_step(q_half, do_half, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, j,
                 dq, lse, delta, rows, cols, qk_scale, HALF: gl.constexpr, MASK: gl.constexpr):
        """Key block j into this warpgroup's dQ: S = Q K^T and dP = dO V^T in its first turn,
        dQ += dS K in its second."""
        NSTAGE: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[2]
        D: gl.constexpr = k_smem.shape[3]
        HM: gl.constexpr = q_half.shape[0]
        dtype: gl.constexpr = q_half.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                     k_width=2)
        st = j % NSTAGE
        ph = (j // NSTAGE) & 1
        zero_s = gl.zeros([HM, BN], gl.float32, layout=s_layout)
        k_t = k_smem.index(st).reshape([BN, D])
        v_t = v_smem.index(st).reshape([BN, D])
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.wait(v_ready.index(st), ph)
        mbarrier.wait(turn.index(HALF), 1 - HALF)      # this warpgroup's turn (1 / 2)
        s_acc = warpgroup_mma(q_half, k_t.permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        dp_acc = warpgroup_mma(do_half, v_t.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, dp_acc))
        mbarrier.arrive(v_empty.index(st), count=1)
        if MASK:   # key j seen by row i iff j <= i
            s = gl.where((j * BN + cols)[None, :] <= rows[:, None], s, -float("inf"))
        p = gl.exp2(s * qk_scale - lse[:, None])
        ds16 = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), a_layout)
        mbarrier.wait(turn.index(HALF), HALF)          # this warpgroup's turn (2 / 2)
        dq = warpgroup_mma(ds16, k_t, dq, is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(k_empty.index(st), count=1)
        return warpgroup_mma_init(dq)

    @gluon.jit
    def _dq_consumer(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                     k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, q_col,
                     m0, lse_off, S_Q, n_blocks, qk_scale, scale, HALF: gl.constexpr,
                     CAUSAL: gl.constexpr):
        BM: gl.constexpr = q_smem.shape[1]
        BN: gl.constexpr = k_smem.shape[2]
        D: gl.constexpr = k_smem.shape[3]
        HM: gl.constexpr = BM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        q_half = q_smem.reshape([BM, D]).slice(HALF * HM, HM)
        do_half = do_smem.reshape([BM, D]).slice(HALF * HM, HM)
        r0 = m0 + HALF * HM
        rows = r0 + gl.arange(0, HM, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        inside = gl.minimum(rows, S_Q - 1)   # rows past S_Q: computed, not stored
        lse = gl.load(lse_ptr + lse_off + inside)
        lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        mbarrier.wait(q_bar, 0)
        # delta = rowsum(dO * out) of this half's rows, stored for the dK / dV kernel (run
        # after this one): out read from global memory, dO from the tile in shared memory
        o_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        o_rows = r0 + gl.arange(0, HM, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        o_at = gl.minimum(o_rows, S_Q - 1).to(gl.int64) * o_ss
        o = gl.load(o_ptr + o_base + o_at[:, None] + o_cols[None, :]).to(gl.float32)
        delta = gl.sum(o * do_half.load(o_layout).to(gl.float32), axis=1)
        gl.store(delta_ptr + lse_off + o_rows, delta, mask=o_rows < S_Q)
        delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
        dq = warpgroup_mma_init(gl.zeros([HM, D], gl.float32, layout=acc_layout))
        if CAUSAL:
            n_free = gl.minimum(r0 // BN, n_blocks)   # key blocks wholly visible to the half
        else:
            n_free = n_blocks
        for j in range(n_free):
            dq = _dq_step(q_half, do_half, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                          turn, j, dq, lse, delta, rows, cols, qk_scale, HALF, False)
        for j in range(n_free, n_blocks):
            dq = _dq_step(q_half, do_half, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                          turn, j, dq, lse, delta, rows, cols, qk_scale, HALF, True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        _store_half(dq * scale, q_smem, dq_dst, off_b, m0, q_col, S_Q, dq_ss, HALF)  # Q read
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dq_rows_0(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                   k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b,
                   q_col, m0, lse_off, S_Q, n_blocks, qk_scale, scale):
        _dq_consumer(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                     k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, q_col,
                     m0, lse_off, S_Q, n_blocks, qk_scale, scale, 0, False)

    @gluon.jit
    def _dq_rows_1(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                   k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b,
                   q_col, m0, lse_off, S_Q, n_blocks, qk_scale, scale):
        _dq_consumer(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                     k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, q_col,
                     m0, lse_off, S_Q, n_blocks, qk_scale, scale, 1, False)

    @gluon.jit
    def _dq_rows_0_causal(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                          k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b,
                          q_col, m0, lse_off, S_Q, n_blocks, qk_scale, scale):
        _dq_consumer(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                     k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, q_col,
                     m0, lse_off, S_Q, n_blocks, qk_scale, scale, 0, True)

    @gluon.jit
    def _dq_rows_1_causal(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                          k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b,
                          q_col, m0, lse_off, S_Q, n_blocks, qk_scale, scale):
        _dq_consumer(dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem,
                     k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, q_col,
                     m0, lse_off, S_Q, n_blocks, qk_scale, scale, 1, True)

    @gluon.jit
    def _dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_sb,
                   o_ss, o_sh, S_Q, S_KV, H, G, qk_scale, scale, CAUSAL: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NSTAGE: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        pid_bh, off_b, off_h, m0, n_blocks = _tile(S_Q, S_KV, H, BM, BN, CAUSAL)

        q_smem = gl.allocate_shared_memory(dtype, [1, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [1, BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BN, D], v_desc.layout)
        q_bar, k_ready, v_ready, k_empty, v_empty, turn = _kv_ring(NSTAGE)

        o_base = off_b.to(gl.int64) * o_sb + off_h.to(gl.int64) * o_sh
        args = (dq_dst, dq_ss, lse_ptr, delta_ptr, o_ptr, o_base, o_ss, q_smem, do_smem, k_smem,
                v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, off_b, off_h * D, m0,
                pid_bh * S_Q, S_Q, n_blocks, qk_scale, scale)
        load_args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar,
                     k_ready, v_ready, k_empty, v_empty, off_b, m0, off_h * D,
                     (off_h // G) * D, n_blocks)
        if CAUSAL:
            gl.warp_specialize([(_dq_rows_0_causal, args), (_dq_rows_1_causal, args),
                                (_dq_loader, load_args)], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([(_dq_rows_0, args), (_dq_rows_1, args), (_dq_loader, load_args)],
                               [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _dq(q, k, v, out, dout, lse, delta, causal: bool, scale: float, grad_dtype):
    """dQ (grad_dtype: q's or fp32); writes delta = rowsum(dO * out) for `_dkdv`."""
    b, s_q, h, d = q.shape
    dq = _grad(q, grad_dtype)
    grid = launch_grid(-(-s_q // BLOCK_M), b * h, causal)
    q_desc, k_desc, v_desc = _descriptors(q, k, v)
    _dq_kernel[grid](q_desc, _desc(dout, BLOCK_M), k_desc, v_desc, output(dq, BLOCK_M // 2),
                     dq.stride(1), lse, delta, out, out.stride(0), out.stride(1), out.stride(2),
                     s_q, k.shape[1], h, h // k.shape[2], scale * LOG2E, scale,
                     CAUSAL=bool(causal), BM=BLOCK_M, BN=BLOCK_N, D=d, NSTAGE=STAGES,
                     CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4)
    return dq


def applies_bwd(q, k, v, out, dout, lse, grad_dtype) -> bool:
    """Can `flash_attention_bwd` run the speed-mode backward of these (grads in grad_dtype:
    q's or fp32)?"""
    return (applies(q, k, v, grad_dtype) and dout.dtype == q.dtype and tma_view(dout)
            and out.stride(-1) == 1 and lse.dtype == torch.float32 and lse.is_contiguous())


def flash_attention_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, grad_dtype=None):
    """(dq, dk, dv) in grad_dtype (None: q's; fp32: never rounded to 16 bits) where
    `applies_bwd`: the dQ kernel first (it also writes delta = rowsum(dO * out)), then the
    dK / dV kernel."""
    grad_dtype = grad_dtype or q.dtype
    delta = torch.empty_like(lse)
    dq = _dq(q, k, v, out, dout, lse, delta, causal, scale, grad_dtype)
    return (dq, *_dkdv(q, k, v, dout, lse, delta, causal, scale, grad_dtype))
