"""cp_comm_type="all_gather": gather the whole KV, then compute (simple; no overlap).

Forward: all_gather k and v over the CP group and put them in global order (layout.unshard).
Local q chunk j (j = r, then 2cp-1-r) attends to keys [0, (j+1)c): causal runs it as two
blocks, the prefix [0, jc) with no mask and chunk j itself causally (top-left on a square, so
cuDNN takes it), merged in fp32 like the ring's steps; no_mask is one block, all q vs all KV.
Backward gathers k and v again (nothing of size S is kept between the passes), accumulates
dK/dV for the whole sequence in the accumulation dtype, reorders them rank-major (each rank's
chunks r and 2cp-1-r together) and reduce-scatters them (NCCL; gloo: all_reduce + take this
rank's slice, gloo has no reduce_scatter). dQ stays local.
"""
from __future__ import annotations

import torch

from . import layout
from .merge import ALL, Block, OutAcc, Runner, contiguous


def blocks(rank: int, size: int, causal: bool, half: int) -> list:
    if not causal:
        return [Block(ALL, ALL, False)]
    out = []
    for idx, j in enumerate(layout.chunk_ids(size, rank)):
        rows = slice(idx * half, (idx + 1) * half)
        if j > 0:
            out.append(Block(rows, slice(0, j * half), False))
        out.append(Block(rows, slice(j * half, (j + 1) * half), True))
    return out


def _gather(x: torch.Tensor, cfg) -> torch.Tensor:
    return layout.gather_unshard(contiguous(x), cfg.group, seq_dim=1)


def _reduce_scatter(full: torch.Tensor, cfg) -> torch.Tensor:
    import torch.distributed as dist
    parts = torch.stack([layout.shard(full, cfg.size, p, 1) for p in range(cfg.size)])
    if dist.get_backend(cfg.group) == "gloo":
        dist.all_reduce(parts, group=cfg.group)
        return parts[cfg.rank]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter_tensor(out, parts, group=cfg.group)
    return out


class AllGatherAttention(torch.autograd.Function):
    """q, k, v canonical bshd [b, L, h, d] -> out [b, L, h, d_v] in q.dtype."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        p = cfg.precision
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, p)
        kf, vf = p.compute(_gather(k, cfg)), p.compute(_gather(v, cfg))
        qc = p.compute(q)
        acc = OutAcc(q, v.shape[-1], p.acc_dtype(q.dtype))
        states = []
        for blk in blocks(cfg.rank, cfg.size, cfg.causal, q.shape[1] // 2):
            out_i, lse_i, state = runner.fwd(qc, kf, vf, blk)
            acc.add(blk.q, out_i, lse_i)
            states.append(state)
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, acc.out if p.exact else out, acc.lse)
        ctx.cfg, ctx.states = cfg, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg, p = ctx.cfg, ctx.cfg.precision
        runner = Runner(cfg.scale, cfg.dropout, cfg.backend, p)
        acc = p.acc_dtype(q.dtype)
        kf, vf = p.compute(_gather(k, cfg)), p.compute(_gather(v, cfg))
        qc, dc, oc = p.compute(q), p.compute(dout), p.compute(out)
        shared = runner.shared(dc, oc, qc)     # the kernel path: one delta, one fp32 dq
        dq = shared[1] if shared is not None else torch.zeros(q.shape, dtype=acc,
                                                              device=q.device)
        dk = torch.zeros(kf.shape, dtype=acc, device=k.device)
        dv = torch.zeros(vf.shape, dtype=acc, device=v.device)
        for blk, state in zip(blocks(cfg.rank, cfg.size, cfg.causal, q.shape[1] // 2),
                              ctx.states):
            dq_i, dk_i, dv_i = runner.bwd(dc, qc, kf, vf, oc, lse, blk, state, shared)
            if shared is None:
                dq[:, blk.q] += dq_i
            dk[:, blk.kv] += dk_i
            dv[:, blk.kv] += dv_i
        ctx.states = None
        dk, dv = _reduce_scatter(dk, cfg), _reduce_scatter(dv, cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


__all__ = ["AllGatherAttention", "blocks"]
