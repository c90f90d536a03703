"""cpu tier: fp8_mha (TE's recipe flag): FP8 attention whose output reaches the output
projection in E4M3, through the emulation (`torch_fp8`) that runs on the CPU.

* DotProductAttention returns a Float8Tensor in the caller's format ([b, s, h*d], [s, b, h*d],
  [t, h*d]; sbhd without a copy): under delayed scaling its data is the fp32 attention output
  times the O state's scale, rounded once (checked against fp8_dpa's 16-bit output: within one
  E4M3 step plus the 16-bit rounding), its amax max-recorded (the O state updates at autocast
  exit like the q/k/v state); under current scaling the 16-bit output's own scale.
* Backward: the same 16-bit backward as fp8_dpa (bit for bit, for the same dout), and no 16-bit
  output kept without grad.
* MultiheadAttention: the output projection takes the Float8Tensor as its fp8 input (its own
  input amax slot records nothing: no cast) and equals proj(core_attention(...)) bit for bit;
  under current scaling fp8_mha equals fp8_dpa bit for bit (forward and every gradient: the
  projection would cast the same 16-bit output with the same scale).
* State: saved beside the q/k/v state (o_scale / o_amax_history), loaded back; checkpoints
  without it load (the O state starts fresh); bad entries raise naming the fix. Calibration
  records the output's amax; checkpoint_core_attention reproduces output and gradients.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.attention import DotProductAttention
from tritium.fp8 import recipe
from tritium.fp8.tensor import Float8Tensor
from tritium.ref.attention import quantize_e4m3

pytestmark = pytest.mark.cpu

U = 2.0 ** -4   # E4M3's relative step (3 mantissa bits: half-step 2^-4 rounding error)


def _delayed(**kw):
    return recipe.DelayedScaling(fp8_mha=True, amax_history_len=2, **kw)


def _qkv(fmt, gen, b=2, s=24, h=4, h_kv=2, d=64):
    def one(heads):
        x = torch.randn(b, s, heads, d, generator=gen).to(torch.bfloat16)
        if fmt == "sbhd":
            x = x.transpose(0, 1).contiguous()
        return x.requires_grad_()
    return one(h), one(h_kv), one(h_kv)


def _thd(gen):
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    q, k, v = (torch.randn(24, n, 64, generator=gen).to(torch.bfloat16).requires_grad_()
               for n in (4, 2, 2))
    return (q, k, v), dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="padding_causal")


def _call(fmt, gen):
    if fmt == "thd":
        qkv, kw = _thd(gen)
    else:
        qkv, kw = _qkv(fmt, gen), {}
    return qkv, kw


def test_recipes_take_fp8_mha_and_block_recipes_refuse_it():
    for r in (_delayed(), recipe.Float8CurrentScaling(fp8_mha=True)):
        assert r.fp8_mha and recipe.recipe_from_dict(r.to_dict()).fp8_mha
    for cls in (recipe.Float8BlockScaling, recipe.MXFP8BlockScaling):
        with pytest.raises(NotImplementedError, match="fp8_mha=True.*per-tensor"):
            cls(fp8_mha=True)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_output_is_float8_in_the_callers_format(fmt):
    """Delayed: a first call records amaxes; the second quantizes O at 448 / amax. Its E4M3
    data is within one E4M3 step (plus bf16 rounding) of fp8_dpa's 16-bit output, and the O
    amax recorded is that output's max (to bf16 rounding)."""
    gen = torch.Generator().manual_seed(11 + len(fmt))
    (q, k, v), kw = _call(fmt, gen)
    m = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format=fmt, attention_dropout=0.0)
    ref = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format=fmt, attention_dropout=0.0)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=_delayed(amax_compute_algo="most_recent")):
            out = m(q, k, v, **kw)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True,
                                                              amax_history_len=2)):
            want = ref(q, k, v, **kw)
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16
    assert out.shape == want.shape and out._data.is_contiguous()
    o_state = m.fp8_out_state
    amax = o_state.amax_history[1, 0]   # the second call's, rolled by the exit's update
    torch.testing.assert_close(amax, want.detach().float().abs().amax(), rtol=2.0 ** -8, atol=0)
    torch.testing.assert_close(o_state.scale, 448.0 / amax.reshape(1), rtol=2e-7, atol=0)
    deq = out.dequantize().float()
    w = want.detach().float()
    assert ((deq - w).abs() <= (U + 2.0 ** -8) * w.abs() + 2.0 ** -9 * amax).all()
    assert (deq - w).abs().max() > 0   # it is quantized
    # the q/k/v inputs were quantized at the same scales in both modules
    torch.testing.assert_close(m.fp8_attn_state.scale, ref.fp8_attn_state.scale, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_backward_is_fp8_dpas_and_no_grad_keeps_no_16_bit_out(fmt, monkeypatch):
    from tritium.attention import fp8 as F
    backend = F.FP8_BACKENDS["torch_fp8"]
    specs, fwd = [], backend.fwd
    monkeypatch.setattr(backend, "fwd", lambda *a: (specs.append(a[6:]), fwd(*a))[1])
    gen = torch.Generator().manual_seed(21 + len(fmt))
    (q, k, v), _ = _call(fmt, gen)
    grads = []
    for r in (_delayed(), recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2)):
        m = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format=fmt, attention_dropout=0.0)
        with te.fp8_autocast(fp8_recipe=r):
            out = m(q, k, v)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        out.backward(dy)
        grads.append([x.grad.clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b) and a.abs().sum() > 0
    m = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format=fmt, attention_dropout=0.0)
    with te.fp8_autocast(fp8_recipe=_delayed()):
        with_grad = m(q, k, v)
    m.fp8_out_state.amax_history.zero_()   # the same scales for the no-grad call
    m.fp8_out_state.scale.fill_(1.0)
    m.fp8_attn_state.amax_history.zero_()
    m.fp8_attn_state.scale.fill_(1.0)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=_delayed()):
        without = m(q, k, v)
    assert torch.equal(without._data.float(), with_grad._data.float())
    keep_hp = [spec[0][3] for spec in specs if spec and spec[0] is not None]
    assert keep_hp == [True, True, False]   # fp8_mha with grad (twice), then without


def _mha(seed=0):
    torch.manual_seed(seed)
    return te.MultiheadAttention(128, 2, attention_dropout=0.0, params_dtype=torch.bfloat16,
                                 device="cpu")


def _step(mha, x, r, **kw):
    xx = x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = mha(xx, **kw)
    y.float().square().sum().backward()
    out = [y.detach(), xx.grad] + [p.grad.clone() for p in mha.parameters()]
    mha.zero_grad(set_to_none=True)
    return out


def test_projection_takes_the_fp8_output_without_a_cast():
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    mha = _mha()
    for _ in range(2):
        _step(mha, x, _delayed())
    proj_in = mha.proj.fp8_meta.fwd.amax_history[:, 0]   # the projection's input slot
    assert not proj_in.any()   # never cast: it took the attention's E4M3 output
    assert mha.core_attention.fp8_out_state.amax_history.amax() > 0
    start = _states(mha)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=_delayed()):
        q, k, v = mha._split_qkv(mha.qkv(x))
        context = mha.core_attention(q, k, v)
        by_hand = mha.proj(context)
    assert isinstance(context, Float8Tensor)
    _restore(start)   # rewind the update the call above made, then the whole module
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=_delayed()):
        assert torch.equal(mha(x), by_hand)


def _states(mha):
    """(state, its amax history, its scale) of every FP8 state in mha, copied now."""
    out = []
    for m in mha.modules():
        meta = getattr(m, "fp8_meta", None)
        for st in (getattr(meta, "fwd", None), getattr(meta, "bwd", None),
                   getattr(m, "fp8_attn_state", None), getattr(m, "fp8_out_state", None)):
            if st is not None:
                out.append((st, st.amax_history.clone(), st.scale.clone()))
    return out


def _restore(saved) -> None:
    for st, hist, scale in saved:
        st.amax_history.copy_(hist)
        st.scale.copy_(scale)


def test_current_scaling_equals_fp8_dpa_bit_for_bit():
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = _step(_mha(), x, recipe.Float8CurrentScaling(fp8_mha=True))
    want = _step(_mha(), x, recipe.Float8CurrentScaling(fp8_dpa=True))
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.abs().sum() > 0


def test_checkpoint_core_attention_reproduces_fp8_mha():
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    mha = _mha()
    _step(mha, x, _delayed())   # scales off their initial ones
    start = _states(mha)
    plain = _step(mha, x, _delayed())
    _restore(start)
    ckpt = _step(mha, x, _delayed(), checkpoint_core_attention=True)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_state_round_trip_old_checkpoints_and_bad_entries():
    mha = _mha()
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for _ in range(2):
        _step(mha, x, _delayed())
    sd = mha.state_dict()
    extra = sd["core_attention._extra_state"]
    assert extra["o_scale"].shape == (1,) and extra["o_amax_history"].shape == (2, 1)
    assert not torch.equal(extra["o_scale"], torch.ones(1))
    fresh = _mha(seed=1)
    fresh.load_state_dict(sd)
    st = fresh.core_attention.fp8_out_state
    assert torch.equal(st.scale, extra["o_scale"])
    assert torch.equal(st.amax_history, extra["o_amax_history"])
    old = dict(sd)
    old["core_attention._extra_state"] = {k: v for k, v in extra.items()
                                          if not k.startswith("o_")}
    fresh.load_state_dict(old)   # saved under fp8_dpa: no output state
    assert fresh.core_attention.fp8_out_state is None
    assert torch.equal(fresh.core_attention.fp8_attn_state.scale, extra["qkv_scale"])
    bad = dict(sd)
    bad["core_attention._extra_state"] = dict(extra, o_amax_history=torch.zeros(3, 1))
    before = fresh.core_attention.fp8_attn_state.scale.clone()
    with pytest.raises(ValueError, match="o_amax_history.*drop this _extra_state"):
        fresh.load_state_dict(bad)
    assert torch.equal(fresh.core_attention.fp8_attn_state.scale, before)   # nothing loaded


def test_calibration_records_the_output_amax():
    gen = torch.Generator().manual_seed(6)
    (q, k, v), _ = _call("bshd", gen)
    m = DotProductAttention(4, 64, num_gqa_groups=2, qkv_format="bshd")
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=_delayed()):
        out = m(q, k, v)
    assert not isinstance(out, Float8Tensor)   # 16-bit attention while calibrating
    amax = out.detach().float().abs().amax().reshape(1)
    torch.testing.assert_close(m.fp8_out_state.scale, 448.0 / amax, rtol=2e-7, atol=0)


def test_quantize_out_is_one_rounding_of_the_fp32_output():
    """The twin's output quantization (ref.attention.quantize_out): saturating, amax
    max-recorded, the sbhd memory order on request."""
    from tritium.ref.attention import quantize_out
    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(7)) * 100
    amax = torch.tensor([1.0])
    y = quantize_out(x, torch.tensor([4.0]), amax, seq_first=True)
    assert y.transpose(0, 1).is_contiguous() and amax.item() == x.abs().max().item()
    assert torch.equal(y.float(), quantize_e4m3(x, torch.tensor([4.0])).float())
    assert y.float().abs().max().item() == 448.0   # saturated, not inf


def test_dcp_round_trip_and_checkpoints_saved_under_fp8_dpa(tmp_path):
    from tritium.distributed import checkpointing
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    mha = _mha()
    for _ in range(2):
        _step(mha, x, _delayed())
    checkpointing.save(str(tmp_path / "mha"), mha)
    fresh = _mha(seed=1)
    checkpointing.load(str(tmp_path / "mha"), fresh, fp8_recipe=_delayed())
    for attr in ("fp8_attn_state", "fp8_out_state"):
        got, want = getattr(fresh.core_attention, attr), getattr(mha.core_attention, attr)
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(got.amax_history, want.amax_history)
    dpa = _mha()
    _step(dpa, x, recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2))
    checkpointing.save(str(tmp_path / "dpa"), dpa)
    checkpointing.load(str(tmp_path / "dpa"), fresh, fp8_recipe=_delayed())
    assert fresh.core_attention.fp8_out_state is None   # starts fresh at the next call
    assert torch.equal(fresh.core_attention.fp8_attn_state.scale,
                       dpa.core_attention.fp8_attn_state.scale)
    _step(fresh, x, _delayed())
    assert fresh.core_attention.fp8_out_state.amax_history.amax() > 0


@pytest.mark.parametrize("r", [recipe.DelayedScaling(fp8_dpa=True, amax_history_len=2),
                               _delayed(), recipe.Float8CurrentScaling(fp8_mha=True)],
                         ids=["dpa-delayed", "mha-delayed", "mha-current"])
def test_compiled_fp8_attention_has_no_graph_break_and_equals_eager(r):
    """Under torch.compile (after te.prepare_fp8, which now makes the attention states too)
    FP8 attention traces whole; fp8_mha's output crosses the trace as a carrier and the fp8
    pieces (functional/fused_cast.py), so the projection still takes it without a cast.
    aot_eager runs the eager ATen ops: outputs and gradients equal eager's bit for bit."""
    import copy
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    base = _mha()
    results = []
    for compiled in (False, True):
        mha = copy.deepcopy(base)
        te.prepare_fp8(mha, r)
        assert (mha.core_attention.fp8_out_state is not None) == (
            isinstance(r, recipe.DelayedScaling) and r.fp8_mha)

        def step(xx):
            with te.fp8_autocast(fp8_recipe=r):
                return mha(xx)
        if compiled:
            start = _states(mha)
            assert torch._dynamo.explain(step)(x.clone().requires_grad_()).graph_break_count == 0
            _restore(start)   # explain ran a step
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        runs = []
        for _ in range(3):
            xx = x.clone().requires_grad_()
            y = step(xx)
            y.float().square().sum().backward()
            runs.append([y.detach(), xx.grad] + [p.grad.clone() for p in mha.parameters()])
            mha.zero_grad(set_to_none=True)
        if r.fp8_mha and isinstance(r, recipe.DelayedScaling):   # the carrier path: no cast
            assert not mha.proj.fp8_meta.fwd.amax_history[:, 0].any()
        results.append(runs)
        torch._dynamo.reset()
    for a_run, b_run in zip(*results):
        for a, b in zip(a_run, b_run):
            assert torch.equal(a, b)


def test_fp8_forward_custom_op_matches_the_twin():
    """tritium::flash_attn_fp8_fwd (the CPU twin behind it here): torch.library.opcheck (fake
    implementation, autograd registration, AOT dispatch), and its results are the twin's."""
    from tritium.ops import attention as ops
    from tritium.ref import flash_attention as R
    gen = torch.Generator().manual_seed(12)
    q, k, v = (quantize_e4m3(torch.randn(2, 24, n, 64, generator=gen), torch.tensor([100.0]))
               for n in (4, 2, 2))
    descale = torch.full((3,), 0.01)
    for o8 in ((None, None, False, True), (torch.tensor([50.0]), torch.zeros(1), True, False)):
        args = (q, k, v, descale, True, 0.125, torch.bfloat16, *o8)
        # (its schema check compares fp8 inputs with an op CPU fp8 lacks: the rest of opcheck)
        torch.library.opcheck(ops.flash_attn_fp8_fwd, args, test_utils=(
            "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
        amax = None if o8[1] is None else torch.zeros(1)
        out, lse, out8 = ops.flash_attn_fp8_fwd(*args[:8], amax, *o8[2:])
        want = R.flash_attention_fp8_fwd(q, k, v, descale, True, 0.125, torch.bfloat16,
                                         fp8_out=None if o8[0] is None else
                                         type("O", (), dict(scale=o8[0], amax=None,
                                                            seq_first=o8[2], keep_hp=o8[3])))
        assert torch.equal(lse, want[1])
        if o8[0] is None:
            assert torch.equal(out, want[0]) and out8.numel() == 0
        else:
            assert out.numel() == 0 and torch.equal(out8.float(), want[2].float())
            assert out8.transpose(0, 1).is_contiguous() and amax.item() > 0
