"""cp_comm_type="p2p": the load-balanced KV ring (DESIGN.md section 6), one autograd Function.

Rank r holds q, k, v of chunks (r, 2cp-1-r), local length L = 2c. Forward has cp steps; at
step i it holds the KV of rank src = (r - i) mod cp and computes
    step 0       all local q vs the local KV, causal (top-left on the [L, L] square: chunk r
                 sees itself causally, chunk 2cp-1-r sees chunk r fully and itself causally)
    1 <= i <= r  all q vs the first half of the received KV (chunk src < r), no mask
    i > r        the second half of q (chunk 2cp-1-r) vs all received KV, no mask
(no_mask: every step is all q vs all KV). Before computing step i it posts the send of the KV
it holds to rank r+1 and the receive of step i+1's KV from rank r-1 (batch_isend_irecv), and
waits only after the compute: on CUDA the NCCL transfer runs on NCCL's stream while step i
computes on the current one. Partial (out, lse) are merged in fp32 (merge.py).

Backward runs the ring the other way round, steps i = cp-1, ..., 0 (step i computes forward
step i's block): rank r starts with the KV of rank r+1, the last one it received in the
forward (saved for this), and ends with its own. Before each step it posts the send of the KV
it holds to r-1 and the receive of the next one from r+1. The dK/dV buffer of the block it
holds arrives from r+1, which held that block one step earlier (at the first step the buffer
is this rank's own contribution); the rank adds its dK/dV (block src's first half only for
1 <= i <= r) and sends the buffer on to r-1 after the compute, overlapping the next step. At
step 0 the buffer that arrives is the one of the rank's own block: its own contribution
completes dK/dV and no hop follows the loop. (Replaying the forward order ends with every
buffer one hop from its owner, and that last transfer (fp32: twice the bytes of a bf16 KV)
has no compute to hide behind.) Block src's dK/dV sums the ranks' contributions in the order
src-1, src-2, ..., src (mod cp), the reverse of the forward-order replay's: equal up to fp32
summation order. dQ stays local. With fp32 accumulation dq and the travelling dk/dv are fp32
and cast once at the end; the KV itself travels in its own dtype. Memory: besides q, k, v,
out, lse, each rank keeps one extra K, V block (rank r+1's, in the input dtype) from the
forward to the backward. `cp_stream` is not needed: NCCL's stream already overlaps the
transfers with compute.
"""
from __future__ import annotations

import torch

from .merge import ALL, Block, OutAcc, Ring, Runner, contiguous, fresh

_KV_TAG, _DKV_TAG = 0, 2


def schedule(i: int, rank: int, causal: bool, half: int) -> Block:
    """The block rank `rank` computes at ring step i (local length 2 * half)."""
    if not causal:
        return Block(ALL, ALL, False)
    if i == 0:
        return Block(ALL, ALL, True)
    if i <= rank:
        return Block(ALL, slice(0, half), False)
    return Block(slice(half, None), ALL, False)


class RingAttention(torch.autograd.Function):
    """q, k, v canonical bshd [b, L, h, d] (any strides) -> out [b, L, h, d_v] in q.dtype."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, cfg.precision)
        ring, n, rank = Ring(cfg.group, cfg.ranks, cfg.rank), cfg.size, cfg.rank
        half = q.shape[1] // 2
        qc = cfg.precision.compute(q)
        acc = OutAcc(q, v.shape[-1], cfg.precision.acc_dtype(q.dtype))
        kv = (contiguous(k), contiguous(v))
        states = []
        for i in range(n):
            pending = ring.exchange(kv, _KV_TAG) if i < n - 1 else None
            blk = schedule(i, rank, cfg.causal, half)
            kc, vc = (cfg.precision.compute(x) for x in kv)
            out_i, lse_i, state = runner.fwd(qc, kc, vc, blk)
            acc.add(blk.q, out_i, lse_i)
            states.append(state)
            if pending is not None:
                kv = tuple(ring.wait(pending))
        out = acc.out.to(q.dtype)
        # backward's rowsum(dO * out) reads the merged out: unrounded in exact mode
        saved_out = acc.out if cfg.precision.exact else out
        # kv is now rank r+1's (the last received): the backward's first step
        ctx.save_for_backward(q, k, v, saved_out, acc.lse, *kv)
        ctx.cfg, ctx.states = cfg, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kv = ctx.saved_tensors
        cfg, p = ctx.cfg, ctx.cfg.precision
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, p)
        ring = Ring(cfg.group, cfg.ranks, cfg.rank, reverse=True)   # to r-1, from r+1
        n, rank = cfg.size, cfg.rank
        half = q.shape[1] // 2
        acc = p.acc_dtype(q.dtype)
        qc, dc, oc = p.compute(q), p.compute(dout), p.compute(out)
        dq = dkv = dkv_pending = None
        for i in reversed(range(n)):
            first = i == n - 1
            kv_pending = ring.exchange(kv, _KV_TAG) if i > 0 else None
            blk = schedule(i, rank, cfg.causal, half)
            kc, vc = (p.compute(x) for x in kv)
            dq_i, dk_i, dv_i = runner.bwd(dc, qc, kc, vc, oc, lse, blk, ctx.states[i])
            if first:                       # dq and the dK/dV buffer start here
                dq = fresh(q.shape, blk.q, dq_i, acc)
                dkv = [fresh(x.shape, blk.kv, d_i, acc) for x, d_i in ((k, dk_i), (v, dv_i))]
            else:                           # the buffer from r+1, which held this block last
                dq[:, blk.q] += dq_i
                dkv = ring.wait(dkv_pending)
                dkv[0][:, blk.kv] += dk_i
                dkv[1][:, blk.kv] += dv_i
            if i > 0:
                dkv_pending = ring.exchange(dkv, _DKV_TAG)
                kv = ring.wait(kv_pending)
        ctx.states = None
        dk, dv = dkv           # step 0: this rank's own block, complete
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


__all__ = ["RingAttention", "schedule"]
