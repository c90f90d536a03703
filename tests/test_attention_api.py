"""cpu tier: DotProductAttention's backend choice, explain(), the forced-backend paths and every
argument error. The CUDA backends' support rules are exercised on CPU tensors by pretending the
device checks pass (their kernels are not run here; tests/gpu/test_gpu_attention.py runs them).
"""
from __future__ import annotations

import pytest
import torch

import tritium.attention as A
from tritium import _env
from tritium.attention import backends as B

pytestmark = pytest.mark.cpu


def _qkv(b=2, sq=8, sk=8, h=4, hk=2, d=64, dtype=torch.bfloat16, fmt="bshd"):
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return tuple(x.transpose(0, 1) for x in (q, k, v)) if fmt == "sbhd" else (q, k, v)


def test_explain_on_cpu_names_the_reference_and_why_not_the_others():
    ex = A.explain(*_qkv(), qkv_format="bshd", attn_mask_type="causal")
    assert ex.backend == "torch"
    text = str(ex)
    for name in ("flash", "cudnn", "efficient"):
        assert f"{name}: needs CUDA" in text
    assert "torch: selected" in text and "s_q=8" in text and "mask=causal" in text


def test_forced_cuda_backend_on_cpu_lists_the_reason():
    with pytest.raises(RuntimeError, match="flash: needs CUDA"):
        A.dot_product_attention(*_qkv(), qkv_format="bshd", backend="flash")
    ex = A.explain(*_qkv(), qkv_format="bshd", backend="cudnn")
    assert ex.backend is None and "cudnn: needs CUDA" in str(ex)


def test_env_backend_is_read_through_env(monkeypatch):
    monkeypatch.setattr(_env, "attn_backend", lambda: "efficient", raising=False)
    with pytest.raises(RuntimeError, match="efficient: needs CUDA"):
        A.dot_product_attention(*_qkv(), qkv_format="bshd")
    monkeypatch.setattr(_env, "attn_backend", lambda: "math", raising=False)
    assert A.explain(*_qkv(), qkv_format="bshd").backend == "torch"


def test_module_backend_argument():
    mod = A.DotProductAttention(4, 64, num_gqa_groups=2, backend="flash", qkv_format="bshd")
    with pytest.raises(RuntimeError, match="no attention backend supports this call"):
        mod(*_qkv())
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        A.DotProductAttention(4, 64, backend="nope")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA device checks pass on CPU tensors; everything else is each backend's own rule."""
    monkeypatch.setattr(B, "_cuda_reason", lambda q, name, dtypes, min_cc=(8, 0):
                        None if q.dtype in dtypes else f"{name}: dtype")
    facts = B.device_facts
    monkeypatch.setattr(B, "device_facts", lambda device: facts(device)._replace(cudnn=True))
    monkeypatch.setattr(B, "_order", lambda q, fmt=None: (
        ("flash", "cudnn", "efficient", "torch") if fmt == "thd"
        else ("cudnn", "flash", "efficient", "torch")))


def _why(q, k, v, **kw):
    return A.explain(q, k, v, **kw).reasons


CASES = [  # (kwargs, tensors kwargs, backend chosen, {backend: reason fragment})
    (dict(attn_mask_type="causal"), {}, "cudnn", {}),
    (dict(attn_mask_type="causal"), dict(sq=6, sk=9), "efficient",
     {"cudnn": "causal with s_q 6 != s_kv 9", "flash": "top-left"}),
    (dict(attn_mask_type="causal_bottom_right"), dict(sq=6, sk=9), "flash", {}),
    (dict(attn_mask_type="no_mask", window_size=(4, 0)), {}, "flash",
     {"cudnn": "sliding window (4, 0)"}),
    (dict(attn_mask_type="causal", window_size=(4, 0)), dict(sq=6, sk=9), "efficient",
     {"flash": "top-left causal/window with s_q != s_kv"}),
    (dict(attn_mask_type="no_mask"), dict(d=256), "flash", {"cudnn": "head dims (256, 256)"}),
    (dict(attn_mask_type="no_mask"), dict(d=264), "efficient",
     {"flash": "head_dim 264 unsupported", "cudnn": "(264, 264) unsupported"}),
    (dict(attn_mask_type="no_mask"), dict(d=260), "torch",
     {"efficient": "not multiples of 8"}),
    (dict(attn_mask_type="no_mask"), dict(dtype=torch.float32), "efficient",
     {"flash": "dtype", "cudnn": "dtype"}),
    (dict(attn_mask_type="no_mask"), dict(dtype=torch.float64), "torch", {"efficient": "dtype"}),
    (dict(attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool)),
     {}, "efficient", {"cudnn": "padding masks", "flash": "qkv_format='thd'"}),
    (dict(attn_mask_type="arbitrary", attention_mask=torch.zeros(2, 1, 8, 8, dtype=torch.bool)),
     {}, "efficient", {"cudnn": "arbitrary", "flash": "arbitrary"}),
    (dict(attn_mask_type="no_mask", dropout_p=0.1), {}, "flash", {"cudnn": "multiple of 1/16"}),
]


@pytest.mark.parametrize("kw,tkw,chosen,why", CASES)
def test_backend_rules(fake_cuda, kw, tkw, chosen, why):
    ex = A.explain(*_qkv(**tkw), qkv_format="bshd", **kw)
    assert ex.backend == chosen, str(ex)
    for name, frag in why.items():
        if frag is None:
            continue
        assert frag in ex.reasons[name], str(ex)


def test_thd_goes_to_flash_varlen(fake_cuda):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16(), \
        torch.randn(8, 2, 64).bfloat16()
    ex = A.explain(q, k, v, qkv_format="thd", attn_mask_type="padding_causal",
                   cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert ex.backend == "flash" and "not tried" in ex.reasons["cudnn"]
    # top-left causal with different q/kv lengths: flash (bottom-right only) refuses; cuDNN
    # takes thd one sequence at a time
    other = torch.tensor([0, 4, 8], dtype=torch.int32)
    ex = A.explain(q, k, v, qkv_format="thd", attn_mask_type="padding_causal",
                   cu_seqlens_q=cu, cu_seqlens_kv=other)
    assert ex.backend == "cudnn" and "top-left" in ex.reasons["flash"]


# --------------------------------------------------------------------------- errors
def _call(q, k, v, **kw):
    return A.dot_product_attention(q, k, v, **kw)


ERRORS = [
    (lambda: _call(*_qkv()[:2], torch.randn(2, 8, 2, 64), qkv_format="bshd"), TypeError,
     "dtypes differ"),
    (lambda: _call(*(x[0] for x in _qkv()), qkv_format="bshd"), ValueError,
     r"qkv_format='bshd' needs 4 dims \[b, s, h, d\]"),
    (lambda: _call(*_qkv(), qkv_format="bhsd"), ValueError, "qkv_format='bhsd' is not one of"),
    (lambda: _call(*_qkv(hk=3), qkv_format="bshd"), ValueError,
     "4 query heads are not a multiple of 3"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="diagonal"), ValueError,
     "attn_mask_type='diagonal' is not a mask type"),
    (lambda: _call(*_qkv(), qkv_format="bshd", window_size=(2, -3)), ValueError,
     "must be >= 0 or -1"),
    (lambda: _call(*_qkv(), qkv_format="bshd", window_size=5), ValueError, "pair of ints"),
    (lambda: _call(*(x[0] for x in _qkv()), qkv_format="thd"), ValueError,
     "needs cu_seqlens_q and cu_seqlens_kv"),
    (lambda: _call(*(x[0] for x in _qkv()), qkv_format="thd",
                   cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_kv=torch.tensor([0, 8])),
     ValueError, "1-D torch.int32"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="padding"), ValueError,
     "needs attention_mask"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="padding",
                   attention_mask=torch.zeros(2, 1, 8, 1, dtype=torch.bool)), ValueError,
     r"a padding mask is \[b, 1, 1, s\]"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="padding",
                   attention_mask=torch.zeros(2, 1, 1, 8)), TypeError, "dtype torch.bool"),
    (lambda: _call(*_qkv(sk=6), qkv_format="bshd", attn_mask_type="padding",
                   attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool)), ValueError,
     "needs a pair"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="arbitrary",
                   attention_mask=torch.zeros(2, 3, 8, 8, dtype=torch.bool)), ValueError,
     r"must broadcast to \[b, h, s_q, s_kv\]"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="arbitrary"), TypeError,
     "needs attention_mask, a bool tensor"),
    (lambda: _call(*_qkv(), qkv_format="bshd", attn_mask_type="causal",
                   attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool)), ValueError,
     "takes None"),
    (lambda: _call(*_qkv(), qkv_format="bshd", dropout_p=1.0), ValueError, r"in \[0, 1\)"),
    (lambda: A.DotProductAttention(6, 64, num_gqa_groups=4), ValueError,
     "num_attention_heads=6 must be divisible by num_gqa_groups=4"),
    (lambda: A.DotProductAttention(4, (64, 0)), ValueError, "kv_channels must be"),
    (lambda: A.DotProductAttention(4, 64, attention_type="both"), ValueError, "attention_type"),
    (lambda: A.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format="bshd")(*_qkv()),
     ValueError, r"must be \[heads, head_dim\] = \[4, 32\]"),
    (lambda: A.DotProductAttention(4, 64, num_gqa_groups=2, qkv_format="bshd")(
        *_qkv(), core_attention_bias_type="post_scale_bias"), NotImplementedError,
     "attention bias is not supported"),
]


@pytest.mark.parametrize("make,exc,match", ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_choice_is_cached_and_logged(caplog):
    import logging
    B._CACHE.clear()
    q, k, v = _qkv(dtype=torch.float32)
    with caplog.at_level(logging.DEBUG, logger="tritium"):
        A.dot_product_attention(q, k, v, qkv_format="bshd")
        A.dot_product_attention(q, k, v, qkv_format="bshd")
    msgs = [r.getMessage() for r in caplog.records if "attention:" in r.getMessage()]
    assert len(msgs) == 1 and "torch backend" in msgs[0] and "flash: needs CUDA" in msgs[0]
