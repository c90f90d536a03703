"""cpu tier: FP8 attention (recipe fp8_dpa=True) - the emulation, its accuracy, its state.

* The emulation (`torch_fp8`, what runs on the CPU) vs an independent emulation written here:
  per-tensor current scales (448 / amax), S = q8 k8^T in fp32 times the descales, softmax in
  fp32 with natural exp, P = exp(S - rowmax) quantized to E4M3 with scale 448, out = P8 v8 *
  dv / 448 / rowsum(P). The two differ only in exp vs exp2 and reduction order (last fp32
  bits); such a difference may move one P entry across an E4M3 rounding boundary (one E4M3
  step, 2^-4 of it), so at most 0.1% of out's elements may differ by up to 2^-4 max|v| and
  all others agree to 1e-5. lse agrees to 1e-5.
* Error vs float64 exact attention of the same (16-bit) inputs, for bf16 attention and FP8
  attention, out and dq / dk / dv; measures as docs/numerics.md: max = max|a - r| / max|r|,
  mean = mean|a - r| / mean|r|. FP8 bounds in units of E4M3's unit roundoff u = 2^-4: each
  element of q, k, v and P carries a relative rounding error of at most u (rms ~u/3 over a
  binade). out = sum_j P_j v_j takes three independent such sources - S's error through q and
  k (a d-term sum of products with random-sign errors, scaled like S), P's own rounding and
  v's - each an rms relative error of about u/3 to u/2 of out, so their root-sum-square
  (the mean error) stays below u, and the worst element below 2u; the gradients, from the
  dequantized inputs, carry the same three. Measured: mean 0.5u-0.85u, max 0.27u-1.23u
  (docs/numerics.md). bf16 attention has only its output / gradient roundings (bf16 u = 2^-9):
  mean below 2^-8, max below 2^-7. The table is `tritium.numerics.attention_fp8_errors` (fp8
  delayed after warm-up steps, fp8 current), which docs/numerics.md shows.
* Delayed scaling: the q/k/v amaxes are recorded, the state updates once at autocast exit
  (scale = 448 / amax), the next call quantizes with those scales; checkpoint recompute records
  nothing and reproduces the gradients; the module's GEMM states still get their backward update.
* Recipes: fp8_dpa on DelayedScaling / Float8CurrentScaling, block recipes refused (fp8_mha:
  tests/test_fp8_mha.py); dropout, forced non-FP8 backends and context parallelism refused
  before any state changes.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.attention import DotProductAttention, dot_product_attention, explain
from tritium.fp8 import recipe
from tritium.numerics import attention_fp8_errors

pytestmark = pytest.mark.cpu

E4 = torch.float8_e4m3fn
U = 2.0 ** -4
CURRENT = recipe.Float8CurrentScaling(fp8_dpa=True)


def _qkv(b, s, h, h_kv, d, gen, dtype=torch.bfloat16, layout="bshd"):
    def one(heads, amp):
        x = (torch.randn(b, s, heads, d, generator=gen) * amp).to(dtype)
        if layout == "sbhd":
            x = x.transpose(0, 1).contiguous()
        return x.requires_grad_()
    return one(h, 1.0), one(h_kv, 1.0), one(h_kv, 1.0)


def _independent(q, k, v, causal, scale):
    """FP8 attention written out from its definition (bshd, GQA by repeating heads)."""
    def quant(x):
        s = 448.0 / x.detach().float().abs().amax()
        return (x.detach().float() * s).clamp(-448, 448).to(E4).float(), 1.0 / s
    (q8, dq), (k8, dk), (v8, dv) = quant(q), quant(k), quant(v)
    g = q.shape[2] // k.shape[2]
    k8, v8 = k8.repeat_interleave(g, 2), v8.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q8, k8) * (scale * dq * dk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    p8 = (p * 448.0).to(E4).float()
    out = torch.einsum("bhqk,bkhd->bqhd", p8, v8) * (dv / 448.0)
    out = out / p.sum(-1).transpose(1, 2)[..., None]
    return out, (m[..., 0] + p.sum(-1).log())


@pytest.mark.parametrize("case", [(2, 40, 4, 2, 64, True), (1, 33, 2, 2, 128, False),
                                  (2, 24, 4, 1, 64, False)],
                         ids=["gqa-d64-causal", "d128-nomask", "mqa-d64-nomask"])
def test_emulation_matches_independent_emulation(case):
    b, s, h, h_kv, d, causal = case
    gen = torch.Generator().manual_seed(11 + d + s)
    q, k, v = _qkv(b, s, h, h_kv, d, gen, torch.float32)
    from tritium.attention import fp8 as F
    with te.fp8_autocast(fp8_recipe=CURRENT):
        plan = F.plan_for(DotProductAttention(h, d), q.device)
        out, lse = dot_product_attention(q, k, v, qkv_format="bshd", backend="torch",
                                         attn_mask_type="causal" if causal else "no_mask",
                                         return_lse=True, fp8=plan)
    want, want_lse = _independent(q, k, v, causal, d ** -0.5)
    out = out.view_as(want)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    err = (out - want).abs()
    tight = err <= 1e-5 * (want.abs().max() + want.abs())
    assert int((~tight).sum()) <= max(1, out.numel() // 1000)
    vmax = v.detach().abs().max().item()
    assert err.max().item() <= U * vmax
    # and it is not bf16 attention: the quantization shows
    plain = dot_product_attention(q, k, v, qkv_format="bshd", backend="torch",
                                  attn_mask_type="causal" if causal else "no_mask")
    assert (plain.view_as(want) - want).abs().max() > 1e-3


# --- error vs fp64 -------------------------------------------------------------------------
# bounds (max, mean): bf16 attention's errors are its output / gradient roundings (bf16 u =
# 2^-9); FP8's are the quantization of q, k, v and P (u = 2^-4), see the module note
BOUNDS = {"bf16": (2.0 ** -7, 2.0 ** -8), "fp8 delayed": (2 * U, U), "fp8 current": (2 * U, U),
          # fp8_mha's E4M3 output: one more rounding (mean), and saturation where this call's
          # max exceeds the warm-up's amax history (max: 0.15 in one row, docs/numerics.md)
          "fp8_mha delayed": (3 * U, U)}


def test_error_vs_fp64_within_bounds():
    rows = attention_fp8_errors()
    assert {mode for _, mode in rows} == set(BOUNDS)
    for (shape, mode), errs in rows.items():
        max_b, mean_b = BOUNDS[mode]
        for name, (mx, mean) in errs.items():
            assert mx <= max_b and mean <= mean_b, (shape, mode, name, mx, mean)
        if mode != "bf16":  # FP8 is measurably worse than bf16 (the quantization is real)
            assert errs["out"][1] > 4 * rows[(shape, "bf16")]["out"][1]
        if mode == "fp8_mha delayed":   # the output's own rounding on top; the same gradients
            assert errs["out"][1] > rows[(shape, "fp8 delayed")]["out"][1]
            assert errs["dq"] == rows[(shape, "fp8 delayed")]["dq"]


# --- delayed scaling state -----------------------------------------------------------------
def test_delayed_scaling_state_updates_at_autocast_exit():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(2, 48, 4, 2, 64, gen)
    m = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format="bshd")
    r = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    amax = torch.stack([x.detach().float().abs().amax() for x in (q, k, v)])
    with te.fp8_autocast(fp8_recipe=r):
        m(q, k, v).float().sum().backward()
        st = m.fp8_attn_state
        assert torch.equal(st.amax_history[0], amax) and torch.equal(st.scale, torch.ones(3))
    torch.testing.assert_close(st.scale, 448.0 / amax, rtol=2e-7, atol=0)  # 1 ulp
    assert torch.equal(st.amax_history[-1], amax) and not st.amax_history[0].any()
    # the next call quantizes with the updated scales: = current scaling on the same data
    with te.fp8_autocast(fp8_recipe=r):
        out = m(q, k, v)
    with te.fp8_autocast(fp8_recipe=CURRENT):
        want = m(q, k, v)
    assert torch.equal(out, want)


def test_delayed_state_does_not_take_the_regions_backward_update():
    """A Linear after the attention still gets the region's backward scale update."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = _qkv(1, 32, 2, 2, 64, gen)
    attn = DotProductAttention(2, 64, qkv_format="bshd")
    lin = te.Linear(128, 32, params_dtype=torch.bfloat16)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2)):
        y = lin(attn(q, k, v))
    y.float().sum().backward()
    assert lin.fp8_meta.bwd.amax_history[-1].item() > 0  # rolled: the update ran
    assert attn.fp8_attn_state.amax_history[-1].gt(0).all()


def test_checkpoint_recompute_uses_the_forward_scales_and_records_nothing():
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(1, 32, 2, 2, 64, gen)
    m = DotProductAttention(2, 64, qkv_format="bshd")
    r = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=3, amax_compute_algo="most_recent")
    with te.fp8_autocast(fp8_recipe=r):
        m(q * 2, k * 2, v * 2)   # a first step on other data: the exit after the next forward
    #                             changes the scales, so a recompute with live scales would differ
    grads, hist = [], []
    for ckpt in (False, True):
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
        saved = (m.fp8_attn_state.amax_history.clone(), m.fp8_attn_state.scale.clone())
        with te.fp8_autocast(fp8_recipe=r):
            out = (te.distributed.checkpoint(m, q2, k2, v2) if ckpt else m(q2, k2, v2))
        out.float().square().sum().backward()
        assert not m.fp8_attn_state.amax_history[0].any()  # the recompute recorded nothing
        assert not torch.equal(m.fp8_attn_state.scale, saved[1])
        grads.append((out.detach(), q2.grad, k2.grad, v2.grad))
        hist.append(m.fp8_attn_state.amax_history.clone())
        m.fp8_attn_state.amax_history.copy_(saved[0])
        m.fp8_attn_state.scale.copy_(saved[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert torch.equal(hist[0], hist[1])


# --- recipes, choice, refusals -------------------------------------------------------------
def test_recipes_accept_fp8_dpa():
    assert recipe.DelayedScaling(fp8_dpa=True).fp8_dpa and CURRENT.fp8_dpa
    assert recipe.recipe_from_dict(recipe.DelayedScaling(fp8_dpa=True).to_dict()).fp8_dpa
    for cls in (recipe.Float8BlockScaling, recipe.MXFP8BlockScaling):
        with pytest.raises(NotImplementedError, match="per-tensor recipes"):
            cls(fp8_dpa=True)


def test_explain_and_refusals():
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(1, 16, 2, 2, 32, gen)
    e = explain(q, k, v, qkv_format="bshd", fp8_dpa=True)
    assert e.backend == "torch_fp8" and "triton_fp8" in e.reasons
    assert "selected" in e.reasons["torch_fp8"]
    m = DotProductAttention(2, 32, qkv_format="bshd", attention_dropout=0.1)
    with te.fp8_autocast(fp8_recipe=CURRENT):
        with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
            m(q, k, v)
        m.eval()
        m(q, k, v)
    assert m.fp8_attn_state is None  # current scaling keeps no state
    m = DotProductAttention(2, 32, qkv_format="bshd")
    m._cp_size = lambda: 2      # as with a cp_group of two ranks: refused before any state
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="context parallelism"):
            m(q, k, v)
    assert m.fp8_attn_state is None
    m = DotProductAttention(2, 32, qkv_format="bshd", backend="cudnn")
    with te.fp8_autocast(fp8_recipe=CURRENT):
        with pytest.raises(ValueError, match="backend='cudnn' has no FP8 attention"):
            m(q, k, v)


def test_thd_and_padding_run_in_the_emulation():
    gen = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    q = torch.randn(48, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    k = torch.randn(48, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    v = torch.randn(48, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    m = DotProductAttention(2, 64, qkv_format="thd", attn_mask_type="padding_causal")
    with te.fp8_autocast(fp8_recipe=CURRENT):
        out = m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out.float().sum().backward()
    ref = m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    rel = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert 1e-3 < rel.item() < 2 * U and q.grad.isfinite().all()



@pytest.mark.parametrize("r", [CURRENT, recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2)],
                         ids=["current", "delayed"])
def test_multihead_attention_checkpoint_core_attention(r):
    """checkpoint_core_attention recomputes the FP8 attention under the forward's autocast and
    scales: the same output and gradients as without it, no amax recorded by the recompute."""
    torch.manual_seed(0)
    mha = te.MultiheadAttention(128, 2, attention_dropout=0.0, params_dtype=torch.bfloat16,
                                device="cpu")
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = []
    for ckpt in (False, True):
        xx = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=r):
            y = mha(xx, checkpoint_core_attention=ckpt)
        state = mha.core_attention.fp8_attn_state
        if state is not None:   # delayed: the exit rolled the recorded amaxes out of row 0
            assert not state.amax_history[0].any()
        y.float().square().sum().backward()
        if state is not None:   # the recompute recorded nothing; then reset every FP8 state
            assert not state.amax_history[0].any()   # so that the second run starts alike
            state.amax_history.zero_()
            state.scale.fill_(1.0)
            for m in mha.modules():
                if hasattr(m, "fp8_meta") and m.fp8_meta.fwd is not None:
                    for st in (m.fp8_meta.fwd, m.fp8_meta.bwd):
                        st.amax_history.zero_()
                        st.scale.fill_(1.0)
        results.append([y.detach(), xx.grad] + [p.grad.clone() for p in mha.parameters()])
        mha.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_calibration_records_amaxes_and_runs_bf16():
    gen = torch.Generator().manual_seed(10)
    q, k, v = _qkv(1, 32, 2, 2, 64, gen)
    m = DotProductAttention(2, 64, qkv_format="bshd")
    with te.fp8_autocast(enabled=False, calibrating=True,
                         fp8_recipe=recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2)):
        out = m(q, k, v)
    assert torch.equal(out, m(q, k, v))   # 16-bit attention
    amax = torch.stack([x.detach().float().abs().amax() for x in (q, k, v)])
    torch.testing.assert_close(m.fp8_attn_state.scale, 448.0 / amax, rtol=2e-7, atol=0)  # 1 ulp
