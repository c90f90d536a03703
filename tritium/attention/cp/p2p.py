"""cp_comm_type="p2p": the load-balanced KV ring (DESIGN.md section 6), one autograd Function.

Rank r holds q, k, v of chunks (r, 2cp-1-r), local length L = 2c. Forward has cp steps; at
step i it holds the KV of rank src = (r - i) mod cp and computes
    step 0       all local q vs the local KV, causal (top-left on the [L, L] square: chunk r
                 sees itself causally, chunk 2cp-1-r sees chunk r fully and itself causally)
    1 <= i <= r  all q vs the first half of the received KV (chunk src < r), no mask
    i > r        the second half of q (chunk 2cp-1-r) vs all received KV, no mask
(no_mask: every step is all q vs all KV). The KV travels r -> r+1 (batch_isend_irecv); the
partial (out, lse) of each step are merged in fp32 (merge.py; with fp32 partials on Hopper the
flash kernel merges steps >= 1 in its epilogue and writes the last step's rows in q's dtype
too, `OutAcc.merge_block`: no partial tensors, no merge and cast passes).

When a transfer is posted matters on CUDA. NCCL's send/recv kernel needs SMs of its own, and
cuDNN's sm90 flash kernels are persistent (one CTA per SM, ~230 KB of shared memory each): a
transfer that becomes ready while one runs, or at the same moment as one is dispatched, waits
for that kernel to end, and the next step waits for the transfer (measured on 8 x H200: 1.3 ms
of every 5 ms forward step at S=131072, cp=8, before this order). So every transfer is posted
right after an attention kernel and before the small kernels that follow it: step 1's KV
is posted first, then a one-SM spin kernel of ~11 us (`torch.cuda._sleep`; SPACER_CYCLES) runs
before step 0's compute, so NCCL's kernel is dispatched while all but one SM are free (measured
on 2 x H200, S=32768: posted right before step 0's kernel, the transfer waited for that
kernel's last wave, 0.4-0.8 ms a step; with only the ~2 us lse fill between them it still did
whenever the host ran several steps ahead: fp32 partials 12.2 against 11.9 ms a step with the
host held to 2 steps ahead; with the spacer 11.9 either way). After step i's compute the
rank waits for step i+1's KV, posts step i+2's, then merges step i: the transfer becomes
ready as the attention kernel ends and starts during the merge, overlapping step i+1's
compute.

Backward runs the ring the other way round, steps i = cp-1, ..., 0 (step i computes forward
step i's block): rank r starts with the KV of rank r+1, the last one it received in the
forward (saved for this), and ends with its own. The dK/dV buffer of the block it holds
arrives from r+1, which held that block one step earlier (at the first step the buffer is this
rank's own contribution); the rank adds its dK/dV (block src's first half only for
1 <= i <= r) and passes the buffer on to r-1. Each step starts with ONE batch to r-1 / from
r+1 that carries both the dK/dV buffer finished at step i+1 and the KV of step i (r-1 needs it
at step i-1; not at step 1: step 0's KV is the rank's own, at hand). It is posted after the
dK/dV adds and ready before the backward's small dO.O kernel, so it runs alongside step i's
compute; two separate transfers would leave the second one queued behind the first until the
persistent backward kernel ends. At step 0 the buffer that arrives is the one of the rank's
own block: its own contribution completes dK/dV and no hop follows the loop. (Replaying the
forward order ends with every buffer one hop from its owner, and that last transfer (fp32:
twice the bytes of a bf16 KV) has no compute to hide behind.) A buffer holds only the rows
its blocks have covered so far (`merge.GradSum`; the receiver knows them from the schedule:
`travelled`): at cp=2 rank 1 sends half the rows rank 0 does. Block src's dK/dV sums the
ranks' contributions in the order src-1, src-2, ..., src (mod cp), the reverse of the
forward-order replay's: equal up to fp32 summation order. dQ stays local: on the flash kernel
with fp32 accumulation every step's kernel sums into one fp32 dQ of the local rows, and
delta = rowsum(dO * out) is computed once (`Runner.shared`). With fp32
accumulation dq and the travelling dk/dv are summed in fp32 and rounded once at the end
(`merge.GradSum`: a sum of two 16-bit partials, all that cp=2's fast mode has, is done by one
16-bit add, which is that; the buffers go fp32 from the third term on); the KV itself travels
in its own dtype. Memory: besides q, k, v, out, lse, each rank keeps one extra K, V block
(rank r+1's, in the input dtype) from the forward to the backward. `cp_stream` is not needed:
NCCL's stream already overlaps the transfers with compute.
"""
from __future__ import annotations

import torch

from .merge import ALL, Block, GradSum, OutAcc, Ring, Runner, contiguous, span

SPACER_CYCLES = 20_000     # ~11 us at 1.8 GHz on one SM
_spin = getattr(torch.cuda, "_sleep", None)     # a one-thread spin kernel (torch's tests use it)


def schedule(i: int, rank: int, causal: bool, half: int) -> Block:
    """The block rank `rank` computes at ring step i (local length 2 * half)."""
    if not causal:
        return Block(ALL, ALL, False)
    if i == 0:
        return Block(ALL, ALL, True)
    if i <= rank:
        return Block(ALL, slice(0, half), False)
    return Block(slice(half, None), ALL, False)


def travelled(i: int, rank: int, n: int, causal: bool, half: int) -> tuple:
    """(start, stop): the rows of the dK/dV buffer that `rank` passes on after backward step
    i, i.e. the smallest range holding the blocks of steps i, ..., n-1 that ranks rank, rank+1,
    ... added to it (merge.GradSum's rule)."""
    spans = [span(schedule(j, (rank + j - i) % n, causal, half).kv, 2 * half)
             for j in range(i, n)]
    return min(a for a, _ in spans), max(b for _, b in spans)


class RingAttention(torch.autograd.Function):
    """q, k, v canonical bshd [b, L, h, d] (any strides) -> out [b, L, h, d_v] in q.dtype."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, cfg.precision)
        ring, n, rank = Ring(cfg.group, cfg.ranks, cfg.rank), cfg.size, cfg.rank
        half = q.shape[1] // 2
        kv = (contiguous(k), contiguous(v))
        pending = ring.exchange(kv) if n > 1 else None      # step 1's KV
        if pending is not None and q.is_cuda and _spin is not None:
            _spin(SPACER_CYCLES)    # NCCL's kernel takes its SMs first (above)
        acc = OutAcc(q, v.shape[-1], cfg.precision.acc_dtype(q.dtype))
        qc = cfg.precision.compute(q)
        states = []
        for i in range(n):
            blk = schedule(i, rank, cfg.causal, half)
            kc, vc = (cfg.precision.compute(x) for x in kv)
            out_i, lse_i, state = runner.fwd(qc, kc, vc, blk, acc, last=i == n - 1)
            states.append(state)
            if pending is not None:     # step i+1's KV; post step i+2's before the merge
                kv = tuple(ring.wait(pending))
                pending = ring.exchange(kv) if i + 2 < n else None
            if out_i is not None:       # (None: the kernel merged it)
                acc.add(blk.q, out_i, lse_i)
        out = acc.result(q.dtype)
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
        qc, dc, oc = p.compute(q), p.compute(dout), p.compute(out)
        dq_sum, dk_sum, dv_sum = (GradSum(n, p, x.dtype, x.shape[1]) for x in (q, k, v))
        shared = runner.shared(dc, oc, qc)     # the kernel path: one delta, one fp32 dq
        dq = dk = dv = None     # (tensor, its rows): merge.GradSum
        for term, i in enumerate(reversed(range(n)), start=1):
            # one batch to r-1 / from r+1: the dK/dV buffer finished at step i+1 and this
            # step's KV (r-1 computes with it at step i-1; step 0's KV is the rank's own)
            send, shapes = [], []
            if dk is not None:  # r+1's buffer holds the rows of its steps i+1, ..., n-1
                rows = travelled(i + 1, (rank + 1) % n, n, cfg.causal, half)
                send += [dk[0], dv[0]]
                shapes += [(x.shape[0], rows[1] - rows[0], *x.shape[2:]) for x in (k, v)]
            if i > 1:
                send += list(kv)
                shapes += [None, None]
            pending = ring.exchange(send, shapes=shapes) if send else None
            blk = schedule(i, rank, cfg.causal, half)
            kc, vc = (p.compute(x) for x in kv)
            dq_i, dk_i, dv_i = runner.bwd(dc, qc, kc, vc, oc, lse, blk, ctx.states[i], shared)
            if shared is None:
                dq = dq_sum.add(dq, dq_i, blk.q, term)
            recv = ring.wait(pending) if pending is not None else []
            if dk is not None:      # the buffer from r+1, which held this block last
                (dk, dv), recv = [(x, rows) for x in recv[:2]], recv[2:]
            dk = dk_sum.add(dk, dk_i, blk.kv, term)
            dv = dv_sum.add(dv, dv_i, blk.kv, term)
            kv = tuple(recv) if i > 1 else (k, v)
        ctx.states = None
        dq = shared[1].to(q.dtype) if shared is not None else dq[0]
        return dq, dk[0], dv[0], None    # step 0: this rank's own block, complete


__all__ = ["RingAttention", "schedule"]
