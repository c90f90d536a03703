"""Pure-PyTorch attention, forward and backward, with the log-sum-exp: the CPU path, the
fallback for anything the fused backends cannot do, and the oracle the GPU tests trust.

Contract:
  * q [b, s_q, h, d_qk], k [b, s_kv, h_kv, d_qk], v [b, s_kv, h_kv, d_v] ("bshd"; any strides);
    h % h_kv == 0, query head i reads kv head i // (h // h_kv) (GQA/MQA).
  * mask: None or bool broadcastable to [b, h, s_q, s_kv], True = masked out.
  * Math in fp32 (fp64 for fp64 inputs): S = scale * q k^T, masked entries -inf,
    lse = logsumexp(S) per row [b, h, s_q] (natural log), P = exp(S - lse); a row with every key
    masked gets P = 0, lse = -inf. Dropout (p > 0) keeps each P entry with probability 1 - p and
    scales it by 1/(1 - p); lse is of the undropped softmax. out = P_drop v, rounded once to
    q.dtype. `keep` (the dropout mask, or None) is returned so backward replays it.
  * Backward takes any (out, lse) pair of the same softmax rows (e.g. a context-parallel ring's
    merged ones): P = exp(S - lse), dV = P_drop^T dO, dP = (dO v^T) * keep/(1-p),
    D = rowsum(dO * out), dS = P * (dP - D), dQ = scale dS k, dK = scale dS^T q; GQA sums dK, dV
    over each kv head's query heads. Gradients are rounded once to the inputs' dtypes; D is
    only as exact as the out given (pass the fp32 out to keep 16-bit grads single-rounded).
  * Memory is O(b h s_q s_kv): a reference, not a kernel.
"""
from __future__ import annotations

from typing import Optional

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor, groups: int, dtype) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, h_kv * groups, s, d] in dtype (kv head repeated per group)."""
    x = x.to(dtype).transpose(1, 2)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _scores(q, k, mask, scale, acc):
    groups = q.shape[2] // k.shape[2]
    qf = q.to(acc).transpose(1, 2)
    kf = _heads_first(k, groups, acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return s, qf, kf, groups


def _probs(s, lse):
    finite = torch.isfinite(lse)[..., None]
    p = torch.exp(s - torch.where(finite, lse[..., None], torch.zeros_like(lse[..., None])))
    return torch.where(finite, p, torch.zeros_like(p))


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor], scale: float, dropout_p: float = 0.0,
                  generator: Optional[torch.Generator] = None, out_dtype="like q"):
    """-> (out [b, s_q, h, d_v] in q.dtype, lse [b, h, s_q] fp32 (fp64 for fp64 q), keep).
    out_dtype=None keeps out in the compute dtype (for a backward that wants it unrounded)."""
    acc = _acc(q.dtype)
    s, _, _, groups = _scores(q, k, mask, scale, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = _probs(s, lse)
    keep = None
    if dropout_p > 0.0:
        keep = torch.rand(p.shape, device=p.device, generator=generator) >= dropout_p
        p = p * keep / (1.0 - dropout_p)
    out = torch.matmul(p, _heads_first(v, groups, acc))
    out = out.transpose(1, 2)
    return (out.to(q.dtype) if out_dtype == "like q" else out), lse, keep


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                  dropout_p: float = 0.0, keep: Optional[torch.Tensor] = None):
    """-> (dq, dk, dv) in the dtypes and shapes of q, k, v."""
    acc = _acc(q.dtype)
    s, qf, kf, groups = _scores(q, k, mask, scale, acc)
    p = _probs(s, lse.to(acc))
    do = dout.to(acc).transpose(1, 2)
    vf = _heads_first(v, groups, acc)
    p_drop = p if keep is None else p * keep / (1.0 - dropout_p)
    dv = torch.matmul(p_drop.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    if keep is not None:
        dp = dp * keep / (1.0 - dropout_p)
    delta = (do * out.to(acc).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    if groups > 1:
        b, h, sk, _ = dk.shape
        dk = dk.view(b, h // groups, groups, sk, -1).sum(2)
        dv = dv.view(b, h // groups, groups, sk, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype),
            dv.transpose(1, 2).to(v.dtype))


__all__ = ["attention_fwd", "attention_bwd"]
