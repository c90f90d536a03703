"""Hopper (sm90) flash-attention backward in one Gluon kernel (no mask or top-left causal): dK,
dV and dQ, 5 products per tile pair (the two-kernel backward in `flash_attention_sm90_bwd`
does 7).

One program per 128-key block, as that file's `_dkdv_kernel` (its loader: K / V once, Q / dO
per 64-row query block into a 2-slot ring; two consumer warpgroups of 64 keys each, ping-pong
turns), but oriented as FlashAttention-3's backward: a warpgroup computes S = Q K^T and
dP = dO V^T for its keys in its first turn (so lse and delta are two values a thread), writes
P and dS (rounded to 16 bits, as the speed mode) to shared memory, and in its second turn
issues dV += P^T dO, dK += dS^T Q and dQ[:, its 64 columns of d] = scale * dS K over both
warpgroups' keys of the previous query block (the other warpgroup's dS of the current block
may not be stored yet). That dQ is summed into an fp32 dQ in global memory by a TMA reduce-add
(`cp.reduce.async.bulk.tensor .add`, element-wise atomic; Gluon 3.6 has the op but no Python
name: `_tma_reduce_add`), then cast to the input dtype. delta = rowsum(dO * out) and the
zeroed fp32 dQ come first (or the caller's: a CP rank passes one delta and one fp32 dQ to all
its blocks, dQ summed in place). The order of the fp32 adds varies between runs: dQ is not
bit-reproducible (dK, dV are), so under torch.use_deterministic_algorithms the dispatch
(`flash_attention.flash_attention_bwd`) takes the two-kernel backward.
Barriers: ds_full (both halves of a dS buffer stored), ds_free (both dQ products that read it
done), kv_free (both warpgroups' last dQ product, which reads all of K, done before K / V's
shared memory holds dK / dV for their TMA stores).
Top-left causal: a key block's program starts at the query block of its diagonal (the
diagonal's two 64-row blocks masked, key j seen by row i iff j <= i), the longest key blocks
first (`_grouped`). The dispatch takes this kernel without a mask and for causal MHA; causal
GQA keeps the two kernels. Measured on an H200 (backward alone, interleaved rounds,
`bench_flash_attention.py --kernels --cp`): B4 H32 S4096 D128 no mask 5.69 vs 6.31 ms (two
kernels), causal 3.19 vs 3.47; GQA-8 no mask 6.05 vs 6.44, causal 3.64 vs 3.36 (slower); one
cp=2 rank's blocks at S=32768 (B1 H12): causal 16384 x 16384 4.20 vs 4.73, no mask 8192 x
16384 4.07 vs 4.65. Since the overlaps of `_step` (2026-11-30, fp32 dK/dV, paired with the
kernel before them): no mask 1.06x (B4 H32 S4096 5.27 ms), 1.06x / 1.08x at the cp=2 blocks
8192 x 16384 / 16384 x 8192 (3.83 / 3.80 ms); causal 1.03x.
Twin: `tritium.ref.flash_attention.flash_attention_bwd` (the GPU tier compares them).
"""
from __future__ import annotations

import torch

from .flash_attention_sm90 import BLOCK_N, CONSUMER_REGS, LOADER_REGS, LOG2E, gluon, launch_grid
from .flash_attention_sm90_bwd import (BWD_BLOCK_M, BWD_STAGES, _bwd_descriptors,
                                       dkdv_outputs)
from .flash_attention_tiles import _delta_kernel

try:  # the TMA reduce-add of Triton 3.6's Gluon builder (no Python wrapper there)
    from triton._C.libtriton import ir as _ir
    from triton._C.libtriton.gluon_ir import GluonOpBuilder as _Builder
    AVAILABLE = (gluon is not None and hasattr(_Builder, "create_async_tma_reduce")
                 and hasattr(_ir, "DESCRIPTOR_REDUCE_KIND"))
except ImportError:  # pragma: no cover - other Triton builds
    AVAILABLE = False

if AVAILABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc

    from .flash_attention_sm90_bwd import _dkdv_loader, _key_block, _q_ring, _store_dkdv

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[box at coord] += src (shared memory), one TMA bulk reduction."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)

    @gluon.jit
    def _dq_reduce(dq, dq_smem, dq_desc, off_b, row, col, HALF: gl.constexpr):
        """This warpgroup's dQ columns of the query block at row into global dQ (fp32)."""
        BM: gl.constexpr = dq_smem.shape[2]
        HD: gl.constexpr = dq_smem.shape[3]
        tma.store_wait(pendings=0)        # the previous reduce has read this buffer
        dq_smem.index(HALF).reshape([BM, HD]).store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [off_b, row, col + HALF * HD], dq_smem.index(HALF))

    @gluon.jit
    def _dq_product(ds_smem, buf, k_cols):
        """dS (a query block by both warpgroups' keys) K[:, this warpgroup's columns of d]."""
        BM: gl.constexpr = ds_smem.shape[1]
        HD: gl.constexpr = k_cols.shape[1]
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HD, 16])
        return warpgroup_mma(ds_smem.index(buf), k_cols,
                             gl.zeros([BM, HD], gl.float32, layout=dq_layout), use_acc=False,
                             is_async=True)

    @gluon.jit
    def _step(q_smem, k_half, v_half, do_smem, k_cols, p_smem, ds_smem, ds_full, ds_free,
              dq_smem, dq_desc, q_ready, q_empty, turn, lse_ptr, delta_ptr, lse_base, m, q_col,
              it, dk, dv, S_Q, qk_scale, scale, off_b, p_row, p_col, n0, HALF: gl.constexpr,
              MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """Query block `it` (rows m.., ring slot it % stages) into this warpgroup's dK, dV;
        block it - 1's dQ (rows p_row.., columns p_col..) into global dQ. MASK: a block on
        the causal diagonal (key j seen by row i iff j <= i; the key block starts at n0).
        lse and delta are loaded before the waits (H200: 1.03x causal). Without a mask (not
        CAUSAL) more overlaps the tensor cores: P's exponentials run while dP is still
        computing, and block it - 1's dQ product is issued first so that its reduce runs under
        dV and dK (with the loads 1.06-1.08x; causal 0.96x: it keeps the plain order)."""
        NSTAGE: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = q_smem.shape[2]
        D: gl.constexpr = q_smem.shape[3]
        HN: gl.constexpr = k_half.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 16])
        st = it % NSTAGE
        q_t = q_smem.index(st).reshape([BM, D])
        do_t = do_smem.index(st).reshape([BM, D])
        zero_s = gl.zeros([BM, HN], gl.float32, layout=s_layout)
        # rows past S_Q: their Q and dO rows are TMA's zeros, so whatever P they get adds
        # nothing to dV or dK, and their dQ rows are not written; lse / delta of the last row
        rows = gl.minimum(m + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout)), S_Q - 1)
        lse = gl.load(lse_ptr + lse_base + rows)       # in flight during the waits
        delta = gl.load(delta_ptr + lse_base + rows)
        mbarrier.wait(q_ready.index(st), (it // NSTAGE) & 1)
        mbarrier.wait(turn.index(HALF), 1 - HALF)      # this warpgroup's turn (1 / 2)
        s = warpgroup_mma(q_t, k_half.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_half.permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        if CAUSAL:
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        else:
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if MASK:
            keys = n0 + HALF * HN - m + gl.arange(0, HN, layout=gl.SliceLayout(0, s_layout))
            r = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))   # rows from m
            s = gl.where(keys[None, :] <= r[:, None], s, -float("inf"))
        p = gl.exp2(s * qk_scale - lse[:, None])
        if not CAUSAL:
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - delta[:, None])
        # dS buffers alternate; block it's needs block it - 2's dQ products done. The
        # barriers' phase: a fresh one passes parity 1 at once, which is what block 0's
        # wait and the first step's dQ product (of buffer 1, reduced into rows past S_Q:
        # dropped) need
        buf = it % 2
        pbuf = 1 - buf
        phase = ((it + 1) // 2 + 1) & 1
        p_half = p_smem.index(HALF)
        ds_half = ds_smem.index(buf).slice(HALF * HN, HN, dim=1)
        p_half.store(p.to(dtype))
        mbarrier.wait(ds_free.index(buf), phase)
        ds_half.store(ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_full.index(buf), count=1)
        mbarrier.wait(turn.index(HALF), HALF)          # this warpgroup's turn (2 / 2)
        if CAUSAL:
            dv = warpgroup_mma(p_half.permute((1, 0)), do_t, dv, is_async=True)
            dk = warpgroup_mma(ds_half.permute((1, 0)), q_t, dk, is_async=True)
            mbarrier.wait(ds_full.index(pbuf), phase)      # block it - 1's dS, both halves
            dq = _dq_product(ds_smem, pbuf, k_cols)
            mbarrier.arrive(turn.index(1 - HALF), count=1)
            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
            mbarrier.arrive(q_empty.index(st), count=1)
            mbarrier.arrive(ds_free.index(pbuf), count=1)
            _dq_reduce(dq * scale, dq_smem, dq_desc, off_b, p_row, p_col, HALF)
        else:
            mbarrier.wait(ds_full.index(pbuf), phase)      # block it - 1's dS, both halves
            dq = _dq_product(ds_smem, pbuf, k_cols)
            dv = warpgroup_mma(p_half.permute((1, 0)), do_t, dv, is_async=True)
            dk = warpgroup_mma(ds_half.permute((1, 0)), q_t, dk, is_async=True)
            mbarrier.arrive(turn.index(1 - HALF), count=1)
            dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
            mbarrier.arrive(ds_free.index(pbuf), count=1)
            _dq_reduce(dq * scale, dq_smem, dq_desc, off_b, p_row, p_col, HALF)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(st), count=1)
        return warpgroup_mma_init(dk), warpgroup_mma_init(dv)

    @gluon.jit
    def _consumer(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                  do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar,
                  q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G,
                  i_start, n_qblocks, qk_scale, scale, HALF: gl.constexpr, CAUSAL: gl.constexpr):
        """One warpgroup's 64 keys of the block (dK, dV) and 64 columns of d (dQ); causal: the
        query blocks from i_start (the diagonal's, masked, first)."""
        BM: gl.constexpr = q_smem.shape[2]
        D: gl.constexpr = q_smem.shape[3]
        BN: gl.constexpr = k_smem.shape[1]
        HN: gl.constexpr = BN // 2
        HD: gl.constexpr = D // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        k_half = k_smem.reshape([BN, D]).slice(HALF * HN, HN)
        v_half = v_smem.reshape([BN, D]).slice(HALF * HN, HN)
        k_cols = k_smem.reshape([BN, D]).slice(HALF * HD, HD, dim=1)
        dk = warpgroup_mma_init(gl.zeros([HN, D], gl.float32, layout=acc_layout))
        dv = warpgroup_mma_init(gl.zeros([HN, D], gl.float32, layout=acc_layout))
        mbarrier.wait(kv_bar, 0)
        it = 0
        p_row = S_Q      # no previous block yet: the first dQ lands past S_Q, dropped
        p_col = q_col0
        for g in range(G):
            lse_base = lse_base0 + g * S_Q
            q_col = q_col0 + g * D
            if CAUSAL:
                i_free = gl.minimum(i_start + BN // BM, n_qblocks)
                for i in range(i_start, i_free):
                    dk, dv = _step(q_smem, k_half, v_half, do_smem, k_cols, p_smem, ds_smem,
                                   ds_full, ds_free, dq_smem, dq_desc, q_ready, q_empty, turn,
                                   lse_ptr, delta_ptr, lse_base, i * BM, q_col, it, dk, dv, S_Q,
                                   qk_scale, scale, off_b, p_row, p_col, n0, HALF, True,
                                   CAUSAL)
                    p_row = i * BM
                    p_col = q_col
                    it += 1
            else:
                i_free = i_start
            for i in range(i_free, n_qblocks):
                dk, dv = _step(q_smem, k_half, v_half, do_smem, k_cols, p_smem, ds_smem,
                               ds_full, ds_free, dq_smem, dq_desc, q_ready, q_empty, turn,
                               lse_ptr, delta_ptr, lse_base, i * BM, q_col, it, dk, dv, S_Q,
                               qk_scale, scale, off_b, p_row, p_col, n0, HALF, False,
                               CAUSAL)
                p_row = i * BM
                p_col = q_col
                it += 1
        pbuf = (it + 1) % 2       # the last block's dQ
        mbarrier.wait(ds_full.index(pbuf), ((it + 1) // 2 + 1) & 1)
        dq = _dq_product(ds_smem, pbuf, k_cols)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(kv_free, count=1)
        _dq_reduce(dq * scale, dq_smem, dq_desc, off_b, p_row, p_col, HALF)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        tma.store_wait(pendings=0)
        mbarrier.wait(kv_free, 0)
        _store_dkdv(dk * scale, dv, k_smem, v_smem, dk_dst, dv_dst, S_KV, kv_ss, off_b, n0, kv_col,
                    HALF)

    # Gluon 3.6 passes no constexpr to worker partitions: one entry point per (half, mask)
    @gluon.jit
    def _keys_0(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                qk_scale, scale):
        _consumer(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                  do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                  q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                  qk_scale, scale, 0, False)

    @gluon.jit
    def _keys_1(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                qk_scale, scale):
        _consumer(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                  do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                  q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                  qk_scale, scale, 1, False)

    @gluon.jit
    def _keys_0_causal(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem,
                       v_smem, do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar,
                       q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G,
                       i_start, n_qblocks, qk_scale, scale):
        _consumer(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                  do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                  q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                  qk_scale, scale, 0, True)

    @gluon.jit
    def _keys_1_causal(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem,
                       v_smem, do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar,
                       q_ready, q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G,
                       i_start, n_qblocks, qk_scale, scale):
        _consumer(dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                  do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                  q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                  qk_scale, scale, 1, True)

    @gluon.jit
    def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr,
                    delta_ptr, S_Q, H_KV, G, qk_scale, scale, CAUSAL: gl.constexpr,
                    BM: gl.constexpr,
                    BN: gl.constexpr, D: gl.constexpr, NSTAGE: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        off_b, off_hk, n0, i_start = _key_block(S_KV, H_KV, BM, BN, CAUSAL)
        n_qblocks = gl.cdiv(S_Q, BM)

        q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, turn = _q_ring(
            q_desc, do_desc, k_desc, v_desc, BM, BN, D, NSTAGE)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN // 2], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, BM, BN // 2], p_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BM, BN], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BM, D // 2], dq_desc.layout)
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        kv_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        mbarrier.init(kv_free, count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=2)

        kv_col = off_hk * D
        q_col0 = off_hk * G * D
        lse_base0 = (off_b * H_KV * G + off_hk * G) * S_Q
        args = (dk_dst, dv_dst, S_KV, kv_ss, dq_desc, lse_ptr, delta_ptr, q_smem, k_smem, v_smem,
                do_smem, p_smem, ds_smem, dq_smem, ds_full, ds_free, kv_free, kv_bar, q_ready,
                q_empty, turn, off_b, kv_col, n0, lse_base0, q_col0, S_Q, G, i_start, n_qblocks,
                qk_scale, scale)
        load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar,
                     q_ready, q_empty, off_b, n0, kv_col, q_col0, G, i_start, n_qblocks)
        if CAUSAL:
            gl.warp_specialize([(_keys_0_causal, args), (_keys_1_causal, args),
                                (_dkdv_loader, load_args)], [4, 1],
                               [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([(_keys_0, args), (_keys_1, args), (_dkdv_loader, load_args)],
                               [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _dq_desc(dq: torch.Tensor):
    """The fp32 dQ's [b, s, h * d] view in boxes of one query block by half of d."""
    b, s, h, d = dq.shape
    box = [1, BWD_BLOCK_M, d // 2]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.float32)
    return GluonDesc(dq, [b, s, h * d], [dq.stride(0), dq.stride(1), 1], box, layout)


def flash_attention_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, grad_dtype=None,
                        delta=None, dq_acc=None):
    """(dq, dk, dv) in grad_dtype (None: q's; fp32: never rounded to 16 bits) where
    `flash_attention_sm90_bwd.applies_bwd` holds; no mask or top-left causal. delta: rowsum(dO *
    out) when the caller has it; dq_acc: an fp32 tensor shaped like q that the kernel sums dQ
    into (returned as dq; rows contiguous, a row view of a larger buffer is fine)."""
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    grad_dtype = grad_dtype or q.dtype
    if delta is None:
        delta = torch.empty_like(lse)
        _delta_kernel[(-(-s_q // BWD_BLOCK_M), b * h)](
            out, dout, delta, s_q, h, *out.stride(), *dout.stride(), D=d, BLOCK_M=BWD_BLOCK_M,
            num_warps=4)
    else:
        delta = delta.contiguous()
    into = dq_acc is not None and dq_acc.stride()[2:] == (d, 1) and dq_acc.data_ptr() % 16 == 0
    dq = dq_acc if into else torch.zeros(b, s_q, h, d, dtype=torch.float32, device=q.device)
    (dk, dv), (dk_dst, dv_dst, kv_ss) = dkdv_outputs(k, v, grad_dtype)
    _bwd_kernel[launch_grid(-(-s_kv // BLOCK_N), b * h_kv, causal)](
        *_bwd_descriptors(q, k, v, dout), dk_dst, dv_dst, s_kv, kv_ss, _dq_desc(dq), lse,
        delta, s_q, h_kv, h // h_kv, scale * LOG2E, scale, CAUSAL=bool(causal), BM=BWD_BLOCK_M,
        BN=BLOCK_N, D=d, NSTAGE=BWD_STAGES, CONSUMER_REGS=CONSUMER_REGS,
        LOADER_REGS=LOADER_REGS, num_warps=4)
    if dq_acc is None:
        return dq.to(grad_dtype), dk, dv
    return (dq if into else dq_acc.add_(dq)), dk, dv
