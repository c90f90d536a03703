"""Pure-PyTorch twins of `tritium.kernels.moe`: token permutation and the top-k router.

Row map (shared with the kernels and made here, index bookkeeping in torch ops): `row_id_map`
is int32 [T, S], row_id_map[t, s] = the permuted row that token t's slot s goes to, or -1.
For a mask routing map [T, E] the slots are the experts (S = E); for an index routing map
[T, topk] (expert ids) the slots are the top-k choices (S = topk). Either way the permuted rows
are grouped expert by expert, tokens in order inside an expert (TE's order), and rows past
`num_out_tokens` (when >= 0) are dropped (-1). Probabilities travel in the same [T, S] layout
(mask: [T, E]; index: [T, topk]).

* permute: out[row_id_map[t, s]] = inp[t] (and permuted_probs[row] = probs[t, s]).
* unpermute: out[t] = sum over s, in slot order, of w[t, s] * inp[row_id_map[t, s]] in fp32,
  rounded once (w = merging_probs, or 1); its backward gives d_inp rows = w * d_out[t] and
  d_w[t, s] = <d_out[t], inp[row]> (in fp32).
* router: TE's `fused_topk_with_score_function` and `fused_compute_score_for_moe_aux_loss`
  math (fp32 inside): softmax (pre: softmax then top-k; post: top-k of the logits, softmax of
  the chosen ones) or sigmoid (top-k of sigmoid + expert_bias, probs the sigmoids normalized
  when topk > 1), optional group-limited top-k (groups ranked by the sum of their best
  topk // group_topk scores, the best group_topk groups kept), times scaling_factor. Returns the
  dense probs [T, E] (zeros where not routed), the bool routing map and the fp32 intermediate
  the backward needs (softmax pre: the scores; post: the softmax of the chosen; sigmoid: the
  sigmoids). `aux=True` is the aux-loss score: all experts, softmax or normalized sigmoid.
"""
from __future__ import annotations

from typing import Optional

import torch


def make_row_id_map(routing_map: torch.Tensor, num_out_tokens: int, map_type: str):
    """(row_id_map int32 [T, S], number of permuted rows)."""
    if map_type == "mask":
        m = routing_map.bool()
        counts = m.sum(0, dtype=torch.int64)
        start = torch.cumsum(counts, 0) - counts
        # each expert's running count down the tokens, scanned along the innermost dim of the
        # [E, T] transpose: a scan down dim 0 of [T, E] runs E long serial scans on CUDA (1.46 ms
        # at T=8192, E=8 on an H100, 70% of the routing's kernel time; now below the profile's
        # top entries)
        rank = torch.cumsum(m.t().to(torch.int64).contiguous(), 1).t() - 1
        rows = torch.where(m, start[None, :] + rank, torch.full_like(rank, -1))
        total = int(counts.sum()) if num_out_tokens < 0 else num_out_tokens
    else:
        t, k = routing_map.shape
        order = torch.argsort(routing_map.reshape(-1).to(torch.int64), stable=True)
        rows = torch.empty(t * k, dtype=torch.int64, device=routing_map.device)
        rows[order] = torch.arange(t * k, device=routing_map.device)
        rows = rows.view(t, k)
        total = t * k if num_out_tokens < 0 else num_out_tokens
    if num_out_tokens >= 0:
        rows = torch.where(rows < num_out_tokens, rows, torch.full_like(rows, -1))
    return rows.to(torch.int32).contiguous(), total


def permute(inp: torch.Tensor, row_id_map: torch.Tensor, num_rows: int,
            probs: Optional[torch.Tensor] = None):
    """(out [num_rows, H], permuted_probs [num_rows] or None)."""
    t, s = row_id_map.shape
    out = torch.zeros(num_rows, inp.shape[1], dtype=inp.dtype, device=inp.device)
    rows = row_id_map.reshape(-1).long()
    valid = rows >= 0
    src = torch.arange(t, device=inp.device).repeat_interleave(s)
    out[rows[valid]] = inp[src[valid]]
    pp = None
    if probs is not None:
        pp = torch.zeros(num_rows, dtype=probs.dtype, device=probs.device)
        pp[rows[valid]] = probs.reshape(-1)[valid]
    return out, pp


def unpermute(inp: torch.Tensor, row_id_map: torch.Tensor,
              merging_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [T, H] = sum_s w[t, s] * inp[row_id_map[t, s]], fp32, slot by slot."""
    t, s = row_id_map.shape
    acc = torch.zeros(t, inp.shape[1], dtype=torch.float32, device=inp.device)
    for j in range(s):
        rows = row_id_map[:, j].long()
        valid = (rows >= 0)[:, None]
        x = inp[rows.clamp(min=0)].float()
        if merging_probs is not None:
            x = merging_probs[:, j:j + 1].float() * x
        acc = acc + torch.where(valid, x, torch.zeros_like(x))
    return acc.to(inp.dtype)


def unpermute_backward(grad_out: torch.Tensor, inp: torch.Tensor, row_id_map: torch.Tensor,
                       merging_probs: Optional[torch.Tensor]):
    """(d_inp [rows, H] (zeros where no slot points), d_probs [T, S] fp32 or None)."""
    t, s = row_id_map.shape
    d_inp = torch.zeros_like(inp)
    d_probs = None if merging_probs is None else torch.zeros(t, s, dtype=torch.float32,
                                                             device=inp.device)
    g = grad_out.float()
    for j in range(s):
        rows = row_id_map[:, j].long()
        valid = rows >= 0
        w = 1.0 if merging_probs is None else merging_probs[:, j:j + 1].float()
        d_inp[rows[valid]] = (w * g)[valid].to(inp.dtype) if merging_probs is not None \
            else grad_out[valid]
        if d_probs is not None:
            dots = (g * inp[rows.clamp(min=0)].float()).sum(1)
            d_probs[:, j] = torch.where(valid, dots, torch.zeros_like(dots))
    return d_inp, d_probs


def _group_mask(sel: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    t, e = sel.shape
    group_scores = sel.view(t, num_groups, e // num_groups).topk(
        topk // group_topk, dim=-1).values.sum(-1)
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=sel.device)
    keep.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    return keep.repeat_interleave(e // num_groups, dim=1)


def router_forward(logits: torch.Tensor, topk: int, use_pre_softmax: bool,
                   num_groups: Optional[int], group_topk: Optional[int],
                   scaling_factor: Optional[float], score_function: str,
                   expert_bias: Optional[torch.Tensor], aux: bool = False):
    """(probs fp32 [T, E], routing_map bool [T, E], intermediate fp32 [T, E])."""
    x = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(x, -1) if (use_pre_softmax or aux) else None
        sel = scores if scores is not None else x
    else:
        scores = torch.sigmoid(x)
        if aux:
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        sel = scores if expert_bias is None or aux else scores + expert_bias.float()
    if num_groups and group_topk and not aux:
        sel = sel.masked_fill(~_group_mask(sel, topk, num_groups, group_topk), float("-inf"))
    idx = sel.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(x, dtype=torch.bool).scatter_(1, idx, True)
    if aux:
        return scores, routing_map, (torch.sigmoid(x) if score_function == "sigmoid" else scores)
    if score_function == "softmax":
        if use_pre_softmax:
            inter = scores
            probs = scores * routing_map
        else:
            inter = torch.softmax(x.masked_fill(~routing_map, float("-inf")), -1)
            probs = inter
    else:
        inter = scores
        probs = scores * routing_map
        if topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, routing_map, inter


def router_backward(routing_map: torch.Tensor, intermediate: torch.Tensor,
                    grad_probs: torch.Tensor, topk: int, use_pre_softmax: bool,
                    scaling_factor: Optional[float], score_function: str,
                    aux: bool = False) -> torch.Tensor:
    """d logits (fp32) of router_forward's probs (or, aux=True, of its scores)."""
    g = grad_probs.float()
    mask = torch.ones_like(routing_map) if aux else routing_map
    if scaling_factor and not aux:
        g = g * scaling_factor
    g = g * mask
    s = intermediate
    if score_function == "softmax":  # pre/aux: scores; post: softmax of the chosen
        return s * (g - (g * s).sum(-1, keepdim=True))
    v = s * mask
    if topk > 1 or aux:
        total = v.sum(-1, keepdim=True) + 1e-20
        g = g / total - (g * v).sum(-1, keepdim=True) / (total * total)
    return g * mask * s * (1 - s)


__all__ = ["make_row_id_map", "permute", "unpermute", "unpermute_backward", "router_forward",
           "router_backward"]
