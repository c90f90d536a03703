"""The FP8 flash forward (`kernels.flash_attention.flash_attention_fp8_fwd`) vs its twin
(`ref.flash_attention.flash_attention_fp8_fwd` at the kernel's key tile) under the interpreter.

Tolerance, stated: the kernel and the twin run the same math in the same order of key blocks,
but not the same primitives (numpy's exp2 and matmul reduction order vs torch's differ in the
last fp32 bit). lse agrees to fp32 tolerance (1e-5 relative). out agrees to fp32 tolerance
except where such a last-bit difference moves one P entry across an E4M3 rounding boundary: that
entry changes by one E4M3 step (2^-4 of its value) and its output row by at most
2^-4 * max|v_dequantized|; the test allows that for at most 0.1% of out's elements and checks
everything else at 1e-5. Cases: causal and no mask (s_q != s_kv too, with key tails), GQA,
head dims 64 and 128, bshd and sbhd (the strided bshd view of an sbhd tensor), TMA descriptors.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tritium.kernels import flash_attention as K
from tritium.ref import flash_attention as R
from tritium.ref.attention import quantize_e4m3

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]

# (s_q, s_kv, h, h_kv, d, causal, layout[, band])
CASES = [(33, 33, 2, 2, 64, True, "bshd"), (24, 40, 2, 1, 64, False, "sbhd"),
         (40, 40, 4, 2, 128, True, "sbhd"), (17, 24, 2, 2, 128, False, "bshd"),
         (32, 32, 2, 1, 128, True, "bshd"), (48, 48, 2, 1, 64, True, "bshd", (-13, None)),
         (24, 40, 2, 2, 64, False, "sbhd", (10, 16))]


def _fp8_inputs(s_q, s_kv, h, h_kv, d, layout, gen):
    def one(s, heads, amp):
        x = torch.randn(s, 2, heads, d, generator=gen) * amp
        x = x.transpose(0, 1) if layout == "sbhd" else x.transpose(0, 1).contiguous()
        scale = torch.tensor([448.0]) / x.abs().amax()
        return quantize_e4m3(x, scale), 1.0 / scale
    (q, dq), (k, dk), (v, dv) = one(s_q, h, 3.0), one(s_kv, h_kv, 2.0), one(s_kv, h_kv, 1.0)
    return q, k, v, torch.cat([dq, dk, dv]).float()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}-hk{}-d{}-{}-{}{}".format(
    *c[:5], "causal" if c[5] else "nomask", c[6], f"-band{c[7]}" if len(c) > 7 else ""))
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_fp8_forward_matches_twin(case, tma, monkeypatch):
    s_q, s_kv, h, h_kv, d, causal, layout = case[:7]
    band = case[7] if len(case) > 7 else None
    if tma:
        monkeypatch.setattr(K, "INTERP_CFG", K.Cfg(16, 16, 4, 1, tma=True))
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v, descale = _fp8_inputs(s_q, s_kv, h, h_kv, d, layout, gen)
    scale = d ** -0.5
    out, lse = K.flash_attention_fp8_fwd(q, k, v, descale, causal, scale, band=band)
    want_out, want_lse = R.flash_attention_fp8_fwd(q, k, v, descale, causal, scale,
                                                   block_n=K.fp8_block_n(d, False), band=band)
    assert out.dtype == torch.float32 and out.shape == want_out.shape
    assert torch.equal(lse.isinf(), want_lse.isinf())
    lse, want_lse = lse.nan_to_num(neginf=0.0), want_lse.nan_to_num(neginf=0.0)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    vmax = (v.float() * descale[2]).abs().max().item()
    err = (out - want_out).abs()
    tight = err <= 1e-5 * want_out.abs().max().item() + 1e-5 * want_out.abs()
    assert int((~tight).sum()) <= max(1, out.numel() // 1000), \
        f"{int((~tight).sum())} of {out.numel()} outside fp32 tolerance"
    assert err.max().item() <= 2.0 ** -4 * vmax, err.max().item()
    # bf16 out is the fp32 result rounded once
    out16, _ = K.flash_attention_fp8_fwd(q, k, v, descale, causal, scale,
                                         out_dtype=torch.bfloat16, band=band)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, out.to(torch.bfloat16))
    # fp8_mha's E4M3 out: the fp32 out scaled and rounded once, its amax max-recorded, in the
    # sbhd memory order where asked; without the 16-bit out where not kept
    o_scale = torch.tensor([200.0]) / out.abs().max()
    for seq_first, keep_hp in ((False, True), (True, False)):
        amax = torch.tensor([0.25])
        spec = K.FP8Out(o_scale, amax, seq_first, keep_hp)
        hp, lse8, out8 = K.flash_attention_fp8_fwd(q, k, v, descale, causal, scale,
                                                   out_dtype=torch.bfloat16, band=band,
                                                   fp8_out=spec)
        assert (hp is None) != keep_hp and torch.equal(lse8.nan_to_num(neginf=0.0), lse)
        if keep_hp:
            assert torch.equal(hp, out16)
        assert out8.dtype == torch.float8_e4m3fn and out8.shape == out.shape
        assert out8.transpose(0, 1).is_contiguous() == seq_first
        assert torch.equal(out8.float(), quantize_e4m3(out, o_scale).float())
        assert amax.item() == max(0.25, out.abs().max().item())
        want_amax = torch.tensor([0.25])
        _, _, want8 = R.flash_attention_fp8_fwd(
            q, k, v, descale, causal, scale, block_n=K.fp8_block_n(d, False), band=band,
            fp8_out=K.FP8Out(o_scale, want_amax, seq_first, keep_hp))
        step = 2.0 ** -3 * want8.float().abs() + 2.0 ** -9  # one E4M3 step (and subnormals)
        assert ((out8.float() - want8.float()).abs() <= step + 1.1 * o_scale * err).all()
        torch.testing.assert_close(amax, want_amax, rtol=1e-5, atol=0)


def test_fp8_forward_refuses_bad_input():
    q = torch.zeros(1, 16, 2, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head dim"):
        K.flash_attention_fp8_fwd(q, q, q, torch.ones(3), True, 1.0)
    q = torch.zeros(1, 16, 2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="descale"):
        K.flash_attention_fp8_fwd(q, q, q, torch.ones(2), True, 1.0)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_dot_product_attention_runs_the_fp8_kernel(fmt, mask):
    """Under fp8_autocast(fp8_dpa=True) DotProductAttention picks triton_fp8 here: its out is
    the kernel's FP8 forward of the quantized q/k/v (fp16 here: the interpreter's bf16 tl.dot is
    wrong), its grads the speed-mode flash backward on the dequantized q/k/v."""
    import tritium as te
    from tritium.attention import DotProductAttention, explain
    from tritium.attention import fp8 as F
    from tritium.fp8 import recipe
    gen = torch.Generator().manual_seed(3 + len(fmt) + len(mask))
    b, s, h, h_kv, d = 2, 24, 4, 2, 64

    def rnd(heads):
        x = torch.randn(b, s, heads, d, generator=gen).half()
        return (x.transpose(0, 1).contiguous() if fmt == "sbhd" else x).requires_grad_()
    q, k, v = rnd(h), rnd(h_kv), rnd(h_kv)
    assert explain(q, k, v, qkv_format=fmt, attn_mask_type=mask, fp8_dpa=True).backend \
        == "triton_fp8"
    m = DotProductAttention(h, d, num_gqa_groups=h_kv, qkv_format=fmt, attn_mask_type=mask)
    r = recipe.Float8CurrentScaling(fp8_dpa=True)
    with te.fp8_autocast(fp8_recipe=r):
        out = m(q, k, v)
    dy = torch.randn(out.shape, generator=gen).half()
    out.backward(dy)

    def bshd(x):
        return x.transpose(0, 1) if fmt == "sbhd" else x
    plan = F.FP8AttnPlan(r, None, False)
    q8, k8, v8, descale, v8_t = F.quantize(plan, bshd(q), bshd(k), bshd(v),
                                           v_keys_contiguous=True)
    assert v8_t.stride(1) == 1 and torch.equal(v8_t, v8)   # V with the keys contiguous
    want, lse = K.flash_attention_fp8_fwd(q8, k8, v8_t, descale, mask == "causal", d ** -0.5,
                                          out_dtype=torch.float16)
    assert torch.equal(bshd(out.view(*out.shape[:2], h, d)), want)
    deq = [F.dequantize(x, descale[i], torch.float16) for i, x in enumerate((q8, k8, v8))]
    grads = K.flash_attention_bwd(bshd(dy.view(*dy.shape[:2], h, d)), *deq, want, lse,
                                  mask == "causal", d ** -0.5, split=False,
                                  grad_dtype=torch.float16)
    for got, g in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(bshd(got), g)


def test_fp8_forward_takes_windows_and_leaves_thd_to_the_emulation():
    """A sliding window or bottom-right causal with s_q != s_kv runs the FP8 kernel's band;
    packed sequences (thd) go to torch_fp8 (the emulation), with triton_fp8's reason, while
    the bf16 triton backend takes them."""
    from tritium.attention import explain
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 24, 4, 64, generator=gen).half()
    for kw, sk in ((dict(attn_mask_type="causal", window_size=(8, 0)), 24),
                   (dict(attn_mask_type="causal_bottom_right"), 40)):
        k, v = (torch.randn(2, sk, 2, 64, generator=gen).half() for _ in range(2))
        assert explain(q, k, v, qkv_format="bshd", fp8_dpa=True, **kw).backend == "triton_fp8"
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    q, k, v = (torch.randn(48, n, 64, generator=gen).half() for n in (4, 2, 2))
    kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
              cu_seqlens_kv=cu)
    e = explain(q, k, v, fp8_dpa=True, **kw)
    assert e.backend == "torch_fp8" and "not in the FP8 forward" in e.reasons["triton_fp8"]
    assert explain(q, k, v, backend="triton", **kw).backend == "triton"


def test_fp8_configs_share_the_key_tile(monkeypatch):
    """The GPU's causal and no-mask FP8 configs of a head dim share block_n (the twin quantizes
    P at the key tile's running maxima: `fp8_block_n` names one tile); a table that breaks this
    is refused with the reason."""
    for d in K.FP8_HEAD_DIMS:
        assert K.fp8_block_n(d, True) == K.GPU_CFG["fwd_fp8"][(d, True)].block_n
        assert K.fp8_block_n(d, True) == K.GPU_CFG["fwd_fp8"][(d, False)].block_n
    monkeypatch.setitem(K.GPU_CFG["fwd_fp8"], (128, True), K.Cfg(64, 64, 4, 3, tma=True))
    with pytest.raises(ValueError, match="share block_n"):
        K.fp8_block_n(128, True)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_dot_product_attention_fp8_mha_writes_the_kernels_e4m3_out(fmt):
    """Under DelayedScaling(fp8_mha=True) the output is the kernel's E4M3 epilogue output at
    the O state's scale (sbhd: memory [s, b, h, d], no copy), a Float8Tensor [.., h * d]; the
    backward is fp8_dpa's on the 16-bit out the same launch wrote."""
    import tritium as te
    from tritium.attention import DotProductAttention
    from tritium.attention import fp8 as F
    from tritium.fp8 import recipe
    from tritium.fp8.recompute import FrozenScales
    from tritium.fp8.tensor import Float8Tensor
    gen = torch.Generator().manual_seed(13 + len(fmt))
    b, s, h, h_kv, d = 2, 24, 4, 2, 64

    def rnd(heads):
        x = torch.randn(b, s, heads, d, generator=gen).half()
        return (x.transpose(0, 1).contiguous() if fmt == "sbhd" else x).requires_grad_()
    q, k, v = rnd(h), rnd(h_kv), rnd(h_kv)
    m = DotProductAttention(h, d, num_gqa_groups=h_kv, qkv_format=fmt, attention_dropout=0.0)
    r = recipe.DelayedScaling(fp8_mha=True, amax_history_len=1)
    with te.fp8_autocast(fp8_recipe=r):
        m(q, k, v)   # records the amaxes: the next call's scales are 448 / amax
    o_scale = m.fp8_out_state.scale.clone()
    plan = F.FP8AttnPlan(r, FrozenScales(m.fp8_attn_state), False)   # the q/k/v scales now
    with te.fp8_autocast(fp8_recipe=r):
        out = m(q, k, v)
    assert isinstance(out, Float8Tensor) and tuple(out.shape[-1:]) == (h * d,)

    def bshd(x):
        return x.transpose(0, 1) if fmt == "sbhd" else x
    q8, k8, v8, descale, v8_t = F.quantize(plan, bshd(q), bshd(k), bshd(v),
                                           v_keys_contiguous=True)
    hp, lse, want8 = K.flash_attention_fp8_fwd(
        q8, k8, v8_t, descale, True, d ** -0.5, out_dtype=torch.float16,
        fp8_out=K.FP8Out(o_scale, None, fmt == "sbhd"))
    assert torch.equal(bshd(out._data.view(*out.shape[:2], h, d)).float(), want8.float())
    torch.testing.assert_close(out._scale_inv, 1.0 / o_scale, rtol=0, atol=0)
    dy = torch.randn(out.shape, generator=gen).half()
    out.backward(dy)
    deq = [F.dequantize(x, descale[i], torch.float16) for i, x in enumerate((q8, k8, v8))]
    grads = K.flash_attention_bwd(bshd(dy.view(*dy.shape[:2], h, d)), *deq, hp, lse, True,
                                  d ** -0.5, split=False, grad_dtype=torch.float16)
    for got, g in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(bshd(got), g)
