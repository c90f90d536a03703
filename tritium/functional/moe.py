"""TE's MoE functions with their autograd: token permutation and the fused router.

    moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask")
        -> (permuted, row_id_map)
    moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1)
        -> (permuted, permuted_probs, row_id_map)
    moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
                  probs=None) -> [num_tokens, hidden]
    fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk,
                                   scaling_factor, score_function, expert_bias)
        -> (probs [T, E] in logits' dtype, routing_map bool [T, E])
    fused_compute_score_for_moe_aux_loss(logits, topk, score_function) -> (routing_map, scores)
    fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)

TE's signatures and results. A mask routing map is [T, E] (bool or 0/1 ints), an index map
[T, topk] expert ids; permuted rows are grouped expert by expert, tokens in order inside an
expert. `row_id_map` is tritium's own ([T, S] int32 target rows, see `tritium.ref.moe`): pass
it back to moe_unpermute as TE users do, do not read it. With num_out_tokens < the routed count
the rows past it are dropped (their tokens get nothing back from unpermute). max_token_num is
accepted for TE compatibility and unused. The permuted probs' and the aux loss's arithmetic is a
few small torch ops (vectors of T*topk or E numbers); the row movement and the router are
Triton kernels on CUDA (`tritium.kernels.moe`), their twins elsewhere.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from .. import _device
from ..ref import moe as ref_moe


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..kernels import moe as kernel_moe
    return kernel_moe


def _impl(t: torch.Tensor):
    return _kernels() if _device.use_triton(t) else ref_moe


def _check_map(inp, routing_map, map_type):
    if map_type not in ("mask", "index"):
        raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")
    if inp.dim() != 2:
        raise ValueError(f"moe_permute: inp must be [num_tokens, hidden], got {tuple(inp.shape)}")
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
        raise ValueError(f"moe_permute: routing_map must be [num_tokens={inp.shape[0]}, "
                         f"{'num_experts' if map_type == 'mask' else 'topk'}], got "
                         f"{tuple(routing_map.shape)}")
    if map_type == "index" and routing_map.is_floating_point():
        raise TypeError("moe_permute: an index routing_map holds expert ids (an integer tensor); "
                        "pass map_type='mask' for a [num_tokens, num_experts] mask")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, num_rows, probs):
        out, pp = _impl(inp).permute(inp, row_id_map, num_rows, probs)
        ctx.save_for_backward(row_id_map)
        ctx.has_probs = probs is not None
        return out, pp

    @staticmethod
    def backward(ctx, d_out, d_pp):
        (row_id_map,) = ctx.saved_tensors
        d_inp = _impl(d_out).unpermute(d_out.contiguous(), row_id_map, None)
        d_probs = None
        if ctx.has_probs and d_pp is not None:
            rows = row_id_map.long()
            d_probs = torch.where(rows >= 0, d_pp[rows.clamp(min=0)], d_pp.new_zeros(()))
        return d_inp, None, None, d_probs


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, merging_probs):
        ctx.save_for_backward(inp, row_id_map, merging_probs)
        return _impl(inp).unpermute(inp, row_id_map, merging_probs)

    @staticmethod
    def backward(ctx, d_out):
        inp, row_id_map, probs = ctx.saved_tensors
        d_inp, d_probs = _impl(d_out).unpermute_backward(d_out.contiguous(), inp, row_id_map,
                                                         probs)
        if d_probs is not None:
            d_probs = d_probs.to(probs.dtype)
        return d_inp, None, d_probs


def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int = -1,
                max_token_num: int = -1, map_type: str = "mask"):
    """Group inp's rows by expert: (permuted [rows, hidden], row_id_map)."""
    _check_map(inp, routing_map, map_type)
    row_id_map, rows = ref_moe.make_row_id_map(routing_map, num_out_tokens, map_type)
    out, _ = _Permute.apply(inp, row_id_map, rows, None)
    return out, row_id_map


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: int = -1):
    """moe_permute (mask map) that also permutes probs [T, E]: (permuted, permuted_probs,
    row_id_map)."""
    _check_map(inp, routing_map, "mask")
    if probs.shape != routing_map.shape:
        raise ValueError(f"moe_permute_with_probs: probs {tuple(probs.shape)} must be shaped "
                         f"like routing_map {tuple(routing_map.shape)}")
    row_id_map, rows = ref_moe.make_row_id_map(routing_map, num_out_tokens, "mask")
    out, pp = _Permute.apply(inp, row_id_map, rows, probs)
    return out, pp, row_id_map


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor,
                  merging_probs: Optional[torch.Tensor] = None, restore_shape=None,
                  map_type: str = "mask", probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's rows summed back (weighted by merging_probs [T, E] for a mask map,
    [T, topk] for an index map; `probs` is TE's older name for it)."""
    if map_type not in ("mask", "index"):
        raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")
    if merging_probs is None:
        merging_probs = probs
    if merging_probs is not None and merging_probs.shape != row_id_map.shape:
        raise ValueError(f"moe_unpermute: merging_probs {tuple(merging_probs.shape)} must be "
                         f"[num_tokens, {'num_experts' if map_type == 'mask' else 'topk'}] = "
                         f"{tuple(row_id_map.shape)}")
    if restore_shape is not None and tuple(restore_shape)[0] != row_id_map.shape[0]:
        raise ValueError(f"moe_unpermute: restore_shape {tuple(restore_shape)} does not match "
                         f"the {row_id_map.shape[0]} tokens of row_id_map")
    return _Unpermute.apply(inp, row_id_map, merging_probs)


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                score_function, expert_bias, aux):
        probs, rmap, inter = _impl(logits).router_forward(
            logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
            score_function, expert_bias, aux)
        ctx.save_for_backward(rmap, inter)
        ctx.args = (topk, use_pre_softmax, scaling_factor, score_function, aux)
        ctx.dtype = logits.dtype
        ctx.mark_non_differentiable(rmap)
        return probs if aux else probs.to(logits.dtype), rmap

    @staticmethod
    def backward(ctx, d_probs, _):
        rmap, inter = ctx.saved_tensors
        d = _impl(d_probs).router_backward(rmap, inter, d_probs, *ctx.args)
        return d.to(ctx.dtype), None, None, None, None, None, None, None, None


def _check_router(logits, topk, score_function, num_groups, group_topk, expert_bias):
    if logits.dim() != 2:
        raise ValueError(f"router: logits must be [num_tokens, num_experts], got "
                         f"{tuple(logits.shape)}")
    if logits.dtype == torch.float64:
        raise TypeError("router: float64 logits are not supported; pass fp32, bf16 or fp16")
    e = logits.shape[1]
    if score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if not 1 <= topk <= e:
        raise ValueError(f"topk must be in [1, num_experts={e}], got {topk}")
    if num_groups and group_topk:
        if e % num_groups or topk % group_topk or group_topk > num_groups:
            raise ValueError(f"group-limited top-k needs num_experts={e} divisible by "
                             f"num_groups={num_groups}, topk={topk} divisible by group_topk="
                             f"{group_topk} and group_topk <= num_groups")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("expert_bias is only used with score_function='sigmoid'")


def fused_topk_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool,
                                   num_groups: Optional[int], group_topk: Optional[int],
                                   scaling_factor: Optional[float], score_function: str,
                                   expert_bias: Optional[torch.Tensor]):
    """TE's fused router: (probs [T, E] in logits' dtype, zeros where not routed; routing_map
    bool [T, E])."""
    _check_router(logits, topk, score_function, num_groups, group_topk, expert_bias)
    return _Router.apply(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                         score_function, expert_bias, False)


def fused_compute_score_for_moe_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map bool [T, E], scores fp32 [T, E]): the scores the aux loss uses (softmax,
    or sigmoid normalized over the experts) and their top-k."""
    _check_router(logits, topk, score_function, None, None, None)
    scores, rmap = _Router.apply(logits, topk, False, None, None, None, score_function, None,
                                 True)
    return rmap, scores


class _AuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tokens_per_expert, coeff_total):
        weights = tokens_per_expert.float() * coeff_total
        ctx.save_for_backward(weights)
        ctx.shape, ctx.dtype = probs.shape, probs.dtype
        return (probs.float().sum(0) * weights).sum().to(probs.dtype)

    @staticmethod
    def backward(ctx, grad):
        (weights,) = ctx.saved_tensors
        d = (grad.float() * weights).expand(ctx.shape).to(ctx.dtype)
        return d, None, None


def fused_moe_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                       total_num_tokens: Union[int, torch.Tensor], num_experts: int, topk: int,
                       coeff: float) -> torch.Tensor:
    """The switch-transformer load-balancing loss (TE's / Megatron's formula):
    sum_e (sum_t probs[t, e]) * tokens_per_expert[e] * num_experts * coeff
    / (topk * total_num_tokens^2), a scalar of probs' dtype."""
    if probs.dim() != 2 or tokens_per_expert.numel() != probs.shape[1]:
        raise ValueError(f"fused_moe_aux_loss: probs must be [T, E] and tokens_per_expert [E], "
                         f"got {tuple(probs.shape)} and {tuple(tokens_per_expert.shape)}")
    total = total_num_tokens.float() if isinstance(total_num_tokens, torch.Tensor) \
        else float(total_num_tokens)
    coeff_total = num_experts * coeff / (topk * total * total)
    if not isinstance(coeff_total, torch.Tensor):
        coeff_total = torch.tensor(coeff_total, dtype=torch.float32, device=probs.device)
    return _AuxLoss.apply(probs, tokens_per_expert, coeff_total)


__all__ = ["moe_permute", "moe_permute_with_probs", "moe_unpermute",
           "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
           "fused_moe_aux_loss"]
