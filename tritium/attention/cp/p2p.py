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

Backward replays the ring. At step i rank r also receives from r-1 the dK/dV buffer of block
src, accumulated by the ranks that held it before; it adds its own dK/dV (block src's first
half only for 1 <= i <= r) and sends the buffer on to r+1. After the last step one more hop
delivers each buffer to its owner. dQ stays local. With fp32 accumulation dq and the
travelling dk/dv are fp32 and cast once at the end; the KV itself travels in its own dtype.
`cp_stream` is not needed: NCCL's stream already overlaps the transfers with compute.
"""
from __future__ import annotations

import torch

from .merge import ALL, Block, OutAcc, Ring, Runner, contiguous

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
        ctx.save_for_backward(q, k, v, saved_out, acc.lse)
        ctx.cfg, ctx.states = cfg, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg, p = ctx.cfg, ctx.cfg.precision
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, p)
        ring, n, rank = Ring(cfg.group, cfg.ranks, cfg.rank), cfg.size, cfg.rank
        half = q.shape[1] // 2
        acc = p.acc_dtype(q.dtype)
        qc, dc, oc = p.compute(q), p.compute(dout), p.compute(out)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = (contiguous(k), contiguous(v))
        dkv_pending = None
        for i in range(n):
            kv_pending = ring.exchange(kv, _KV_TAG) if i < n - 1 else None
            blk = schedule(i, rank, cfg.causal, half)
            kc, vc = (p.compute(x) for x in kv)
            dq_i, dk_i, dv_i = runner.bwd(dc, qc, kc, vc, oc, lse, blk, ctx.states[i])
            dq[:, blk.q] += dq_i
            if dkv_pending is None:
                dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                dk_acc, dv_acc = ring.wait(dkv_pending)
            dk_acc[:, blk.kv] += dk_i
            dv_acc[:, blk.kv] += dv_i
            dkv_pending = ring.exchange((dk_acc, dv_acc), _DKV_TAG)
            if kv_pending is not None:
                kv = tuple(ring.wait(kv_pending))
        dk, dv = ring.wait(dkv_pending)
        ctx.states = None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


__all__ = ["RingAttention", "schedule"]
