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

FP8 attention (`attention_fp8_fwd`, recipe fp8_dpa): q, k, v arrive as E4M3 with one dequant
scale each (`descale` fp32 [3]: q, k, v). S = (q8 k8^T) in fp32 times scale * log2(e) * dq * dk
(the base-2 domain of the flash kernel), an online softmax over key blocks of `block_n` (None:
one block, i.e. the exact row max), P = exp2(S - m) in [0, 1] quantized to E4M3 with the fixed
scale P_SCALE = 448 (E4M3's max: P's largest value 1 lands on the top of the format and P keeps
full precision down to 2^-6 / 448 ~ 3.5e-5 instead of 2^-6). The scale rides in the exponent,
P * 448 = exp2(S - (m - log2 448)) (one multiply per score less in the kernel), so l, the
rowsum of the unquantized scaled P, carries it too: acc = sum P8 v8 in fp32, out = acc * dv / l,
lse = (m + log2 l - log2 448) ln 2, the fp32 one (the bf16 backward's recomputed P agrees
with it). The tiling matters: P is quantized relative to the running max, so `block_n` equal
to the kernel's tile makes this the kernel's twin.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 448.0          # fixed scale of the softmax probabilities P in [0, 1] (see above)
LOG2_P_SCALE = math.log2(P_SCALE)  # P_SCALE as an exponent shift
_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453


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
                  dropout_p: float = 0.0, keep: Optional[torch.Tensor] = None,
                  delta: Optional[torch.Tensor] = None):
    """-> (dq, dk, dv) in the dtypes and shapes of q, k, v. delta: rowsum(dout * out) [b, h,
    s_q] when the caller has it."""
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
    if delta is None:
        delta = (do * out.to(acc).transpose(1, 2)).sum(-1, keepdim=True)
    else:
        delta = delta.to(acc).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    if groups > 1:
        b, h, sk, _ = dk.shape
        dk = dk.view(b, h // groups, groups, sk, -1).sum(2)
        dv = dv.view(b, h // groups, groups, sk, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype),
            dv.transpose(1, 2).to(v.dtype))


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale (fp32) clamped to +-448 and rounded to E4M3 (nearest even); strides kept."""
    return (x.float() * scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_out(out: torch.Tensor, scale: torch.Tensor, amax: Optional[torch.Tensor],
                 seq_first: bool = False) -> torch.Tensor:
    """fp8_mha's E4M3 attention output: `quantize_e4m3` of the fp32 out [b, s, h, d] (never
    rounded to 16 bits first), max|out| max-recorded into `amax` (None: not recorded);
    seq_first: its memory laid out [s, b, h, d]."""
    out = out.float()
    if amax is not None and out.numel():
        amax.copy_(torch.maximum(amax, out.abs().amax().reshape(1)))
    if seq_first:
        return quantize_e4m3(out.transpose(0, 1).contiguous(), scale).transpose(0, 1)
    return quantize_e4m3(out.contiguous(), scale)


def attention_fp8_fwd(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                      descale: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                      block_n: Optional[int] = None):
    """FP8 attention (see the module note) -> (out fp32 [b, s_q, h, d_v], lse fp32 [b, h, s_q]).
    q8/k8/v8 E4M3 bshd, descale fp32 [3] (1 / the q, k, v quantization scales)."""
    f32, inf = torch.float32, float("inf")
    groups = q8.shape[2] // k8.shape[2]
    d = descale.float()
    qk_scale = d[0] * (scale * _LOG2E) * d[1]   # no host tensor: CUDA graphs capture this
    s = torch.matmul(q8.to(f32).transpose(1, 2), _heads_first(k8, groups, f32).transpose(-1, -2))
    s = s * qk_scale
    if mask is not None:
        s = s.masked_fill(mask, -inf)
    vf = _heads_first(v8, groups, f32)
    b, h, sq, sk = s.shape
    m = torch.full((b, h, sq), -inf, dtype=f32, device=s.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(b, h, sq, vf.shape[-1], dtype=f32, device=s.device)
    step = max(sk, 1) if block_n is None else int(block_n)
    for n0 in range(0, sk, step):
        blk = s[..., n0:n0 + step]
        m_new = torch.maximum(m, blk.amax(-1))
        m_use = torch.where(m_new == -inf, torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(blk - (m_use - LOG2_P_SCALE)[..., None])   # P * P_SCALE
        l = l * alpha + p.sum(-1)
        p8 = p.to(E4M3)
        acc = torch.matmul(p8.to(f32), vf[..., n0:n0 + step, :]) + acc * alpha[..., None]
        m = m_new
    acc = acc * d[2]
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    out = acc / l_safe[..., None]
    lse = torch.where(l > 0, (m + torch.log2(l_safe) - LOG2_P_SCALE) * _LN2,
                      torch.full_like(l, -inf))
    return out.transpose(1, 2), lse


__all__ = ["attention_fwd", "attention_bwd", "attention_fp8_fwd", "quantize_e4m3", "quantize_out",
           "P_SCALE"]
