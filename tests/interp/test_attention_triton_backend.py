"""The "triton" attention backend (tritium/attention/backends.py) under the interpreter.

Forced (backend="triton"), DotProductAttention runs the kernel's speed mode: its out and grads
are the launchers' split=False results in the input dtype bit for bit, and they agree with the
reference backend ("torch") to a 16-bit kernel's error (P / dS rounded once to fp16), for bshd
and sbhd, causal and no mask, GQA; sliding windows and bottom-right causal (the kernel's band)
agree with the reference backend likewise. Auto takes it only where `MEASURED_FASTER` lists the
call's class (explain() says why not otherwise); unsupported calls get a reason. fp16 inputs (the
interpreter's bf16 tl.dot is wrong, see conftest.py).
"""
from __future__ import annotations

import pytest
import torch

import tritium.attention as A
from tritium.attention import backends as B
from tritium.kernels import flash_attention as K

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,  # the interpreter's own numpy warning on tensor loop bounds
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]

H, HK, D = 4, 2, 16


def _qkv(gen, b=2, s=24, fmt="bshd"):
    def rnd(heads):
        x = torch.randn(b, s, heads, D, generator=gen).half()
        return x.transpose(0, 1).contiguous() if fmt == "sbhd" else x
    return rnd(H), rnd(HK), rnd(HK)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_forced_triton_is_the_speed_mode_kernel_and_matches_the_reference(fmt, mask, gen):
    q, k, v = _qkv(gen, fmt=fmt)
    w = torch.randn(*q.shape[:2], H * D, generator=gen).half()
    results = {}
    for backend in ("triton", "torch"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = A.dot_product_attention(*leaves, qkv_format=fmt, attn_mask_type=mask,
                                      softmax_scale=0.3, backend=backend)
        (out.float() * w.float()).sum().backward()
        results[backend] = [out.detach()] + [x.grad for x in leaves]
    bshd = (lambda x: x.transpose(0, 1)) if fmt == "sbhd" else (lambda x: x)
    causal = mask == "causal"
    qb, kb, vb = (bshd(x) for x in (q, k, v))
    want_out, lse = K.flash_attention_fwd(qb, kb, vb, causal, 0.3, split=False,
                                          out_dtype=torch.float16)
    dout = bshd(w.view(*q.shape[:2], H, D))
    want = [want_out, *K.flash_attention_bwd(dout, qb, kb, vb, want_out, lse, causal, 0.3,
                                             split=False, grad_dtype=torch.float16)]
    got = results["triton"]
    assert_same_bits(bshd(got[0].view(*q.shape[:2], H, D)), want[0], "out")
    for name, g, x in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert_same_bits(bshd(g).contiguous(), x, name)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, results["torch"]):
        assert g.dtype == r.dtype == torch.float16
        err = (g.float() - r.float()).abs().max().item()
        assert err <= 4e-3 * r.float().abs().max().item(), f"{name}: {err:.3e}"


def test_auto_takes_triton_only_where_measured_faster(gen, monkeypatch):
    q, k, v = _qkv(gen)
    ex = A.explain(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    assert ex.backend == "torch"
    assert "not in backends.MEASURED_FASTER" in ex.reasons["triton"], str(ex)
    monkeypatch.setattr(B, "MEASURED_FASTER", frozenset({(None, D, "causal")}))
    monkeypatch.setattr(B, "_CACHE", {})
    ex = A.explain(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    assert ex.backend == "triton" and "selected" in ex.reasons["triton"], str(ex)
    assert A.explain(q, k, v, qkv_format="bshd", attn_mask_type="no_mask").backend == "torch"
    # a window is its own class (the kernel's band path), measured apart from plain causal
    ex = A.explain(q, k, v, qkv_format="bshd", attn_mask_type="causal", window_size=(5, 0))
    assert ex.backend == "torch" and "'window')" in ex.reasons["triton"], str(ex)


@pytest.mark.parametrize("mask,window,sq,sk", [
    ("causal", (5, 0), 40, 40), ("causal", (20, 0), 24, 40), ("no_mask", (3, 2), 24, 40),
    ("no_mask", (7, -1), 40, 24), ("causal_bottom_right", None, 24, 40),
    ("causal_bottom_right", (6, 0), 40, 24)])
def test_forced_triton_windows_and_bottom_right_match_the_reference(mask, window, sq, sk, gen):
    """Sliding windows (top-left for "causal", bottom-right otherwise) and bottom-right causal
    with s_q != s_kv run the kernel's band; out and grads agree with the reference backend to a
    16-bit kernel's error, rows that see no key included (output 0, no gradient)."""
    q = torch.randn(2, sq, H, D, generator=gen).half()
    k, v = (torch.randn(2, sk, HK, D, generator=gen).half() for _ in range(2))
    w = torch.randn(2, sq, H, D, generator=gen).half()
    assert A.explain(q, k, v, qkv_format="bshd", attn_mask_type=mask, window_size=window,
                     backend="triton").backend == "triton"
    results = {}
    for backend in ("triton", "torch"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = A.dot_product_attention(*leaves, qkv_format="bshd", attn_mask_type=mask,
                                      window_size=window, softmax_scale=0.3, backend=backend)
        (out.float() * w.float().flatten(2)).sum().backward()
        results[backend] = [out.detach()] + [x.grad for x in leaves]
    for name, g, r in zip(("out", "dq", "dk", "dv"), results["triton"], results["torch"]):
        assert r.abs().max() > 0 and g.dtype == r.dtype == torch.float16
        err = (g.float() - r.float()).abs().max().item()
        assert err <= 4e-3 * r.float().abs().max().item(), f"{name}: {err:.3e}"


@pytest.mark.parametrize("mask,window", [("padding_causal", None), ("padding", None),
                                         ("padding_causal_bottom_right", (6, 0)),
                                         ("padding", (4, 4))])
def test_forced_triton_thd_matches_the_reference(mask, window, gen):
    """Packed sequences (thd, cu_seqlens) on the kernel's varlen path: out and grads agree with
    the reference backend (which pads them) to a 16-bit kernel's error."""
    lens = [9, 30, 1, 17]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    t = sum(lens)
    q = torch.randn(t, H, D, generator=gen).half()
    k, v = (torch.randn(t, HK, D, generator=gen).half() for _ in range(2))
    w = torch.randn(t, H * D, generator=gen).half()
    kw = dict(qkv_format="thd", attn_mask_type=mask, window_size=window, cu_seqlens_q=cu,
              cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    assert A.explain(q, k, v, backend="triton", **kw).backend == "triton"
    results = {}
    for backend in ("triton", "torch"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = A.dot_product_attention(*leaves, softmax_scale=0.3, backend=backend, **kw)
        (out.float() * w.float()).sum().backward()
        results[backend] = [out.detach()] + [x.grad for x in leaves]
    for name, g, r in zip(("out", "dq", "dk", "dv"), results["triton"], results["torch"]):
        assert r.abs().max() > 0 and g.shape == r.shape
        err = (g.float() - r.float()).abs().max().item()
        assert err <= 4e-3 * r.float().abs().max().item(), f"{name}: {err:.3e}"


@pytest.mark.parametrize("kw,why", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(dtype=torch.float32), "needs float16/bfloat16"),
    (dict(d=24), "head dims")])
def test_unsupported_calls_name_the_reason(kw, why, gen):
    kw = dict(kw)
    dtype, d, sk = kw.pop("dtype", torch.float16), kw.pop("d", D), kw.pop("sk", 24)
    q = torch.randn(2, 24, H, d, generator=gen).to(dtype)
    k, v = (torch.randn(2, sk, HK, d, generator=gen).to(dtype) for _ in range(2))
    kw.setdefault("attn_mask_type", "causal")
    ex = A.explain(q, k, v, qkv_format="bshd", backend="triton", **kw)
    assert ex.backend is None and why in ex.reasons["triton"], str(ex)


def test_thd_bottom_right_with_unequal_lengths_names_the_reason(gen):
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_kv = torch.tensor([0, 8, 12], dtype=torch.int32)
    q = torch.randn(12, H, D, generator=gen).half()
    k, v = (torch.randn(12, HK, D, generator=gen).half() for _ in range(2))
    kw = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, backend="triton")
    ex = A.explain(q, k, v, attn_mask_type="padding_causal_bottom_right", **kw)
    assert ex.backend is None and "differ per sequence" in ex.reasons["triton"], str(ex)
    assert A.explain(q, k, v, attn_mask_type="padding", **kw).backend == "triton"
