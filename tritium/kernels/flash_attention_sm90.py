"""Hopper (sm90) flash attention in Gluon: the speed mode's forward where it applies.

Triton 3.6's compiler does not overlap a block's softmax with tensor-core work in the flash
forward (docs/attention.md, "Tried"), and its automatic warp specialization of the key loop
compiles at 8 warps only, where it gained nothing (flash_attention.GPU_CFG). Gluon
(Triton's explicit-layout language, `triton.experimental.gluon`) states the schedule itself,
FlashAttention-3's, written here from its description:
  * a 1-warp loader partition streams K and V blocks by TMA into a ring of `stages` buffers
    (ready / empty mbarriers; each K and V buffer is released by both consumers);
  * two consumer warpgroups (4 warps each, 64 query rows of the 128-row tile each), registers
    moved to them by setmaxnreg (240 each, the loader 24);
  * ping-pong: a warpgroup issues its two products (the next block's Q K^T and this block's
    P V, both async wgmma) only in its turn (two mbarriers passed back and forth), then runs
    the next softmax while the other warpgroup's products run on the tensor cores;
  * softmax in fp32 with exp2 (the scale folded into one FMA), P rounded once to the input
    dtype for P V (what the Triton kernel's speed mode and cuDNN do), out rounded once (or
    not: fp32 out).
The backward's kernels (same partitions and ring): `flash_attention_sm90_bwd`.
Contract (a subset of `flash_attention.flash_attention_fwd` / `_bwd`'s, same outputs):
q [b, s_q, h, d], k / v [b, s_kv, h_kv, d] (and dO like q) that TMA reads as [b, s, h * d]
(`tma_view`: contiguous bshd, sbhd memory, q / k / v split from a fused projection; any
lengths), fp16 / bf16, d = 128, no mask or top-left causal; -> out [b, s_q, h, d] in the input
dtype or fp32 (the partials CP merges: never rounded to 16 bits; stored from registers, 16-bit
outputs through shared memory by TMA), lse fp32 [b, h, s_q] (natural log); grads likewise in
the input dtype or fp32. `flash_attention_fwd_merge`: the fp32 out and lse merged in the
epilogue into a CP rank's running fp32 (out, lse) rows (logaddexp), optionally also rounded
into a 16-bit copy. `applies()` (and the backward's `applies_bwd()`) say when; the Triton
kernels run everything else.
Twin: `tritium.ref.flash_attention` (the GPU tier compares them). Gluon does not run under
TRITON_INTERPRET: these kernels have no interpreter tier.
Measured on an H200 (B4 H32 S4096 D128, alternating rounds against cuDNN): forward 1.05-1.06x,
fwd+bwd 0.90-0.97x (benchmarks/RESULTS.md, the flash table; docs/attention.md).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

try:  # Gluon's Hopper API (Triton >= 3.5); without it the Triton kernel runs everything
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc
except ImportError:  # pragma: no cover - older Triton
    gluon = None

from .flash_attention_tiles import LOG2E

ENABLED = True   # False: the Triton kernel runs every forward (tests, bisecting)
BLOCK_M, BLOCK_N, HEAD_DIM, STAGES = 128, 128, 128, 2
CONSUMER_REGS, LOADER_REGS = 240, 24


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_dtype) -> bool:
    """Can these kernels run the speed mode of these bshd tensors?"""
    return (ENABLED and gluon is not None and q.is_cuda and q.dim() == 4
            and _is_sm90(q.device.index)
            and q.dtype in (torch.bfloat16, torch.float16)
            and out_dtype in (q.dtype, torch.float32)
            and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] == HEAD_DIM and k.shape == v.shape and k.shape[-1] == HEAD_DIM
            and q.numel() > 0 and k.numel() > 0
            and q.shape[0] == k.shape[0] and q.shape[2] % k.shape[2] == 0
            and all(tma_view(x) for x in (q, k, v)))


def tma_view(x: torch.Tensor) -> bool:
    """Can TMA read bshd x as [b, s, h * d] (unit-stride d, heads packed, 16-byte aligned base
    and strides)? Contiguous bshd, sbhd memory, q / k / v split from a fused projection."""
    b, s, h, d = x.shape
    sb, ss, sh, sd = x.stride()
    esz = x.element_size()
    return (sd == 1 and (sh == d or h == 1) and (sb * esz) % 16 == 0
            and (ss * esz) % 16 == 0 and x.data_ptr() % 16 == 0)


def _desc(x: torch.Tensor, box: int):
    """A TMA descriptor of bshd x's [b, s, h * d] view with [1, box, d] boxes: rows past a
    sequence's end read as zeros and are not written (per batch)."""
    b, s, h, d = x.shape
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, box, d], gdt)
    return GluonDesc(x, [b, s, h * d], [x.stride(0), x.stride(1), 1], [1, box, d], layout)


if gluon is not None:
    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, cols, rows, n0, S_K, MASK: gl.constexpr,
                      CAUSAL: gl.constexpr):
        """Online softmax of one score block (raw Q K^T, fp32): -> (P, alpha, m, l); m in
        log2 units of the scaled scores."""
        if MASK:
            keep = (n0 + cols)[None, :] < S_K
            if CAUSAL:
                keep = keep & ((n0 + cols)[None, :] <= rows[:, None])
            s = gl.where(keep, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b,
                   kv_col, n_blocks):
        """K / V block j into ring slot j % stages once both consumers released the slot's
        previous block (the loaders of the forward and of dQ)."""
        NSTAGE: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[2]
        for j in range(n_blocks):
            st = j % NSTAGE
            free = ((j // NSTAGE) & 1) ^ 1   # a fresh barrier passes this parity at once
            mbarrier.wait(k_empty.index(st), free)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [off_b, j * BN, kv_col],
                                            k_ready.index(st), k_smem.index(st))
            mbarrier.wait(v_empty.index(st), free)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [off_b, j * BN, kv_col],
                                            v_ready.index(st), v_smem.index(st))

    @gluon.jit
    def _grouped(n_tiles):
        """(tile, batch * heads + head) of this program of a 1D grid of n_tiles tiles per head:
        tile-major within groups of 8 heads, so the programs that start last are the last
        tiles of the last group (causal: the shortest) while 8 heads' K / V stay in L2."""
        GROUP: gl.constexpr = 8
        pid = gl.program_id(0)
        n_bh = gl.num_programs(0) // n_tiles
        first = (pid // (GROUP * n_tiles)) * GROUP
        size = gl.minimum(n_bh - first, GROUP)
        r = pid % (GROUP * n_tiles)
        return r // size, first + r % size

    @gluon.jit
    def _store_half(x, buf, dst, off_b, r0, col, S, ss, HALF: gl.constexpr):
        """Half HALF of a tile's rows (x: fp32 registers; the tile's rows start at r0) into
        dst at column col, the rows below S. A 16-bit dst is a TMA descriptor of a
        [b, s, h * d] view: x is rounded into its half of buf ([1, rows, d] shared memory no
        longer read) and stored by TMA (the caller waits). A pointer dst (fp32, or the 16-bit
        copy of a merged fp32 out) is a contiguous [b, S, h, d] tensor (row stride ss): stored
        from registers, rounded to its dtype."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        r0 = r0 + HALF * R
        if dst.dtype.is_ptr():
            layout: gl.constexpr = x.type.layout
            rows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
            cols = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
            at = (off_b * S + rows).to(gl.int64) * ss + col
            gl.store(dst + at[:, None] + cols[None, :], x.to(dst.dtype.element_ty),
                     mask=(rows < S)[:, None])
        else:
            buf.reshape([2 * R, C]).slice(HALF * R, R).store(x.to(dst.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dst, [off_b, r0, col], buf.slice(HALF * R, R, dim=1))

    @gluon.jit
    def _merge_half(x, lse, o_ptr, lse_ptr, lse_off, rows, off_b, r0, col, S, ss,
                    HALF: gl.constexpr):
        """(out, lse) of half HALF's rows merged with the running fp32 (out, lse) stored where
        `_store_half` and the lse store write them: lse' = logaddexp(lse_old, lse) (torch's
        stable form), out' = out_old exp(lse_old - lse') + x exp(lse - lse')."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        layout: gl.constexpr = x.type.layout
        r = r0 + HALF * R + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
        at = (off_b * S + r).to(gl.int64) * ss + col
        old = gl.load(o_ptr + at[:, None] + cols[None, :], mask=(r < S)[:, None], other=0.0)
        lse_old = gl.load(lse_ptr + lse_off + rows, mask=rows < S, other=0.0)
        new = gl.maximum(lse_old, lse) + gl.log(1.0 + gl.exp(-gl.abs(lse_old - lse)))
        a = gl.convert_layout(gl.exp(lse_old - new), gl.SliceLayout(1, layout))
        b = gl.convert_layout(gl.exp(lse - new), gl.SliceLayout(1, layout))
        return old * a[:, None] + x * b[:, None], new

    @gluon.jit
    def _tile(S_Q, S_K, H, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """This program's (batch * heads + head, batch, head, first row, key blocks to visit) of
        a row-tiled kernel; causal (a 1D grid, `_grouped`): the longest rows first."""
        if CAUSAL:
            n_tiles = gl.cdiv(S_Q, BM)
            t, pid_bh = _grouped(n_tiles)
            pid_m = n_tiles - 1 - t
        else:
            pid_m = gl.program_id(0)
            pid_bh = gl.program_id(1)
        m0 = pid_m * BM
        if CAUSAL:
            n_blocks = gl.cdiv(gl.minimum(S_K, m0 + BM), BN)
        else:
            n_blocks = gl.cdiv(S_K, BN)
        return pid_bh, pid_bh // H, pid_bh % H, m0, n_blocks

    @gluon.jit
    def _kv_ring(NSTAGE: gl.constexpr):
        """The mbarriers of a K / V ring (each slot released by both consumers), of the row
        tile's load and of the consumers' turns, initialized."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for i in gl.static_range(NSTAGE):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        return q_bar, k_ready, v_ready, k_empty, v_empty, turn

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                k_empty, v_empty, off_b, m0, q_col, kv_col, n_blocks):
        """The TMA partition: Q once, then the K / V blocks."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, m0, q_col], q_bar, q_smem)
        _stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b,
                   kv_col, n_blocks)

    @gluon.jit
    def _consumer(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale,
                  o16_ptr, flags, HALF: gl.constexpr, CAUSAL: gl.constexpr):
        """One warpgroup's 64 query rows (HALF 0 / 1 of the tile): scores, softmax, P V,
        ping-ponged with the other warpgroup; then out (TMA store) and lse. An fp32 out
        (pointer) with flags bit 0: merged into the running (out, lse) already there; bit 1:
        also rounded into o16_ptr (same layout)."""
        BM: gl.constexpr = q_smem.shape[1]
        NSTAGE: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[2]
        D: gl.constexpr = k_smem.shape[3]
        HM: gl.constexpr = BM // 2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        q_half = q_smem.reshape([BM, D]).slice(HALF * HM, HM)
        r0 = m0 + HALF * HM
        if CAUSAL:   # key blocks wholly visible to every row of this half (and below S_K)
            n_free = gl.minimum(r0 // BN, S_K // BN)
        else:
            n_free = S_K // BN
        rows = r0 + gl.arange(0, HM, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([HM], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.full([HM], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = warpgroup_mma_init(gl.zeros([HM, D], gl.float32, layout=o_layout))
        zero_s = gl.zeros([HM, BN], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_half, k_smem.index(0).reshape([BN, D]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        if n_free > 0:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, cols, rows, 0, S_K,
                                               False, CAUSAL)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, cols, rows, 0, S_K,
                                               True, CAUSAL)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(n_blocks - 1):
            st = j % NSTAGE
            nxt = j + 1
            nst = nxt % NSTAGE
            # this warpgroup's turn: block j+1's scores and block j's P V on the tensor cores
            mbarrier.wait(turn.index(HALF), (j & 1) ^ (1 - HALF))
            mbarrier.wait(k_ready.index(nst), (nxt // NSTAGE) & 1)
            s_next = warpgroup_mma(q_half, k_smem.index(nst).reshape([BN, D]).permute((1, 0)),
                                   zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(st), (j // NSTAGE) & 1)
            acc = warpgroup_mma(p16, v_smem.index(st).reshape([BN, D]), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - HALF), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
            mbarrier.arrive(k_empty.index(nst), count=1)
            if nxt >= n_free:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, cols, rows,
                                                   nxt * BN, S_K, True, CAUSAL)
            else:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, cols, rows,
                                                   nxt * BN, S_K, False, CAUSAL)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(st), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma_init(acc)
        last = n_blocks - 1
        lst = last % NSTAGE
        mbarrier.wait(turn.index(HALF), (last & 1) ^ (1 - HALF))
        mbarrier.wait(v_ready.index(lst), (last // NSTAGE) & 1)
        acc = warpgroup_mma(p16, v_smem.index(lst).reshape([BN, D]), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - HALF), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(lst), count=1)

        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        if o_dst.dtype.is_ptr():
            if flags % 2 == 1:
                out, lse = _merge_half(out, lse, o_dst, lse_ptr, lse_off, rows, off_b, m0, q_col,
                                       S_Q, o_ss, HALF)
        gl.store(lse_ptr + lse_off + rows, lse, mask=rows < S_Q)
        _store_half(out, q_smem, o_dst, off_b, m0, q_col, S_Q, o_ss, HALF)  # Q no longer read
        if o_dst.dtype.is_ptr():
            if flags >= 2:
                _store_half(out, q_smem, o16_ptr, off_b, m0, q_col, S_Q, o_ss, HALF)
        tma.store_wait(pendings=0)

    # Gluon 3.6 passes no constexpr to worker partitions: one entry point per (half, mask)
    @gluon.jit
    def _rows_0(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                flags):
        _consumer(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                  flags, 0, False)

    @gluon.jit
    def _rows_1(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                flags):
        _consumer(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                  flags, 1, False)

    @gluon.jit
    def _rows_0_causal(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                       k_empty, v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks,
                       qk_scale, o16_ptr, flags):
        _consumer(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                  flags, 0, True)

    @gluon.jit
    def _rows_1_causal(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                       k_empty, v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks,
                       qk_scale, o16_ptr, flags):
        _consumer(o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, off_b, q_col, m0, lse_off, S_Q, S_K, n_blocks, qk_scale, o16_ptr,
                  flags, 1, True)

    @gluon.jit
    def _fwd_kernel(q_desc, k_desc, v_desc, o_dst, o_ss, lse_ptr, S_Q, S_K, H, G, qk_scale,
                    S_O, row0, o16_ptr, flags, CAUSAL: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, D: gl.constexpr, NSTAGE: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """out / lse rows [row0, row0 + S_Q) of [b, S_O, h, d] / [b, h, S_O] buffers (a
        16-bit out: S_O = S_Q, row0 = 0); flags: see `_consumer`."""
        dtype: gl.constexpr = q_desc.dtype
        pid_bh, off_b, off_h, m0, n_blocks = _tile(S_Q, S_K, H, BM, BN, CAUSAL)
        if o_dst.dtype.is_ptr():     # this batch's rows of the buffers, from row0
            shift = (off_b * (S_O - S_Q) + row0).to(gl.int64) * o_ss
            o_dst = o_dst + shift
            o16_ptr = o16_ptr + shift

        q_smem = gl.allocate_shared_memory(dtype, [1, BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NSTAGE, 1, BN, D], v_desc.layout)
        q_bar, k_ready, v_ready, k_empty, v_empty, turn = _kv_ring(NSTAGE)

        args = (o_dst, o_ss, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                v_empty, turn, off_b, off_h * D, m0, pid_bh * S_O + row0, S_Q, S_K, n_blocks,
                qk_scale, o16_ptr, flags)
        load_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                     k_empty, v_empty, off_b, m0, off_h * D, (off_h // G) * D, n_blocks)
        if CAUSAL:
            gl.warp_specialize([(_rows_0_causal, args), (_rows_1_causal, args),
                                (_loader, load_args)], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([(_rows_0, args), (_rows_1, args), (_loader, load_args)],
                               [4, 1], [CONSUMER_REGS, LOADER_REGS])


def launch_grid(n_tiles: int, n_bh: int, causal: bool) -> tuple:
    """The launch grid of `_tile` / `_grouped`: 1D where causal (the longest tiles first)."""
    return (n_tiles * n_bh,) if causal else (n_tiles, n_bh)


def _descriptors(q, k, v):
    """TMA descriptors of q / k / v's [b, s, h * d] views: q's boxes of BLOCK_M rows, k / v's
    of BLOCK_N."""
    return _desc(q, BLOCK_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N)


def output(x: torch.Tensor, box: int):
    """A kernel's destination argument for output x (`_store_half`): 16-bit x: a TMA
    descriptor with boxes of `box` rows (half a tile: each consumer stores its own rows); fp32
    x (contiguous): x itself, stored from registers."""
    if x.dtype == torch.float32:
        if not x.is_contiguous():
            raise ValueError("flash_attention_sm90: an fp32 output must be contiguous")
        return x
    return _desc(x, box)


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, out_dtype=None):
    """The speed-mode forward where `applies(q, k, v, out_dtype)`: -> (out [b, s_q, h, d] in
    out_dtype (None: q's; fp32: never rounded to 16 bits), lse fp32 [b, h, s_q], natural
    log)."""
    b, s_q, h, d = q.shape
    fp32 = out_dtype == torch.float32   # 16-bit: q's memory layout (e.g. sbhd)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device) if fp32 else torch.empty_like(q)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    _launch_fwd(q, k, v, causal, scale, out, lse, s_q, 0, lse, 0)
    return out, lse


def flash_attention_fwd_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float, out: torch.Tensor, lse: torch.Tensor, row0: int,
                              out16: Optional[torch.Tensor] = None) -> None:
    """The block's fp32 partial (q's rows against k / v) merged in place into the running fp32
    (out [b, S, h, d], lse [b, h, S], both contiguous) at rows [row0, row0 + s_q), as a
    context-parallel rank's steps combine (logaddexp of the lses, the outs weighted by
    exp(lse_old - lse_new) and exp(lse_block - lse_new)); with out16 (contiguous, shaped like
    out, q's dtype) the merged rows are also written there rounded. Where
    `applies(q, k, v, torch.float32)`."""
    b, s_q, h, d = q.shape
    total = out.shape[1]
    if (out.dtype != torch.float32 or not out.is_contiguous() or lse.dtype != torch.float32
            or not lse.is_contiguous() or out.shape != (b, total, h, d)
            or lse.shape != (b, h, total) or not 0 <= row0 <= total - s_q
            or (out16 is not None and (out16.shape != out.shape or out16.dtype != q.dtype
                                       or not out16.is_contiguous()))):
        raise ValueError(
            f"flash_attention_fwd_merge: out must be fp32 contiguous [b, S, h, d] = "
            f"[{b}, S, {h}, {d}], lse fp32 contiguous [b, h, S], 0 <= row0 <= S - {s_q} and "
            f"out16 None or contiguous like out in {q.dtype}; got out {tuple(out.shape)} "
            f"{out.dtype}, lse {tuple(lse.shape)} {lse.dtype}, row0 {row0}")
    _launch_fwd(q, k, v, causal, scale, out, lse, total, row0,
                lse if out16 is None else out16, 1 if out16 is None else 3)


def _launch_fwd(q, k, v, causal, scale, out, lse, total, row0, o16, flags):
    b, s_q, h, d = q.shape
    grid = launch_grid(-(-s_q // BLOCK_M), b * h, causal)
    _fwd_kernel[grid](*_descriptors(q, k, v), output(out, BLOCK_M // 2), out.stride(1), lse,
                      s_q, k.shape[1], h, h // k.shape[2], scale * LOG2E, total, row0, o16,
                      flags, CAUSAL=bool(causal), BM=BLOCK_M, BN=BLOCK_N, D=d, NSTAGE=STAGES,
                      CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4)
