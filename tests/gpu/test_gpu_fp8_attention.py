"""gpu tier: the FP8 flash forward (fp8_dpa) on CUDA vs its twin, and the layer end to end.

Kernel vs twin (`ref.flash_attention.flash_attention_fp8_fwd` at the kernel's key tile): same
math and block order, but not bit for bit: Hopper's tensor cores add E4M3 products in a
reduced-precision accumulator (S = q k^T and P @ V; the twin sums the exact products in fp32),
and exp2 is ex2.approx. A score off in its last bits can move a P entry across an E4M3 rounding
boundary (one step, 2^-4 of it), so a large share of out's elements differ from the twin's by
about one P step (measured on an H100: 7-84% beyond 1e-4 x max|out|, growing with s_kv). The
test therefore measures both against exact attention (fp64, the dequantized q/k/v): the
kernel's error is the twin's (mean within 1%, max within 1.5x), its distance from the twin a
fraction of that error (mean <= 0.3x; measured 0.06-0.2x), lse to 2^-11 (a score's
accumulator error: measured 2e-4 relative on a causal first row, which sees one key). Cases: B2 H8,
s_kv 1024 and 4096, head dims 64 and 128, causal and no mask, GQA, bshd and sbhd (strided views:
the wrapper makes V keys-contiguous), s_q != s_kv, a sliding window and bottom-right causal (the
kernel's band; not yet run on a GPU); V passed keys-contiguous (as the layer does)
gives the same bits. The layer: DotProductAttention under fp8_autocast(fp8_dpa=True) picks
triton_fp8, and its out / grads are within FP8's error of bf16 attention's. Skipped without
CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [(1024, 1024, 8, 8, 128, True, "bshd"), (1024, 1024, 8, 2, 128, False, "sbhd"),
         (1024, 1024, 8, 1, 64, True, "sbhd"), (512, 1024, 8, 8, 64, False, "bshd"),
         (4096, 4096, 8, 8, 128, False, "bshd"),
         (2048, 2048, 8, 2, 128, True, "bshd", (-700, None)),    # a sliding window
         (512, 1024, 8, 8, 64, False, "sbhd", (None, 512))]      # bottom-right causal


@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}-hk{}-d{}-{}-{}{}".format(
    *c[:5], "causal" if c[5] else "nomask", c[6], f"-band{c[7]}" if len(c) > 7 else ""))
def test_fp8_kernel_matches_twin_on_cuda(case):
    from tritium.kernels import flash_attention as K
    from tritium.ref import flash_attention as R
    from tritium.ref.attention import quantize_e4m3
    s_q, s_kv, h, h_kv, d, causal, layout = case[:7]
    band = case[7] if len(case) > 7 else None
    g = torch.Generator(device="cuda").manual_seed(s_q + d + h_kv)

    def one(s, heads):
        x = torch.randn(s, 2, heads, d, device="cuda", generator=g)
        x = x.transpose(0, 1) if layout == "sbhd" else x.transpose(0, 1).contiguous()
        scale = (448.0 / x.abs().amax()).reshape(1)
        return quantize_e4m3(x, scale), 1.0 / scale
    (q, dq), (k, dk), (v, dv) = one(s_q, h), one(s_kv, h_kv), one(s_kv, h_kv)
    descale = torch.cat([dq, dk, dv]).float()
    out, lse = K.flash_attention_fp8_fwd(q, k, v, descale, causal, d ** -0.5, band=band)
    want, want_lse = R.flash_attention_fp8_fwd(q, k, v, descale, causal, d ** -0.5,
                                               block_n=K.fp8_block_n(d, True), band=band)
    torch.testing.assert_close(lse, want_lse, rtol=2 ** -11, atol=2 ** -11)
    exact = _exact_attention(q, k, v, descale, causal, d ** -0.5, band)
    kernel_err, twin_err = (out.double() - exact).abs(), (want.double() - exact).abs()
    assert kernel_err.mean() <= 1.01 * twin_err.mean()
    assert kernel_err.max() <= 1.5 * twin_err.max()
    assert (out - want).abs().mean() <= 0.3 * twin_err.mean()
    # fp8_mha's epilogue: the same fp32 out scaled, rounded once to E4M3, its amax recorded
    o_scale = (200.0 / out.abs().amax()).reshape(1)
    amax = torch.zeros(1, device="cuda")
    hp, _, out8 = K.flash_attention_fp8_fwd(q, k, v, descale, causal, d ** -0.5, band=band,
                                            fp8_out=K.FP8Out(o_scale, amax, layout == "sbhd"))
    assert torch.equal(hp, out) and out8.transpose(0, 1).is_contiguous() == (layout == "sbhd")
    assert torch.equal(out8.float(), quantize_e4m3(out, o_scale).float())
    assert amax.item() == out.abs().max().item() > 0
    v_keys_contiguous = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    again, _ = K.flash_attention_fp8_fwd(q, k, v_keys_contiguous, descale, causal, d ** -0.5,
                                         band=band)
    assert torch.equal(again, out)


def _exact_attention(q8, k8, v8, descale, causal, scale, band=None):
    """fp64 softmax attention of the dequantized E4M3 inputs (bshd, GQA by repetition; band:
    key j hidden from query i unless lo <= j - i <= hi)."""
    q, k, v = (x.double() * descale[i].double() for i, x in enumerate((q8, k8, v8)))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    if band is not None:
        i = torch.arange(s.shape[-2], device=s.device)[:, None]
        j = torch.arange(s.shape[-1], device=s.device)[None, :]
        lo, hi = band
        s = s.masked_fill(((j - i < lo) if lo is not None else False)
                          | ((j - i > hi) if hi is not None else False), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_layer_picks_the_fp8_kernel_and_stays_within_fp8_error():
    import tritium as te
    from tritium.attention import DotProductAttention, explain
    from tritium.fp8 import recipe
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 1024, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for h in (8, 2, 2))
    assert explain(q, k, v, qkv_format="bshd", fp8_dpa=True, backend="triton").backend \
        == "triton_fp8"
    m = DotProductAttention(8, 128, num_gqa_groups=2, qkv_format="bshd", backend="triton")
    dy = torch.randn(2, 1024, 8 * 128, device="cuda", generator=g, dtype=torch.bfloat16)
    res = []
    for fp8 in (False, True):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.Float8CurrentScaling(fp8_dpa=True)):
            out = m(q, k, v)
        out.backward(dy)
        res.append([out.detach().float()] + [x.grad.float() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    for a, b in zip(*res):
        rel = ((a - b).abs().mean() / b.abs().mean()).item()
        assert 1e-3 < rel < 2.0 ** -4, rel


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_compiled_fp8_attention_runs_the_kernel_ops_and_equals_eager(fmt):
    """Under torch.compile(fullgraph=True) FP8 attention runs the Triton kernel through the
    custom ops (tritium::flash_attn_fp8_fwd, flash_attn_bwd), not the emulation: the traced
    graphs call them, and with fp8_mha the compiled MHA's output equals eager's bit for bit
    (the same kernels and casts), its gradients to the backward's bf16 rounding."""
    import copy
    import torch._dynamo
    import tritium as te
    from tritium.fp8 import recipe
    torch.manual_seed(3)
    base = te.MultiheadAttention(1024, 8, num_gqa_groups=2, attention_dropout=0.0,
                                 params_dtype=torch.bfloat16, qkv_format=fmt, device="cuda")
    shape = (2, 1024, 1024) if fmt == "bshd" else (1024, 2, 1024)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    r = recipe.DelayedScaling(fp8_mha=True, amax_history_len=4)
    results = []
    for compiled in (False, True):
        mha = copy.deepcopy(base)
        te.prepare_fp8(mha, r)

        def step(xx):
            with te.fp8_autocast(fp8_recipe=r):
                return mha(xx)
        if compiled:
            graphs = torch._dynamo.explain(step)(x.clone().requires_grad_()).graphs
            text = "\n".join(m.code for g in graphs for _, m in g.named_modules()
                             if hasattr(m, "code"))
            assert "flash_attn_fp8_fwd" in text and "flash_attn_bwd" in text
            mha = copy.deepcopy(base)   # explain ran a step: start again
            te.prepare_fp8(mha, r)
            step = torch.compile(step, fullgraph=True)
        runs = []
        for _ in range(2):
            xx = x.clone().requires_grad_()
            y = step(xx)
            y.float().square().mean().backward()
            runs.append([y.detach(), xx.grad])
        results.append(runs)
        torch._dynamo.reset()
    for (y0, g0), (y1, g1) in zip(*results):
        assert torch.equal(y0, y1)
        assert ((g0.float() - g1.float()).abs().max() <= 2 ** -7 * g0.float().abs().max())
