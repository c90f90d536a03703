"""Triton kernels of the MoE layer's token movement and router.

Twins: `tritium.ref.moe` (same names and signatures; its docstring has the row map layout,
int32 [T, S] permuted rows, -1 for none, which `tritium.ref.moe.make_row_id_map` builds).

* `permute`: one program per (token, hidden block) reads the token's row once and writes it to
  each of its S slots' rows (and, with probs, the slot's prob from the first hidden block).
* `unpermute`: one program per (token, hidden block): the weighted sum over the token's slots
  in slot order, accumulated in fp32, rounded once.
* `unpermute_backward`: one program per token: for each slot, d_inp[row] = w * d_out[t] and
  d_w = <d_out[t], inp[row]> over the hidden blocks (fp32).
* `router_forward` / `router_backward`: one program per block of tokens, all experts of a row in
  registers (E up to a few hundred): scores, optional group-limited top-k, top-k by repeated
  argmax (ties to the lower expert id), probs, the fp32 intermediate; the backward recomputes
  nothing but the normalisations.
The numbers agree with the twins bit for bit for permute / unpermute / the routing map; sums
over experts or hidden (softmax, d_w) to fp32 rounding (another order).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2


@triton.jit
def _permute_kernel(inp_ptr, map_ptr, out_ptr, probs_ptr, out_probs_ptr, H, S,
                    HAS_PROBS: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    x = tl.load(inp_ptr + t * H + h, mask=hm)
    for s in range(S):
        row = tl.load(map_ptr + t * S + s).to(tl.int64)
        if row >= 0:
            tl.store(out_ptr + row * H + h, x, mask=hm)
            if HAS_PROBS:
                if tl.program_id(1) == 0:
                    tl.store(out_probs_ptr + row, tl.load(probs_ptr + t * S + s))


@triton.jit
def _unpermute_kernel(inp_ptr, map_ptr, probs_ptr, out_ptr, H, S, HAS_PROBS: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in range(S):
        row = tl.load(map_ptr + t * S + s).to(tl.int64)
        x = tl.load(inp_ptr + tl.maximum(row, 0) * H + h, mask=hm & (row >= 0), other=0.0)
        x = x.to(tl.float32)
        if HAS_PROBS:
            x = tl.load(probs_ptr + t * S + s).to(tl.float32) * x
        acc += tl.where(row >= 0, x, 0.0)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _unpermute_bwd_kernel(grad_ptr, inp_ptr, map_ptr, probs_ptr, d_inp_ptr, d_probs_ptr, H, S,
                          HAS_PROBS: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for s in range(S):
        row = tl.load(map_ptr + t * S + s).to(tl.int64)
        if row >= 0:
            dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
            if HAS_PROBS:
                w = tl.load(probs_ptr + t * S + s).to(tl.float32)
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                hm = h < H
                g = tl.load(grad_ptr + t * H + h, mask=hm, other=0.0)
                if HAS_PROBS:
                    gf = g.to(tl.float32)
                    tl.store(d_inp_ptr + row * H + h,
                             (w * gf).to(d_inp_ptr.dtype.element_ty), mask=hm)
                    x = tl.load(inp_ptr + row * H + h, mask=hm, other=0.0).to(tl.float32)
                    dot += gf * x
                else:
                    tl.store(d_inp_ptr + row * H + h, g, mask=hm)
            if HAS_PROBS:
                tl.store(d_probs_ptr + t * S + s, tl.sum(dot))
        elif HAS_PROBS:
            tl.store(d_probs_ptr + t * S + s, 0.0)


@triton.jit
def _topk_mask(sel, cols, K: tl.constexpr):
    """A [BT, EP] mask of each row's K largest entries (repeated argmax, ties to the left)."""
    chosen = sel < float("-inf")  # all False, sel's shape
    for _ in tl.static_range(K):
        idx = tl.argmax(sel, axis=1, tie_break_left=True)
        hit = cols[None, :] == idx[:, None]
        chosen = chosen | hit
        sel = tl.where(hit, float("-inf"), sel)
    return chosen


@triton.jit
def _router_fwd_kernel(logits_ptr, bias_ptr, probs_ptr, map_ptr, inter_ptr, T, E, scaling,
                       SIGMOID: tl.constexpr, PRE: tl.constexpr, AUX: tl.constexpr,
                       TOPK: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, GP: tl.constexpr,
                       BLOCK_T: tl.constexpr, EP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, EP)
    rmask = rows < T
    valid = rmask[:, None] & (cols[None, :] < E)
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    raw = x
    if SIGMOID:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        raw = scores
        if AUX:
            scores = scores / (tl.sum(scores, axis=1)[:, None] + 1e-20)
        sel = tl.where(valid, scores, float("-inf"))
        if HAS_BIAS and not AUX:
            sel = sel + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    else:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        e = tl.where(valid, e, 0.0)
        scores = e / tl.sum(e, axis=1)[:, None]
        if PRE or AUX:
            sel = tl.where(valid, scores, float("-inf"))
        else:
            sel = x
    if NUM_GROUPS > 0 and not AUX:  # group-limited top-k
        per_group = E // NUM_GROUPS
        gcols = tl.arange(0, GP)
        gscore = tl.full((BLOCK_T, GP), float("-inf"), dtype=tl.float32)
        for grp in tl.static_range(NUM_GROUPS):
            ing = (cols >= grp * per_group) & (cols < (grp + 1) * per_group)
            tmp = tl.where(ing[None, :], sel, float("-inf"))
            total = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for _ in tl.static_range(TOPK // GROUP_TOPK):
                idx = tl.argmax(tmp, axis=1, tie_break_left=True)
                total += tl.max(tmp, axis=1)
                tmp = tl.where(cols[None, :] == idx[:, None], float("-inf"), tmp)
            gscore = tl.where(gcols[None, :] == grp, total[:, None], gscore)
        keep = _topk_mask(gscore, gcols, GROUP_TOPK)
        allowed = sel < float("-inf")
        for grp in tl.static_range(NUM_GROUPS):
            kg = tl.sum(tl.where(gcols[None, :] == grp, keep, False).to(tl.int32), axis=1) > 0
            ing = (cols >= grp * per_group) & (cols < (grp + 1) * per_group)
            allowed = allowed | (ing[None, :] & kg[:, None])
        sel = tl.where(allowed, sel, float("-inf"))
    chosen = _topk_mask(sel, cols, TOPK) & valid
    if AUX:
        probs = scores
        inter = scores
        if SIGMOID:
            inter = raw
    elif SIGMOID:
        probs = tl.where(chosen, scores, 0.0)
        inter = scores
        if TOPK > 1:
            probs = probs / (tl.sum(probs, axis=1)[:, None] + 1e-20)
    elif PRE:
        probs = tl.where(chosen, scores, 0.0)
        inter = scores
    else:
        xm = tl.where(chosen, x, float("-inf"))
        ec = tl.where(chosen, tl.exp(xm - tl.max(xm, axis=1)[:, None]), 0.0)
        probs = ec / tl.sum(ec, axis=1)[:, None]
        inter = probs
    if SCALE and not AUX:
        probs = probs * scaling
    tl.store(probs_ptr + offs, probs.to(probs_ptr.dtype.element_ty), mask=valid)
    tl.store(map_ptr + offs, chosen.to(tl.int8), mask=valid)
    tl.store(inter_ptr + offs, inter, mask=valid)


@triton.jit
def _router_bwd_kernel(map_ptr, inter_ptr, grad_ptr, out_ptr, T, E, scaling,
                       SIGMOID: tl.constexpr, AUX: tl.constexpr, TOPK: tl.constexpr,
                       SCALE: tl.constexpr, BLOCK_T: tl.constexpr, EP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, EP)
    valid = (rows < T)[:, None] & (cols[None, :] < E)
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    if AUX:
        mask = valid
    else:
        mask = valid & (tl.load(map_ptr + offs, mask=valid, other=0) != 0)
    g = tl.load(grad_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if SCALE and not AUX:
        g = g * scaling
    g = tl.where(mask, g, 0.0)
    s = tl.load(inter_ptr + offs, mask=valid, other=0.0)
    if SIGMOID:
        if TOPK > 1 or AUX:
            v = tl.where(mask, s, 0.0)
            total = tl.sum(v, axis=1)[:, None] + 1e-20
            g = g / total - tl.sum(g * v, axis=1)[:, None] / (total * total)
        d = tl.where(mask, g, 0.0) * s * (1 - s)
    else:
        d = s * (g - tl.sum(g * s, axis=1)[:, None])
    tl.store(out_ptr + offs, d, mask=valid)


_launch_permute = Launcher(_permute_kernel)
_launch_unpermute = Launcher(_unpermute_kernel)
_launch_unpermute_bwd = Launcher(_unpermute_bwd_kernel)
_launch_router_fwd = Launcher(_router_fwd_kernel)
_launch_router_bwd = Launcher(_router_bwd_kernel)


def _block_h(h: int, cuda: bool) -> int:
    return min(next_pow2(h), 1024) if cuda else 16


def permute(inp: torch.Tensor, row_id_map: torch.Tensor, num_rows: int,
            probs: Optional[torch.Tensor] = None):
    """See `tritium.ref.moe.permute`."""
    inp, row_id_map = inp.contiguous(), row_id_map.contiguous()
    t, s = row_id_map.shape
    h = inp.shape[1]
    out = torch.zeros(num_rows, h, dtype=inp.dtype, device=inp.device)
    pp = None
    if probs is not None:
        probs = probs.contiguous()
        pp = torch.zeros(num_rows, dtype=probs.dtype, device=probs.device)
    if t and num_rows:
        bh = _block_h(h, inp.is_cuda)
        _launch_permute((t, -(-h // bh)), inp, row_id_map, out,
                        probs if probs is not None else inp, pp if pp is not None else inp, h, s,
                        HAS_PROBS=probs is not None, BLOCK_H=bh, num_warps=4)
    return out, pp


def unpermute(inp: torch.Tensor, row_id_map: torch.Tensor,
              merging_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See `tritium.ref.moe.unpermute`."""
    inp, row_id_map = inp.contiguous(), row_id_map.contiguous()
    t, s = row_id_map.shape
    h = inp.shape[1]
    out = torch.empty(t, h, dtype=inp.dtype, device=inp.device)
    if t:
        bh = _block_h(h, inp.is_cuda)
        probs = merging_probs.contiguous() if merging_probs is not None else inp
        _launch_unpermute((t, -(-h // bh)), inp, row_id_map, probs, out, h, s,
                          HAS_PROBS=merging_probs is not None, BLOCK_H=bh, num_warps=4)
    return out


def unpermute_backward(grad_out: torch.Tensor, inp: torch.Tensor, row_id_map: torch.Tensor,
                       merging_probs: Optional[torch.Tensor]):
    """See `tritium.ref.moe.unpermute_backward`."""
    grad_out, inp, row_id_map = grad_out.contiguous(), inp.contiguous(), row_id_map.contiguous()
    t, s = row_id_map.shape
    h = inp.shape[1]
    d_inp = torch.zeros_like(inp)
    d_probs = None
    if merging_probs is not None:
        d_probs = torch.empty(t, s, dtype=torch.float32, device=inp.device)
    if t:
        bh = _block_h(h, inp.is_cuda)
        probs = merging_probs.contiguous() if merging_probs is not None else inp
        _launch_unpermute_bwd((t,), grad_out, inp, row_id_map, probs, d_inp,
                              d_probs if d_probs is not None else inp, h, s,
                              HAS_PROBS=merging_probs is not None, BLOCK_H=bh, num_warps=4)
    return d_inp, d_probs


def _router_tile(e: int, cuda: bool) -> tuple:
    ep = max(next_pow2(e), 2)
    return (max(1, min(16, 4096 // ep)) if cuda else 4), ep


def router_forward(logits: torch.Tensor, topk: int, use_pre_softmax: bool,
                   num_groups: Optional[int], group_topk: Optional[int],
                   scaling_factor: Optional[float], score_function: str,
                   expert_bias: Optional[torch.Tensor], aux: bool = False):
    """See `tritium.ref.moe.router_forward`."""
    logits = logits.contiguous()
    t, e = logits.shape
    probs = torch.empty(t, e, dtype=torch.float32, device=logits.device)
    rmap = torch.empty(t, e, dtype=torch.bool, device=logits.device)
    inter = torch.empty(t, e, dtype=torch.float32, device=logits.device)
    if t:
        bt, ep = _router_tile(e, logits.is_cuda)
        groups = num_groups if (num_groups and group_topk) else 0
        _launch_router_fwd((-(-t // bt),), logits,
                           expert_bias if expert_bias is not None else logits, probs,
                           rmap.view(torch.int8), inter, t, e, float(scaling_factor or 1.0),
                           SIGMOID=score_function == "sigmoid", PRE=bool(use_pre_softmax),
                           AUX=aux, TOPK=topk, NUM_GROUPS=groups,
                           GROUP_TOPK=group_topk if groups else 1,
                           HAS_BIAS=expert_bias is not None, SCALE=bool(scaling_factor),
                           GP=max(next_pow2(groups), 2), BLOCK_T=bt, EP=ep, num_warps=4)
    return probs, rmap, inter


def router_backward(routing_map: torch.Tensor, intermediate: torch.Tensor,
                    grad_probs: torch.Tensor, topk: int, use_pre_softmax: bool,
                    scaling_factor: Optional[float], score_function: str,
                    aux: bool = False) -> torch.Tensor:
    """See `tritium.ref.moe.router_backward`."""
    grad_probs = grad_probs.contiguous()
    t, e = grad_probs.shape
    out = torch.empty(t, e, dtype=torch.float32, device=grad_probs.device)
    if t:
        bt, ep = _router_tile(e, grad_probs.is_cuda)
        _launch_router_bwd((-(-t // bt),), routing_map.contiguous().view(torch.int8),
                           intermediate.contiguous(), grad_probs, out, t, e,
                           float(scaling_factor or 1.0), SIGMOID=score_function == "sigmoid",
                           AUX=aux, TOPK=topk, SCALE=bool(scaling_factor), BLOCK_T=bt, EP=ep,
                           num_warps=4)
    return out


__all__ = ["permute", "unpermute", "unpermute_backward", "router_forward", "router_backward"]
