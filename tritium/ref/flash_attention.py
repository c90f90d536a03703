"""Pure-PyTorch twin of `tritium.kernels.flash_attention` (same names, signatures, return dtypes).

The math of `tritium.ref.attention` in fp32 (fp64 for fp64 inputs), with results never rounded
to the input dtype: forward -> out fp32 [b, s_q, h, d], lse fp32 [b, h, s_q]; backward ->
dq, dk, dv fp32 (fp64 for fp64 inputs) from any (out, lse) pair of the same softmax rows.
causal is top-left (key j visible to query i iff j <= i) for any s_q, s_kv; `band` (lo, hi)
also hides key j from query i unless lo <= j - i <= hi (a None side unbounded); `varlen`
(cu_q, cu_kv, max_s_q, max_s_kv) takes packed [t, h, d] sequences, each attended alone
(out [t_q, h, d], lse [h, t_q]). `split` is
accepted for the signature and ignored: it is the kernel's way of approaching this fp32 math
(the kernel and this twin agree to fp32 reduction-order tolerance, not bit for bit: the
kernel's online softmax and tiled sums reorder the additions). `out_dtype` / `grad_dtype` (None,
fp32 or the input dtype) round the fp32 results once at the end; lse stays fp32.

`flash_attention_fp8_fwd` is the twin of the kernel's FP8 forward (`attention_fp8_fwd` of
ref/attention.py with the causal mask): pass the kernel's key tile as `block_n`
(`kernels.flash_attention.fp8_block_n`) and it runs the kernel's online softmax, quantizing P
relative to the same running maxima; block_n=None quantizes P against the exact row max.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import attention_bwd, attention_fp8_fwd, attention_fwd, quantize_out


def _mask(s_q: int, s_kv: int, causal: bool, device, band=None):
    """True where key j is hidden from query i."""
    if not causal and band is None:
        return None
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_kv, device=device)[None, :]
    hidden = (j > i) if causal else torch.zeros(s_q, s_kv, dtype=torch.bool, device=device)
    if band is not None:
        lo, hi = band
        if lo is not None:
            hidden = hidden | (j - i < lo)
        if hi is not None:
            hidden = hidden | (j - i > hi)
    return hidden


def _sequences(varlen):
    """(q row start, end, kv row start, end) of each packed sequence."""
    cu_q, cu_kv = (c.tolist() for c in varlen[:2])
    return list(zip(cu_q[:-1], cu_q[1:], cu_kv[:-1], cu_kv[1:]))


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, split: bool = True,
                        out_dtype: Optional[torch.dtype] = None, band: Optional[tuple] = None,
                        varlen: Optional[tuple] = None):
    """-> (out [b, s_q, h, d] in out_dtype (None: fp32), lse fp32 [b, h, s_q], natural log)."""
    if varlen is not None:
        parts = [flash_attention_fwd(q[None, i0:i1], k[None, j0:j1], v[None, j0:j1], causal,
                                     scale, split, out_dtype, band)
                 for i0, i1, j0, j1 in _sequences(varlen)]
        h = q.shape[1]
        out = torch.cat([o[0] for o, _ in parts]) if parts else q.new_zeros(q.shape)
        lse = torch.cat([s[0] for _, s in parts], 1) if parts else q.new_zeros(h, 0).float()
        return out.to(out_dtype or out.dtype), lse
    mask = _mask(q.shape[1], k.shape[1], causal, q.device, band)
    out, lse, _ = attention_fwd(_wide(q), _wide(k), _wide(v), mask, scale, out_dtype=None)
    return out.to(out_dtype or out.dtype).contiguous(), lse.contiguous()


def flash_attention_fwd_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float, out: torch.Tensor, lse: torch.Tensor, row0: int,
                              out16: Optional[torch.Tensor] = None) -> None:
    """The block's fp32 partial (`flash_attention_fwd`, products in q's dtype as the speed
    mode) merged in place into the running fp32 out [b, S, h, d] / lse [b, h, S] at rows
    [row0, row0 + s_q): lse' = logaddexp(lse, lse_block), out' = out exp(lse - lse') +
    out_block exp(lse_block - lse'); with out16 the merged rows also rounded into it."""
    part, part_lse = flash_attention_fwd(q, k, v, causal, scale, split=False)
    merge_partial(out, lse, row0, part, part_lse, out16)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, row0: int, part: torch.Tensor,
                  part_lse: torch.Tensor, out16: Optional[torch.Tensor] = None) -> None:
    """The merge of `flash_attention_fwd_merge` given the block's partial (part, part_lse)."""
    rows = slice(row0, row0 + part.shape[1])
    old, old_lse = out[:, rows], lse[:, :, rows]
    new = torch.logaddexp(old_lse, part_lse)
    a, b = ((x - new).exp().transpose(1, 2).unsqueeze(-1) for x in (old_lse, part_lse))
    old.copy_(old * a + part * b)
    old_lse.copy_(new)
    if out16 is not None:
        out16[:, rows] = old


def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                        split: bool = True, grad_dtype: Optional[torch.dtype] = None,
                        band: Optional[tuple] = None, varlen: Optional[tuple] = None,
                        delta: Optional[torch.Tensor] = None,
                        dq_acc: Optional[torch.Tensor] = None):
    """-> (dq, dk, dv) in grad_dtype (None: fp32), shaped like q, k, v (any (out, lse) of the
    same softmax rows). delta (fp32, shaped like lse): rowsum(dout * out) given; dq_acc (fp32,
    shaped like q): dq added into it and returned."""
    if varlen is not None:
        dtype = grad_dtype or _wide(q).dtype
        grads = [flash_attention_bwd(dout[None, i0:i1], q[None, i0:i1], k[None, j0:j1],
                                     v[None, j0:j1], out[None, i0:i1], lse[None, :, i0:i1],
                                     causal, scale, split, grad_dtype, band,
                                     delta=None if delta is None else delta[None, :, i0:i1])
                 if i1 > i0 and j1 > j0 else  # nothing attended: no gradient
                 tuple(x.new_zeros((1, n, *x.shape[1:]), dtype=dtype)
                       for x, n in ((q, i1 - i0), (k, j1 - j0), (v, j1 - j0)))
                 for i0, i1, j0, j1 in _sequences(varlen)]
        grads = tuple(torch.cat([g[n][0] for g in grads]) for n in range(3))
    else:
        mask = _mask(q.shape[1], k.shape[1], causal, q.device, band)
        grads = attention_bwd(_wide(dout), _wide(q), _wide(k), _wide(v), _wide(out), lse, mask,
                              scale, delta=delta)
        grads = tuple(g.to(grad_dtype or g.dtype).contiguous() for g in grads)
    if dq_acc is None:
        return grads
    return (dq_acc.add_(grads[0]), *grads[1:])


def flash_attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in fp32, [b, h, s_q] (bshd inputs)."""
    return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


def flash_attention_fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            descale: torch.Tensor, causal: bool, scale: float,
                            out_dtype: Optional[torch.dtype] = None,
                            block_n: Optional[int] = None, band: Optional[tuple] = None,
                            fp8_out=None):
    """E4M3 q/k/v (bshd), descale fp32 [3] -> (out in out_dtype (None: fp32), lse fp32);
    fp8_out (the kernel's `FP8Out`) -> (out or None, lse, out8): `quantize_out` of fp32 out."""
    mask = _mask(q.shape[1], k.shape[1], causal, q.device, band)
    out, lse = attention_fp8_fwd(q, k, v, descale, mask, scale, block_n)
    hp = out.to(out_dtype or out.dtype).contiguous()
    if fp8_out is None:
        return hp, lse.contiguous()
    out8 = quantize_out(out, fp8_out.scale, fp8_out.amax, fp8_out.seq_first)
    return (hp if fp8_out.keep_hp else None), lse.contiguous(), out8


__all__ = ["flash_attention_fwd", "flash_attention_fwd_merge", "merge_partial",
           "flash_attention_bwd", "flash_attention_delta", "flash_attention_fp8_fwd"]
