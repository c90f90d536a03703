"""cpu tier: te.DotProductAttention (reference backend) against an explicit softmax written here.

The oracle below is independent of tritium: it spells out TE's mask rules (docs/attention.md)
with Python loops over (query, key) pairs, then does matmul + masked_fill + softmax in float64;
fully masked query rows give 0. Every grad comes from float64 autograd through it.

Tolerances:
  * float32 inputs: TE's fp32 tolerance (testlib.FP32_TOL, rtol 1.3e-6 / atol 1e-5) for output,
    lse, dq, dk, dv. The reference does every matmul and the softmax in fp32, so it is off the
    fp64 oracle by fp32 rounding only (~1e-7 here); a bf16 or TF32 step anywhere would not pass.
  * bfloat16 inputs: the oracle runs in fp64 on the same bf16 values; the reference computes in
    fp32 and rounds each result once to bf16, an error of at most half a bf16 ulp (2^-9
    relative). So we check rtol 4e-3 (one bf16 ulp, 2^-8, less than TE's 1.6e-2) and atol 1e-5:
    a double rounding can reach 1 ulp, a bf16 softmax or matmul (8-bit mantissa products summed
    in bf16) exceeds it.
Shapes stay small (s <= 12) so the file runs in seconds. Also: thd against the same sequences
padded, the lse, dropout, the context-parallel fwd/bwd contract, explain(), every error.
"""
from __future__ import annotations

import math

import pytest
import torch

import tritium.attention as A
from tritium.attention import backends as B
from tritium.ref import attention as ref_attention

from testlib import FP32_TOL

pytestmark = pytest.mark.cpu

BF16_ULP_TOL = dict(rtol=4e-3, atol=1e-5)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_ULP_TOL}


# --------------------------------------------------------------------------- the oracle
def allowed(mask_type, sq, sk, lq, lk, window):
    """[sq, sk] bool: may query i see key j (lq, lk: actual lengths of this sequence)."""
    left, right = (-1, -1) if window is None else window
    causal = "causal" in mask_type
    if causal:
        right = 0
    offset = 0 if mask_type in ("causal", "padding_causal") else lk - lq
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            if i >= lq or j >= lk:
                continue
            if right >= 0 and j > i + offset + right:
                continue
            if left >= 0 and j < i + offset - left:
                continue
            out[i, j] = True
    return out


def oracle(q, k, v, allow, scale):
    """q [b, sq, h, d], k/v [b, sk, hk, d], allow [b, h or 1, sq, sk] -> (out, lse) in fp64."""
    groups = q.shape[2] // k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def run_oracle(q, k, v, allow, scale, dout):
    q64, k64, v64 = (leaf(x.double()) for x in (q, k, v))
    out, lse = oracle(q64, k64, v64, allow, scale)
    out.backward(dout.double())
    return out.detach(), lse.detach(), (q64.grad, k64.grad, v64.grad)


def close(got, want, dtype, what):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype],
                               msg=lambda m: f"{what}: {m}")


def check(got_out, got_grads, want_out, want_grads, dtype):
    close(got_out, want_out, dtype, "out")
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        close(g, w, dtype, name)


def qkv(randn, b, sq, sk, h, hk, d, dtype, dv=None):
    return (randn(b, sq, h, d).to(dtype), randn(b, sk, hk, d).to(dtype),
            randn(b, sk, hk, dv or d).to(dtype))


def to_fmt(x, fmt):
    return x.transpose(0, 1).contiguous() if fmt == "sbhd" else x


def from_out(out, fmt, h):
    out = out.view(*out.shape[:-1], h, -1)
    return out.transpose(0, 1) if fmt == "sbhd" else out


def module_run(q, k, v, dout, fmt, **kw):
    """DotProductAttention on bshd data given in `fmt`; -> (out bshd [b,s,h,d], grads bshd)."""
    h, hk = q.shape[2], k.shape[2]
    mod = A.DotProductAttention(h, (q.shape[-1], v.shape[-1]), num_gqa_groups=hk, qkv_format=fmt,
                                **kw.pop("init", {}))
    ql, kl, vl = (leaf(to_fmt(x, fmt)) for x in (q, k, v))
    out = mod(ql, kl, vl, **kw)
    out4 = from_out(out, fmt, h)
    out4.backward(dout.to(out.dtype))
    grads = [from_out(x.grad.reshape(*x.shape[:-2], -1), fmt, x.shape[-2]) for x in (ql, kl, vl)]
    return out4, grads


# --------------------------------------------------------------------------- dense formats
MASKS_SQUARE = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                "padding_causal_bottom_right", "arbitrary"]


def _padding_for(mask_type, b, sq, sk, randn_lengths):
    lq, lk = randn_lengths
    if not mask_type.startswith("padding"):
        return None, [sq] * b, [sk] * b
    qm = torch.arange(sq)[None, :] >= torch.tensor(lq)[:, None]
    km = torch.arange(sk)[None, :] >= torch.tensor(lk)[:, None]
    if sq == sk and lq == lk:
        return qm.view(b, 1, 1, sq), lq, lk
    return (qm.view(b, 1, 1, sq), km.view(b, 1, 1, sk)), lq, lk


def _lengths(b, s, gen_seed):
    g = torch.Generator().manual_seed(gen_seed)
    lens = torch.randint(max(1, s // 2), s + 1, (b,), generator=g).tolist()
    lens[0] = s
    return lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask_type", MASKS_SQUARE)
@pytest.mark.parametrize("sq,sk", [(8, 8), (6, 11)], ids=["square", "rect"])
def test_masks_vs_oracle(mask_type, fmt, dtype, sq, sk, randn, _seed):
    b, h, hk, d = 2, 4, 2, 64
    q, k, v = qkv(randn, b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d).to(dtype)
    lq = _lengths(b, sq, _seed)
    lk = lq if sq == sk else _lengths(b, sk, _seed + 1)
    attention_mask, lq, lk = _padding_for(mask_type, b, sq, sk, (lq, lk))
    if mask_type == "arbitrary":
        gen = torch.Generator().manual_seed(_seed)
        attention_mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.3
        attention_mask[:, :, :, 0] = False                 # every row sees at least one key
        allow = ~attention_mask
    else:
        allow = torch.stack([allowed(mask_type, sq, sk, lq[i], lk[i], None)
                             for i in range(b)])[:, None]
    out, grads = module_run(q, k, v, dout, fmt, attn_mask_type=mask_type,
                            attention_mask=attention_mask)
    want, _, want_grads = run_oracle(q, k, v, allow, 1 / math.sqrt(d), dout)
    assert out.dtype == dtype and out.shape == (b, sq, h, d)
    check(out, grads, want, want_grads, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [(4, 0), (3, 2), (-1, -1), (0, 3)], ids=str)
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right",
                                       "padding_causal"])
@pytest.mark.parametrize("sq,sk", [(9, 9), (7, 12), (12, 7)], ids=["square", "wide", "tall"])
def test_sliding_window(mask_type, window, dtype, sq, sk, randn):
    b, h, hk, d = 2, 2, 1, 64
    q, k, v = qkv(randn, b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d).to(dtype)
    attention_mask = None
    lq, lk = [sq] * b, [sk] * b
    if mask_type == "padding_causal":
        lq, lk = [sq, sq - 2], [sk, sk - 3]
        attention_mask = ((torch.arange(sq)[None] >= torch.tensor(lq)[:, None]).view(b, 1, 1, sq),
                          (torch.arange(sk)[None] >= torch.tensor(lk)[:, None]).view(b, 1, 1, sk))
    allow = torch.stack([allowed(mask_type, sq, sk, lq[i], lk[i], window)
                         for i in range(b)])[:, None]
    out, grads = module_run(q, k, v, dout, "bshd", attn_mask_type=mask_type,
                            attention_mask=attention_mask, window_size=window)
    want, _, want_grads = run_oracle(q, k, v, allow, 1 / math.sqrt(d), dout)
    check(out, grads, want, want_grads, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_heads_and_dims(h, hk, d, dtype, randn):
    b, sq, sk = 2, 7, 10
    q, k, v = qkv(randn, b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d).to(dtype)
    out, grads = module_run(q, k, v, dout, "sbhd", attn_mask_type="causal_bottom_right")
    allow = allowed("causal_bottom_right", sq, sk, sq, sk, None)[None, None]
    want, _, want_grads = run_oracle(q, k, v, allow, 1 / math.sqrt(d), dout)
    check(out, grads, want, want_grads, dtype)


def test_kv_channels_pair_and_softmax_scale(randn):
    b, s, h, dqk, dv = 2, 6, 2, 32, 16
    q, k, v = qkv(randn, b, s, s, h, h, dqk, torch.float32, dv=dv)
    dout = randn(b, s, h, dv)
    out, grads = module_run(q, k, v, dout, "bshd", attn_mask_type="no_mask",
                            init=dict(softmax_scale=0.3))
    allow = torch.ones(1, 1, s, s, dtype=torch.bool)
    want, _, want_grads = run_oracle(q, k, v, allow, 0.3, dout)
    check(out, grads, want, want_grads, torch.float32)


# --------------------------------------------------------------------------- thd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["nowin", "win"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_thd_vs_padded(mask_type, window, cross, dtype, randn):
    """Packed sequences of varying lengths == the same sequences padded, through the oracle."""
    h, hk, d = 4, 2, 64
    lq = [5, 1, 8, 3]
    lk = [7, 4, 8, 2] if cross else lq
    b, sq, sk = len(lq), max(lq), max(lk)
    cu_q = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0, dtype=torch.int32) if cross else cu_q
    q = randn(int(cu_q[-1]), h, d).to(dtype)
    k = randn(int(cu_k[-1]), hk, d).to(dtype)
    v = randn(int(cu_k[-1]), hk, d).to(dtype)
    dout = randn(int(cu_q[-1]), h, d).to(dtype)
    mod = A.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd",
                                attn_mask_type=mask_type, window_size=window)
    ql, kl, vl = leaf(q), leaf(k), leaf(v)
    out = mod(ql, kl, vl, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)
    assert out.shape == (q.shape[0], h * d)
    out.view(-1, h, d).backward(dout)

    def padded(x, cu, s):
        p = torch.zeros(b, s, *x.shape[1:], dtype=x.dtype)
        for i in range(b):
            p[i, :int(cu[i + 1] - cu[i])] = x[int(cu[i]):int(cu[i + 1])]
        return p

    def packed(x, lens):
        return torch.cat([x[i, :n] for i, n in enumerate(lens)])

    allow = torch.stack([allowed(mask_type, sq, sk, lq[i], lk[i], window)
                         for i in range(b)])[:, None]
    want, _, (gq, gk, gv) = run_oracle(padded(q, cu_q, sq), padded(k, cu_k, sk),
                                       padded(v, cu_k, sk), allow, 1 / math.sqrt(d),
                                       padded(dout, cu_q, sq))
    check(out.view(-1, h, d), (ql.grad, kl.grad, vl.grad), packed(want, lq),
          (packed(gq, lq), packed(gk, lk), packed(gv, lk)), dtype)


def test_lse_bshd_and_thd(randn):
    b, s, h, d = 2, 6, 2, 16
    q, k, v = qkv(randn, b, s, s, h, h, d, torch.float32)
    out, lse = A.dot_product_attention(q, k, v, qkv_format="bshd", attn_mask_type="causal",
                                       return_lse=True)
    allow = allowed("causal", s, s, s, s, None)[None, None]
    want, want_lse = oracle(q, k, v, allow, 1 / math.sqrt(d))
    assert lse.dtype == torch.float32 and lse.shape == (b, h, s)
    close(lse, want_lse, torch.float32, "lse")
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
    _, lse_t = A.dot_product_attention(q.reshape(b * s, h, d), k.reshape(b * s, h, d),
                                       v.reshape(b * s, h, d), qkv_format="thd",
                                       attn_mask_type="padding_causal", cu_seqlens_q=cu,
                                       cu_seqlens_kv=cu, return_lse=True)
    assert lse_t.shape == (h, b * s)
    close(lse_t, want_lse.transpose(0, 1).reshape(h, b * s), torch.float32, "thd lse")


def test_fully_masked_rows_are_zero(randn):
    """bottom-right causal with s_q > s_kv: the first s_q - s_kv queries see no key."""
    q, k, v = qkv(randn, 1, 6, 3, 2, 2, 8, torch.float32)
    q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse = A.dot_product_attention(q, k, v, qkv_format="bshd",
                                       attn_mask_type="causal_bottom_right", return_lse=True)
    assert torch.all(out.view(1, 6, 2, 8)[:, :3] == 0) and torch.all(lse[:, :, :3] == -math.inf)
    out.sum().backward()
    assert torch.all(q.grad[:, :3] == 0) and torch.isfinite(k.grad).all()


# --------------------------------------------------------------------------- dropout
def test_reference_dropout_math(randn):
    """The reference's dropout: P * keep / (1 - p), lse undropped; backward replays keep."""
    b, s, h, d, p = 2, 7, 2, 16, 0.4
    q, k, v = qkv(randn, b, s, s, h, h, d, torch.float32)
    out, lse, keep = ref_attention.attention_fwd(q, k, v, None, 0.25, p,
                                                 generator=torch.Generator().manual_seed(3))
    assert keep is not None and 0.4 < keep.float().mean() < 0.8
    q64, k64, v64 = (leaf(x.double()) for x in (q, k, v))
    probs = torch.softmax((q64.transpose(1, 2) @ k64.permute(0, 2, 3, 1)) * 0.25, -1)
    want = ((probs * keep / (1 - p)) @ v64.transpose(1, 2)).transpose(1, 2)
    close(out, want, torch.float32, "dropout out")
    dout = randn(b, s, h, d)
    want.backward(dout.double())
    grads = ref_attention.attention_bwd(dout, q, k, v, out, lse, None, 0.25, p, keep)
    for name, g, w in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad)):
        close(g, w, torch.float32, name)


def test_module_dropout_only_in_training(randn):
    s, b, h, d = 8, 2, 2, 16
    x = [randn(s, b, h, d) for _ in range(3)]
    mod = A.DotProductAttention(h, d, attention_dropout=0.5, attn_mask_type="no_mask")
    plain = A.DotProductAttention(h, d, attn_mask_type="no_mask")
    assert not torch.allclose(mod(*x), plain(*x))
    mod.eval()
    torch.testing.assert_close(mod(*x), plain(*x), rtol=0, atol=0)


# --------------------------------------------------------------------------- ring contract
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_backward_blocks_merge_like_a_ring(dtype, randn):
    """Two KV blocks, each through attention_forward; outs merged with the fp32 lse equal the
    whole attention; attention_backward per block with the merged (out, lse) sums to its grads.
    fp32 at TE's fp32 tolerance. bf16: each block out is rounded to bf16 before the merge (half
    an ulp of a value <= max|v| ~ 4 here) and backward's rowsum(dO * out) reads the rounded
    merged out, so the bound is absolute: atol 2^-9 * 4 * 2 (two blocks) = 1.6e-2, rtol 4e-3."""
    b, sq, sk, h, hk, d = 2, 6, 10, 4, 2, 16
    q, k, v = qkv(randn, b, sq, sk, h, hk, d, dtype)
    v = v.clamp(-4, 4)
    tol = FP32_TOL if dtype == torch.float32 else dict(rtol=4e-3, atol=1.6e-2)

    def close(got, want, dtype, what):
        torch.testing.assert_close(got.double(), want.double(), **tol,
                                   msg=lambda m: f"{what}: {m}")
    dout = randn(b, sq, h, d).to(dtype)
    parts = []
    for sl in (slice(0, 4), slice(4, sk)):
        qc, kc, vc, args = A.prepare(q, k[:, sl], v[:, sl], qkv_format="bshd",
                                     attn_mask_type="no_mask")
        out, lse, state = A.attention_forward(qc, kc, vc, args)
        assert lse.dtype == torch.float32
        parts.append((kc, vc, args, out, lse, state))
    lse = torch.logaddexp(parts[0][4], parts[1][4])
    out = sum(p[3].float() * torch.exp(p[4] - lse).transpose(1, 2)[..., None] for p in parts)
    allow = torch.ones(1, 1, sq, sk, dtype=torch.bool)
    want, want_lse, (gq, gk, gv) = run_oracle(q, k, v, allow, 1 / math.sqrt(d), dout)
    close(out.to(dtype), want, dtype, "merged out")
    close(lse, want_lse, torch.float32, "merged lse")
    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for kc, vc, args, _, _, state in parts:
        g = A.attention_backward(dout, q, kc, vc, out.to(dtype), lse, state, args)
        dq += g[0].float()
        dks.append(g[1])
        dvs.append(g[2])
    close(dq.to(dtype), gq, dtype, "dq")
    close(torch.cat(dks, 1), gk, dtype, "dk")
    close(torch.cat(dvs, 1), gv, dtype, "dv")


def test_cudnn_takes_aligned_views_as_they_lie():
    """Which operands the cuDNN backend passes with their strides (no copy): sbhd views and
    slices of a fused QKV projection; not broadcast dims, a strided head dim or an offset that
    breaks 16-byte alignment (those get contiguous bshd copies)."""
    s, b, h, d = 16, 2, 4, 64
    fused = torch.randn(s, b, 3 * h * d, dtype=torch.bfloat16)
    q, k, v = (x.view(s, b, h, d).transpose(0, 1) for x in fused.split(h * d, -1))
    assert all(B._cudnn_strided_ok(x) for x in (q, k, v))
    assert B._cudnn_strided_ok(q.contiguous())
    assert not B._cudnn_strided_ok(torch.randn(b, 1, h, d, dtype=torch.bfloat16).expand(b, s, h, d))
    assert not B._cudnn_strided_ok(q.transpose(-1, -2))
    flat = torch.randn(b * s * h * d + 1, dtype=torch.bfloat16)
    assert not B._cudnn_strided_ok(flat[1:].view(b, s, h, d))
    copied = B._cudnn_operand(flat[1:].view(b, s, h, d), strided=True)
    assert copied.is_contiguous() and torch.equal(copied, flat[1:].view(b, s, h, d))
    assert B._cudnn_operand(q, strided=True) is q
    assert B._cudnn_operand(q, strided=False).is_contiguous()
