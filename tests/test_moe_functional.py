"""te.moe_permute / moe_permute_with_probs / moe_unpermute and the fused router on the CPU path.

Permutation against plain PyTorch indexing (expert by expert, tokens in order), round trips
through unpermute with and without probs, mask and index maps, dropped rows, and all grads
against autograd through the plain version. The router (softmax pre/post, sigmoid with expert
bias, group-limited top-k, scaling) and the aux-loss scores and loss against a plain PyTorch
reference written from Megatron's formulas, grads by autograd through that reference.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from testlib import FP32_TOL

pytestmark = pytest.mark.cpu

T, E, H, TOPK = 13, 5, 24, 2


def routing(randn):
    idx = randn(T, E).argsort(dim=1)[:, :TOPK]
    return idx, torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)


def plain_permute(x, mask):
    """Rows of x expert by expert, tokens in order, and (expert, token) of each row."""
    rows, src = [], []
    for e in range(mask.shape[1]):
        tok = mask[:, e].nonzero().reshape(-1)
        rows.append(x[tok])
        src += [(e, t) for t in tok.tolist()]
    return torch.cat(rows), src


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_matches_plain_and_round_trips(randn, map_type):
    idx, mask = routing(randn)
    x = randn(T, H, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, row_id_map = te.moe_permute(x, mask if map_type == "mask" else idx, map_type=map_type)
    want, src = plain_permute(x2, mask)
    assert torch.equal(out, want)
    # probs in the map's layout: [T, E] for a mask map, [T, topk] for an index map
    probs_e = torch.rand(T, E) * mask
    probs = probs_e.clone() if map_type == "mask" else probs_e.gather(1, idx)
    probs = probs.requires_grad_()
    probs2 = probs_e.clone().requires_grad_()
    y = te.moe_unpermute(out * 3.0, row_id_map, merging_probs=probs, restore_shape=x.shape,
                         map_type=map_type)
    w = torch.stack([probs2[t, e] for e, t in src])
    tokens = torch.tensor([t for _, t in src])
    y_want = torch.zeros(T, H).index_add(0, tokens, w[:, None] * want * 3)
    torch.testing.assert_close(y, y_want, **FP32_TOL)
    torch.testing.assert_close(y, x.detach() * 3 * probs_e.sum(1, keepdim=True), **FP32_TOL)
    dy = randn(T, H)
    y.backward(dy)
    y_want.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, **FP32_TOL)
    dp = probs.grad if map_type == "mask" else torch.zeros(T, E).scatter(1, idx, probs.grad)
    torch.testing.assert_close(dp, probs2.grad * mask, **FP32_TOL)
    # without probs, unpermute(permute(x)) sums the top-k copies
    plain = te.moe_unpermute(te.moe_permute(x.detach(), mask)[0], te.moe_permute(
        x.detach(), mask)[1])
    torch.testing.assert_close(plain, x.detach() * TOPK, **FP32_TOL)


def test_permute_with_probs_and_dropped_rows(randn):
    _, mask = routing(randn)
    x = randn(T, H, requires_grad=True)
    probs = (torch.rand(T, E) * mask).requires_grad_()
    out, pp, row_id_map = te.moe_permute_with_probs(x, probs, mask)
    want, src = plain_permute(x.detach(), mask)
    assert torch.equal(out, want)
    assert torch.equal(pp, torch.stack([probs[t, e] for e, t in src]).detach())
    g_out, g_pp = randn(*out.shape), randn(pp.shape[0])
    torch.autograd.backward([out, pp], [g_out, g_pp])
    want_dx = torch.zeros(T, H).index_add(0, torch.tensor([t for _, t in src]), g_out)
    torch.testing.assert_close(x.grad, want_dx, **FP32_TOL)
    want_dp = torch.zeros(T, E)
    for r, (e, t) in enumerate(src):
        want_dp[t, e] = g_pp[r]
    torch.testing.assert_close(probs.grad, want_dp, **FP32_TOL)
    # num_out_tokens below the routed count: the last rows are dropped
    keep = T * TOPK - 4
    out2, row_id_map2 = te.moe_permute(x.detach(), mask, num_out_tokens=keep)
    assert torch.equal(out2, want[:keep])
    back = te.moe_unpermute(out2, row_id_map2)
    lost = torch.zeros(T, 1)
    for e, t in src[keep:]:
        lost[t] += 1
    torch.testing.assert_close(back, x.detach() * (TOPK - lost), **FP32_TOL)


def test_empty_expert_and_errors(randn):
    mask = torch.zeros(T, E, dtype=torch.bool)
    mask[:, 1] = mask[:, 3] = True  # experts 0, 2, 4 get nothing
    out, row_id_map = te.moe_permute(randn(T, H), mask)
    assert out.shape == (2 * T, H)
    with pytest.raises(ValueError, match="routing_map must be"):
        te.moe_permute(randn(T, H), mask[:-1])
    with pytest.raises(ValueError, match="map_type"):
        te.moe_permute(randn(T, H), mask, map_type="dense")
    with pytest.raises(ValueError, match="merging_probs"):
        te.moe_unpermute(out, row_id_map, merging_probs=torch.rand(T, E + 1))


# --------------------------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------------------------
def plain_router(logits, topk, pre, num_groups, group_topk, sf, score_function, bias):
    """Megatron's topk routing, in plain PyTorch (autograd gives its backward)."""
    x = logits.float()
    if score_function == "softmax":
        sel = torch.softmax(x, -1) if pre else x
        scores = sel
    else:
        scores = torch.sigmoid(x)
        sel = scores + bias if bias is not None else scores
    if num_groups:
        t, e = x.shape
        gs = sel.view(t, num_groups, -1).topk(topk // group_topk, -1).values.sum(-1)
        gmask = torch.zeros(t, num_groups).scatter(1, gs.topk(group_topk, -1).indices, 1)
        smask = gmask[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e).bool()
        sel = sel.masked_fill(~smask, float("-inf"))
    idx = sel.topk(topk, -1).indices
    if score_function == "softmax":
        p = torch.softmax(x.gather(1, idx), -1) if not pre else scores.gather(1, idx)
    else:
        p = scores.gather(1, idx)
        if topk > 1:
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
    if sf:
        p = p * sf
    probs = torch.zeros_like(x).scatter(1, idx, p)
    return probs, torch.zeros_like(x, dtype=torch.bool).scatter(1, idx, True)


CASES = {
    "softmax-pre": (2, True, None, None, None, "softmax", False),
    "softmax-post-scaled": (3, False, None, None, 2.5, "softmax", False),
    "sigmoid-bias": (2, False, None, None, None, "sigmoid", True),
    "sigmoid-top1": (1, False, None, None, None, "sigmoid", False),
    "sigmoid-groups": (4, False, 4, 2, 1.5, "sigmoid", True),
    "softmax-groups": (2, True, 2, 1, None, "softmax", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_plain_pytorch(randn, case):
    topk, pre, ng, gt, sf, fn, use_bias = CASES[case]
    e = 8
    logits = randn(T, e, scale=2.0, requires_grad=True)
    logits2 = logits.detach().clone().requires_grad_()
    bias = randn(e, scale=0.2) if use_bias else None
    probs, rmap = te.fused_topk_with_score_function(logits, topk, pre, ng, gt, sf, fn, bias)
    want, want_map = plain_router(logits2, topk, pre, ng, gt, sf, fn, bias)
    assert torch.equal(rmap, want_map) and rmap.dtype == torch.bool
    assert int(rmap.sum()) == T * topk
    torch.testing.assert_close(probs, want, **FP32_TOL)
    g = randn(T, e)
    probs.backward(g)
    want.backward(g)
    torch.testing.assert_close(logits.grad, logits2.grad, **FP32_TOL)
    assert logits.grad.abs().max() > 0


def test_router_bf16_logits(randn):
    logits = randn(T, 8, dtype=torch.bfloat16, requires_grad=True)
    probs, rmap = te.fused_topk_with_score_function(logits, 2, False, None, None, None,
                                                    "softmax", None)
    assert probs.dtype == torch.bfloat16
    want, want_map = plain_router(logits.detach().float(), 2, False, None, None, None,
                                  "softmax", None)
    assert torch.equal(rmap, want_map)
    torch.testing.assert_close(probs.float(), want, rtol=1.6e-2, atol=1e-5)
    probs.float().sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_aux_loss_scores_and_loss(randn, fn):
    e, topk, coeff = 8, 2, 1e-2
    logits = randn(T, e, requires_grad=True)
    logits2 = logits.detach().clone().requires_grad_()
    rmap, scores = te.fused_compute_score_for_moe_aux_loss(logits, topk, fn)
    if fn == "softmax":
        want = torch.softmax(logits2, -1)
    else:
        s = torch.sigmoid(logits2)
        want = s / (s.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(scores, want, **FP32_TOL)
    assert torch.equal(rmap, torch.zeros(T, e, dtype=torch.bool).scatter(
        1, want.topk(topk, -1).indices, True))
    tokens_per_expert = rmap.sum(0)
    loss = te.fused_moe_aux_loss(scores, tokens_per_expert, T, e, topk, coeff)
    want_loss = (want.sum(0) * tokens_per_expert).sum() * e * coeff / (topk * T * T)
    torch.testing.assert_close(loss, want_loss, **FP32_TOL)
    loss.backward()
    want_loss.backward()
    torch.testing.assert_close(logits.grad, logits2.grad, rtol=1.3e-6, atol=1e-8)
    assert logits.grad.abs().max() > 0


def test_router_errors(randn):
    with pytest.raises(ValueError, match="topk"):
        te.fused_topk_with_score_function(randn(T, 4), 5, False, None, None, None, "softmax", None)
    with pytest.raises(ValueError, match="score_function"):
        te.fused_topk_with_score_function(randn(T, 4), 2, False, None, None, None, "relu", None)
    with pytest.raises(ValueError, match="num_groups"):
        te.fused_topk_with_score_function(randn(T, 6), 2, False, 4, 1, None, "sigmoid", None)
