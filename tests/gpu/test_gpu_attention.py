"""gpu tier: each CUDA attention backend (cudnn, flash, efficient; triton on its square and sbhd
cases), forced, against an fp64 softmax reference on the same 16-bit inputs, forward, lse and
every grad, over the masks, formats, windows and head layouts it claims (backends.py). Skipped
without CUDA.

Tolerance (flash-attn's own test rule): a fused kernel rounds P to 16 bits before P @ V and
works in tiles, so it cannot match fp64 to half an ulp. Its error must be at most
2 x the error of a plain 16-bit PyTorch implementation (matmuls in the input dtype, softmax in
fp32, P rounded) plus the output's own rounding, measured as max abs over the tensor. The lse is
fp32 from exact 16-bit products: within 2e-3 absolute of the fp64 lse.
Also: backend auto-choice on this GPU, thd varlen vs padded, fully masked rows, GQA.
"""
from __future__ import annotations

import math

import pytest
import torch

import tritium.attention as A
import tritium.attention.backends as B

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def allowed(mask_type, sq, sk, lq, lk, window, device):
    left, right = (-1, -1) if window is None else window
    if "causal" in mask_type:
        right = 0
    off = 0 if mask_type in ("causal", "padding_causal") else lk - lq
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ok = (i < lq) & (j < lk)
    if right >= 0:
        ok &= j <= i + off + right
    if left >= 0:
        ok &= j >= i + off - left
    return ok


def reference(q, k, v, allow, scale, dout, low: bool):
    """fp64 (low=False) or plain 16-bit PyTorch attention (low=True): out, lse, grads."""
    dt = q.dtype if low else torch.float64
    groups = q.shape[2] // k.shape[2]
    qq, kk, vv = (x.detach().to(dt).requires_grad_(True) for x in (q, k, v))
    qh = qq.transpose(1, 2)
    kh = kk.transpose(1, 2).repeat_interleave(groups, 1)
    vh = vv.transpose(1, 2).repeat_interleave(groups, 1)
    s = (qh @ kh.transpose(-1, -2)).float() * scale if low else (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = (p.to(dt) @ vh).transpose(1, 2)
    out.backward(dout.to(dt))
    return out.detach(), lse.detach(), (qq.grad, kk.grad, vv.grad)


def assert_fused_close(got, ref64, low, what):
    err = (got.double() - ref64).abs().max().item()
    base = (low.double() - ref64).abs().max().item()
    rounding = (ref64.to(got.dtype).double() - ref64).abs().max().item()
    assert err <= 2 * base + 2 * rounding + 1e-5, \
        f"{what}: max err {err:.3g} > 2 x plain-16-bit err {base:.3g} + rounding {rounding:.3g}"


def run(backend, q, k, v, dout, fmt="bshd", **kw):
    fmt = kw.pop("qkv_format", fmt)
    ql, kl, vl = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = A.dot_product_attention(ql, kl, vl, qkv_format=fmt, backend=backend,
                                       return_lse=True, **kw)
    out = out.view(*out.shape[:-1], q.shape[-2], -1)
    out.backward(dout)
    return out, lse, (ql.grad, kl.grad, vl.grad)


def compare(backend, q, k, v, allow, dout, dtype, fmt="bshd", **kw):
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse, grads = run(backend, q, k, v, dout, fmt, **kw)
    o64, l64, g64 = reference(q, k, v, allow, scale, dout, low=False)
    o16, _, g16 = reference(q, k, v, allow, scale, dout, low=True)
    assert out.dtype == dtype
    assert_fused_close(out, o64, o16, f"{backend} out")
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, g64, g16):
        assert_fused_close(g, w, lo, f"{backend} {name}")
    rows = torch.isfinite(l64)
    torch.testing.assert_close(lse[rows].double(), l64[rows], rtol=0, atol=2e-3)
    assert torch.all(lse[~rows] == -math.inf)


def data(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)


DT = [torch.bfloat16, torch.float16]
HEADS = [(8, 8), (8, 2), (8, 1)]


def _skip_if_rejected(backend, q, k, v, **kw):
    ex = A.explain(q, k, v, backend=backend, **kw)
    if ex.backend is None:
        pytest.skip(str(ex))


@pytest.mark.parametrize("dtype", DT, ids=["bf16", "fp16"])
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "triton"])
def test_square(backend, mask_type, d, h, hk, dtype):
    b, s = 2, 384
    q, k, v, dout = data(b, s, s, h, hk, d, dtype, seed=d + h + hk)
    _skip_if_rejected(backend, q, k, v, qkv_format="bshd", attn_mask_type=mask_type)
    allow = allowed(mask_type, s, s, s, s, None, "cuda")
    compare(backend, q, k, v, allow, dout, dtype, attn_mask_type=mask_type)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "triton"])
def test_sbhd_layout(backend):
    b, s, h, d = 2, 256, 8, 64
    q, k, v, dout = data(b, s, s, h, h, d, torch.bfloat16, seed=5)
    allow = allowed("causal", s, s, s, s, None, "cuda")
    t = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731
    out, lse, grads = run(backend, t(q), t(k), t(v), t(dout), fmt="sbhd", attn_mask_type="causal")
    o64, l64, g64 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=False)
    o16, _, g16 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=True)
    assert_fused_close(out.transpose(0, 1), o64, o16, "sbhd out")
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, g64, g16):
        assert_fused_close(g.transpose(0, 1), w, lo, name)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "triton"])
def test_sbhd_slices_of_a_fused_qkv(backend):
    """q, k, v as TransformerLayer makes them: views into one [s, b, (h + 2 hk) d] projection
    (GQA), no copies; grads land in the fused tensor's slices."""
    b, s, h, hk, d = 2, 256, 8, 2, 64
    q, k, v, dout = data(b, s, s, h, hk, d, torch.bfloat16, seed=9)
    fused = torch.cat([x.transpose(0, 1).reshape(s, b, -1) for x in (q, k, v)], -1)
    fused.requires_grad_(True)
    widths = [h * d, hk * d, hk * d]
    ql, kl, vl = (x.view(s, b, -1, d) for x in fused.split(widths, -1))
    _skip_if_rejected(backend, ql, kl, vl, qkv_format="sbhd", attn_mask_type="causal")
    out = A.dot_product_attention(ql, kl, vl, qkv_format="sbhd", attn_mask_type="causal",
                                  backend=backend)
    out.backward(dout.transpose(0, 1).reshape(s, b, h * d))
    allow = allowed("causal", s, s, s, s, None, "cuda")
    o64, _, g64 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=False)
    o16, _, g16 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=True)
    assert_fused_close(out.view(s, b, h, d).transpose(0, 1), o64, o16, f"{backend} out")
    grads = [g.view(s, b, -1, d).transpose(0, 1) for g in fused.grad.split(widths, -1)]
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, g64, g16):
        assert_fused_close(g, w, lo, f"{backend} {name}")


@pytest.mark.parametrize("window", [(64, 0), (32, 16), (-1, -1)], ids=str)
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("sq,sk", [(256, 256), (192, 320)], ids=["square", "rect"])
@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_windows_and_bottom_right(backend, mask_type, window, sq, sk):
    q, k, v, dout = data(2, sq, sk, 8, 2, 64, torch.bfloat16, seed=sq + sk)
    kw = dict(qkv_format="bshd", attn_mask_type=mask_type, window_size=window)
    _skip_if_rejected(backend, q, k, v, **kw)
    allow = allowed(mask_type, sq, sk, sq, sk, window, "cuda")
    compare(backend, q, k, v, allow, dout, torch.bfloat16, **kw)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "arbitrary"])
def test_efficient_masks(mask_type):
    b, s, h, d = 3, 200, 4, 64
    q, k, v, dout = data(b, s, s, h, h, d, torch.bfloat16, seed=11)
    lens = [200, 131, 7]
    if mask_type == "arbitrary":
        gen = torch.Generator("cuda").manual_seed(1)
        m = torch.rand(b, 1, s, s, device="cuda", generator=gen) < 0.5
        m[..., 0] = False
        allow, mask = ~m, m
    else:
        pad = torch.arange(s, device="cuda")[None] >= torch.tensor(lens, device="cuda")[:, None]
        mask = pad.view(b, 1, 1, s)
        allow = torch.stack([allowed(mask_type, s, s, n, n, None, "cuda") for n in lens])[:, None]
    out, lse, grads = run("efficient", q, k, v, dout, attn_mask_type=mask_type,
                          attention_mask=mask)
    o64, l64, g64 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=False)
    o16, _, g16 = reference(q, k, v, allow, 1 / math.sqrt(d), dout, low=True)
    assert_fused_close(out, o64, o16, "out")
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, g64, g16):
        assert_fused_close(g, w, lo, name)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "torch"])
def test_thd_varlen(backend, mask_type, cross):
    h, hk, d = 8, 2, 64
    lq = [300, 17, 128, 1, 64]
    lk = [280, 40, 128, 9, 64] if cross else lq
    cu_q = torch.tensor([0] + lq, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk, device="cuda").cumsum(0).to(torch.int32) if cross else cu_q
    b, sq, sk = len(lq), max(lq), max(lk)
    qp, kp, vp, dp = data(b, max(sq, sk), max(sq, sk), h, hk, d, torch.bfloat16, seed=3)
    qp, dp, kp, vp = qp[:, :sq], dp[:, :sq], kp[:, :sk], vp[:, :sk]
    pack = lambda x, lens: torch.cat([x[i, :n] for i, n in enumerate(lens)])  # noqa: E731
    kw = dict(qkv_format="thd", attn_mask_type=mask_type, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)
    q, k, v, dout = pack(qp, lq), pack(kp, lk), pack(vp, lk), pack(dp, lq)
    _skip_if_rejected(backend, q, k, v, **kw)
    out, lse, grads = run(backend, q, k, v, dout, **kw)
    allow = torch.stack([allowed(mask_type, sq, sk, lq[i], lk[i], None, "cuda")
                         for i in range(b)])[:, None]
    dpz = dp.clone()
    for i, n in enumerate(lq):
        dpz[i, n:] = 0
    o64, l64, g64 = reference(qp, kp, vp, allow, 1 / math.sqrt(d), dpz, low=False)
    o16, _, g16 = reference(qp, kp, vp, allow, 1 / math.sqrt(d), dpz, low=True)
    assert_fused_close(out, pack(o64, lq), pack(o16, lq), "thd out")
    for name, g, w, lo, lens in zip(("dq", "dk", "dv"), grads, g64, g16, (lq, lk, lk)):
        assert_fused_close(g, pack(w, lens), pack(lo, lens), f"thd {name}")
    assert lse.shape == (h, q.shape[0])
    want_lse = pack(l64.transpose(1, 2), lq).t()
    rows = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[rows].double(), want_lse[rows], rtol=0, atol=2e-3)


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_fully_masked_rows(backend):
    q, k, v, dout = data(1, 256, 128, 4, 4, 64, torch.bfloat16, seed=2)
    out, lse, grads = run(backend, q, k, v, dout, attn_mask_type="causal_bottom_right")
    assert torch.all(out[:, :128] == 0) and torch.all(lse[:, :, :128] == -math.inf)
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :128] == 0)


def test_auto_choice_on_this_gpu():
    """bf16 B4 H32 S4096 D128-shaped calls pick the fastest backend: cuDNN on sm90/sm100."""
    q = torch.empty(1, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    ex = A.explain(q, q, q, qkv_format="bshd", attn_mask_type="causal")
    major = torch.cuda.get_device_capability()[0]
    assert ex.backend == ("cudnn" if major in (9, 10) else "flash"), str(ex)
    print(ex)
    # windows and packed sequences: triton where measured faster (sm90), else flash
    want = "triton" if (major, 128, "window") in B.MEASURED_FASTER else "flash"
    ex = A.explain(q, q, q, qkv_format="bshd", attn_mask_type="causal", window_size=(1024, 0))
    assert ex.backend == want, str(ex)
    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32, device="cuda")
    t = q[0]
    ex = A.explain(t, t, t, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                   cu_seqlens_kv=cu, max_seqlen_q=3096, max_seqlen_kv=3096)
    want = "triton" if (major, 128, "thd") in B.MEASURED_FASTER else "flash"
    assert ex.backend == want, str(ex)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_dropout_runs_and_differs(backend):
    q, k, v, dout = data(2, 256, 256, 4, 4, 64, torch.bfloat16, seed=9)
    kw = dict(qkv_format="bshd", attn_mask_type="causal", dropout_p=0.125)
    _skip_if_rejected(backend, q, k, v, **kw)
    out, _, grads = run(backend, q, k, v, dout, **kw)
    plain, _, _ = run(backend, q, k, v, dout, qkv_format="bshd", attn_mask_type="causal")
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert not torch.allclose(out, plain)
    # E[dropout out] = out: the mean over many elements agrees closely
    assert abs(out.float().mean() - plain.float().mean()) < 0.05
