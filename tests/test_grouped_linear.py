"""te.GroupedLinear on the CPU path.

High precision: equal to a loop of per-expert nn.Linear (outputs, input / weight / bias grads,
fp32 tolerance), with an empty expert and token counts that are not multiples of 16.
FP8 (delayed and current scaling): equal to an independent per-expert emulation (each expert's
input, weight and grad_output slice quantized with its own scale, fp32 matmuls of the fp8
values) over several steps, so the delayed scales are far from 1. Also weight caching across
micro-batches, fuse_wgrad_accumulation, fp8_model_init weights with FusedAdam master weights,
and the errors.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from testlib import E4M3, E5M2, FP8_TOL, FP32_TOL, current_scale, fake_quant
from tritium import recipe

pytestmark = pytest.mark.cpu

SPLITS = [5, 0, 21, 12]  # an empty expert, counts not multiples of 16
K, N = 32, 48


def make(randn, bias=True, **kw):
    layer = te.GroupedLinear(len(SPLITS), K, N, bias=bias, device="cpu", **kw)
    if bias:
        with torch.no_grad():
            for i in range(len(SPLITS)):
                getattr(layer, f"bias{i}").copy_(randn(N, scale=0.5))
    return layer


def loop_twin(layer):
    mods = []
    for i in range(layer.num_gemms):
        lin = torch.nn.Linear(K, N, bias=layer.use_bias)
        with torch.no_grad():
            lin.weight.copy_(getattr(layer, f"weight{i}"))
            if layer.use_bias:
                lin.bias.copy_(getattr(layer, f"bias{i}"))
        mods.append(lin)
    return mods


def grads(layer):
    out = []
    for i in range(layer.num_gemms):
        out.append(getattr(layer, f"weight{i}").grad)
        if layer.use_bias:
            out.append(getattr(layer, f"bias{i}").grad)
    return out


def loop_grads(mods):
    out = []
    for m in mods:
        out.append(m.weight.grad)
        if m.bias is not None:
            out.append(m.bias.grad)
    return out


def test_names_shapes_and_one_weight_buffer(randn):
    layer = make(randn)
    names = [n for n, _ in layer.named_parameters()]
    assert names == [f"{k}{i}" for i in range(4) for k in ("weight", "bias")]
    assert layer.weight2.shape == (N, K) and layer.bias2.shape == (N,)
    w0, w1 = layer.weight0, layer.weight1
    assert w1.data_ptr() == w0.data_ptr() + N * K * 4  # views of one [G, N, K] buffer
    assert 0.015 < layer.weight3.std().item() < 0.035  # TE's init std 0.023


@pytest.mark.parametrize("bias", [True, False])
def test_matches_per_expert_linear_loop(randn, bias):
    layer = make(randn, bias)
    mods = loop_twin(layer)
    x = randn(sum(SPLITS), K, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = randn(sum(SPLITS), N)
    y = layer(x, SPLITS)
    want = torch.cat([m(xi) for m, xi in zip(mods, x2.split(SPLITS))])
    torch.testing.assert_close(y, want, **FP32_TOL)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, **FP32_TOL)
    for got, ref in zip(grads(layer), loop_grads(mods)):
        torch.testing.assert_close(got, ref, **FP32_TOL)
    assert torch.all(layer.weight1.grad == 0)  # the empty expert


def test_return_bias_and_3d_input(randn):
    layer = make(randn, return_bias=True)
    x = randn(2, 19, K)
    y, biases = layer(x, [10, 0, 20, 8])
    assert y.shape == (2, 19, N) and len(biases) == 4 and biases[2] is layer.bias2
    want = torch.cat([torch.nn.functional.linear(xi, getattr(layer, f"weight{i}"))
                      for i, xi in enumerate(x.reshape(-1, K).split([10, 0, 20, 8]))])
    torch.testing.assert_close(y.reshape(-1, N), want, **FP32_TOL)


def emulate(layer, x, dy, s_x, s_w, s_dy, fwd_dtype, bwd_dtype):
    """Per expert: fake-quantized operands with that expert's scales, fp32 matmuls."""
    outs, dxs, dws, dbs = [], [], [], []
    for i, (xi, dyi) in enumerate(zip(x.split(SPLITS), dy.split(SPLITS))):
        w = getattr(layer, f"weight{i}").detach()
        xq, wq = fake_quant(xi, s_x[i], fwd_dtype), fake_quant(w, s_w[i], fwd_dtype)
        dyq = fake_quant(dyi, s_dy[i], bwd_dtype)
        outs.append(xq @ wq.t() + getattr(layer, f"bias{i}").detach())
        dxs.append(dyq @ wq)
        dws.append(dyq.t() @ xq)
        dbs.append(dyi.sum(0))
    return torch.cat(outs), torch.cat(dxs), dws, dbs


RECIPES = {
    "delayed-hybrid": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "current-hybrid": recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
    "current-e4m3": recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_matches_per_expert_emulation(randn, name):
    rcp = RECIPES[name]
    bwd_dtype = E5M2 if rcp.fp8_format is recipe.Format.HYBRID else E4M3
    layer = make(randn)
    g = len(SPLITS)
    for it in range(3):
        # each expert's slice of its own magnitude, so the per-expert scales differ
        mags = torch.tensor([2.0 ** (i - 1 + it) for i in range(g)]).repeat_interleave(
            torch.tensor(SPLITS))[:, None]
        x = (randn(sum(SPLITS), K) * mags).requires_grad_()
        dy = randn(sum(SPLITS), N) / mags
        if isinstance(rcp, recipe.DelayedScaling):
            scale = layer.fp8_meta.fwd.scale.clone() if it else torch.ones(2 * g)
            s_x, s_w = scale[0::2], scale[1::2]
            s_dy = layer.fp8_meta.bwd.scale.clone() if it else torch.ones(g)
            if it:
                assert len(set(s_x[[0, 2, 3]].tolist())) == 3  # per-expert scales
        else:
            cur = lambda t, d: current_scale(t, d) if t.numel() else torch.tensor(1.0)  # noqa
            s_x = [cur(xi, E4M3) for xi in x.split(SPLITS)]
            s_w = [cur(getattr(layer, f"weight{i}"), E4M3) for i in range(g)]
            s_dy = [cur(d, bwd_dtype) for d in dy.split(SPLITS)]
        with te.fp8_autocast(fp8_recipe=rcp):
            y = layer(x, SPLITS)
        y.backward(dy)
        out, dx, dws, dbs = emulate(layer, x.detach(), dy, s_x, s_w, s_dy, E4M3, bwd_dtype)
        for got, want in [(y, out), (x.grad, dx), *zip(grads(layer), [t for p in zip(dws, dbs)
                                                                        for t in p])]:
            torch.testing.assert_close(got, want, **FP8_TOL)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        exact = torch.cat([torch.nn.functional.linear(xi, getattr(layer, f"weight{i}"),
                                                      getattr(layer, f"bias{i}"))
                           for i, xi in enumerate(x.detach().split(SPLITS))])
        assert not torch.allclose(y, exact, rtol=1e-4, atol=1e-4)  # it really ran in FP8
        layer.zero_grad()


def test_weight_cached_across_microbatches(randn):
    rcp = recipe.DelayedScaling(amax_history_len=4)
    layer = make(randn)
    x = randn(sum(SPLITS), K)
    with te.fp8_autocast(fp8_recipe=rcp):  # warm-up: no scale is 1 any more
        layer(x, SPLITS).sum().backward()
    outs = []
    for k, first in enumerate([True, False, True]):
        with te.fp8_autocast(fp8_recipe=rcp):
            outs.append(layer(x, SPLITS, is_first_microbatch=first).detach())
        if k == 0:
            with torch.no_grad():
                layer.weight2.mul_(1.5)
    assert torch.equal(outs[1], outs[0])           # the cached fp8 weights were reused
    assert not torch.allclose(outs[2], outs[0], **FP8_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation(randn, fp8):
    layer = make(randn, fuse_wgrad_accumulation=True)
    ref = make(randn)
    ref.load_state_dict(layer.state_dict())
    starts = [randn(N, K) for _ in SPLITS]
    for i, s in enumerate(starts):
        getattr(layer, f"weight{i}").main_grad = s.clone()
    x, dy = randn(sum(SPLITS), K), randn(sum(SPLITS), N)
    rcp = recipe.Float8CurrentScaling()
    for mod in (layer, ref):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=rcp):
            y = mod(x, SPLITS)
        y.backward(dy)
    for i, s in enumerate(starts):
        w = getattr(layer, f"weight{i}")
        assert w.grad is None
        torch.testing.assert_close(w.main_grad, s + getattr(ref, f"weight{i}").grad, **FP32_TOL)


def test_fp8_model_init_weights_and_fused_adam(randn):
    rcp = recipe.DelayedScaling()
    with te.fp8_model_init(enabled=True, recipe=rcp):
        layer = make(randn)
    assert isinstance(layer.weight1, te.Float8Tensor)
    opt = te.optimizers.FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    before = layer.weight2.dequantize().clone()
    x = randn(sum(SPLITS), K)
    with te.fp8_autocast(fp8_recipe=rcp):
        y = layer(x, SPLITS)
    # the forward used the fp8 weights as they are: expert 2's rows, input scale 1 (step 1)
    rows = slice(SPLITS[0] + SPLITS[1], SPLITS[0] + SPLITS[1] + SPLITS[2])
    want = fake_quant(x[rows], 1.0, E4M3) @ before.t() + layer.bias2.detach()
    torch.testing.assert_close(y[rows], want, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    opt.step()
    assert isinstance(layer.weight2, te.Float8Tensor)
    assert not torch.equal(layer.weight2.dequantize(), before)
    assert opt.state[layer.weight2]["master_param"] is not None


def test_errors(randn):
    layer = make(randn)
    with pytest.raises(ValueError, match="m_splits must be 4"):
        layer(randn(10, K), [10])
    with pytest.raises(ValueError, match="add up to"):
        layer(randn(10, K), [1, 2, 3, 5])
    odd = te.GroupedLinear(2, 24, 32, device="cpu")
    with pytest.raises(ValueError, match="divisible by 16"):
        with te.fp8_autocast():
            odd(randn(4, 24), [2, 2])
    with pytest.raises(ValueError, match="num_gemms"):
        te.GroupedLinear(0, K, N, device="cpu")


def test_fused_adam_masters_keep_one_weight_buffer_and_checkpoint(randn, tmp_path):
    layer = make(randn, params_dtype=torch.bfloat16)
    opt = te.optimizers.FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    x = randn(sum(SPLITS), K, dtype=torch.bfloat16)
    rcp = recipe.DelayedScaling()
    before = layer.weight3.detach().clone()
    with te.fp8_autocast(fp8_recipe=rcp):
        layer(x, SPLITS).float().square().sum().backward()
    opt.step()
    assert not torch.equal(layer.weight3, before)
    assert opt.state[layer.weight3]["master_param"].dtype == torch.float32
    w0 = layer.weight0
    assert layer.weight3.data_ptr() == w0.data_ptr() + 3 * N * K * 2  # still one buffer
    # a checkpoint (weights_only) carries the per-expert FP8 state
    torch.save(layer.state_dict(), tmp_path / "ckpt.pt")
    fresh = make(randn, params_dtype=torch.bfloat16)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert torch.equal(fresh.fp8_meta.fwd.scale, layer.fp8_meta.fwd.scale)
    assert torch.equal(fresh.weight2, layer.weight2)
    with te.fp8_autocast(fp8_recipe=rcp):
        assert torch.equal(fresh(x, SPLITS), layer(x, SPLITS))


def test_ref_twins_take_the_row_counts_from_the_host(randn):
    """With m_splits given, the grouped ref twins read nothing back from the offsets tensor (on
    a GPU that would be a sync per call, under torch.compile a graph break): offsets holding
    wrong values give the same bits as the right ones."""
    from tritium.ref import grouped_gemm as ref
    x = randn(sum(SPLITS), K, scale=3.0)
    right = ref.make_offsets(SPLITS, "cpu")
    wrong = torch.zeros_like(right)
    amax_right, amax_wrong = torch.zeros(len(SPLITS)), torch.zeros(len(SPLITS))
    ref.grouped_amax_into(x, right, amax_right)
    ref.grouped_amax_into(x, wrong, amax_wrong, m_splits=SPLITS)
    assert torch.equal(amax_right, amax_wrong) and amax_right.max() > 0
    scale = torch.rand(len(SPLITS)) + 0.5
    cast = [ref.grouped_cast_transpose(x, o, scale, None, E4M3, write_transpose=True, m_splits=s)
            for o, s in ((right, None), (wrong, SPLITS))]
    (x8, x8_t, x_si), (y8, y8_t, y_si) = cast
    assert torch.equal(x8.view(torch.uint8), y8.view(torch.uint8)) and torch.equal(x_si, y_si)
    _, padded = right.tolist()
    for g in range(len(SPLITS)):   # each group's transposed rows (the padding is not written)
        p0, p1, rows = padded[g], padded[g + 1], SPLITS[g]
        blocks = [t[K * p0:K * p1].view(K, p1 - p0)[:, :rows].view(torch.uint8)
                  for t in (x8_t, y8_t)]
        assert torch.equal(*blocks)
    w8 = (randn(len(SPLITS), N, K) * 8).to(E4M3)
    w_si = torch.rand(len(SPLITS)) + 0.5
    fprop = [ref.grouped_fp8_gemm_tn(x8, w8, x_si, w_si, o, torch.float32, m_splits=s)
             for o, s in ((right, None), (wrong, SPLITS))]
    assert torch.equal(*fprop) and fprop[0].abs().max() > 0
    # x8^T with itself as both operands (any fp8 [K * padded M] pair will do)
    wgrad = [ref.grouped_fp8_gemm_wgrad(x8_t, x8_t, x_si, x_si, o, K, K, torch.float32,
                                        m_splits=s) for o, s in ((right, None), (wrong, SPLITS))]
    assert torch.equal(*wgrad) and wgrad[0].abs().max() > 0


@pytest.mark.parametrize("choice, fprop, precise", [("auto", "kernels", "cublas"),
                                                    ("triton", "kernels", "kernels"),
                                                    ("cublas", "cublas", "cublas")])
def test_grouped_gemm_choice_follows_linears_rule(monkeypatch, setenv, choice, fprop, precise):
    """TRITIUM_FP8_GEMM picks the grouped GEMMs as it picks Linear's: by default fprop (fast
    accumulation) on the grouped Triton kernel, dgrad and wgrad on cuBLASLt per group; the
    twins where there are no FP8 tensor cores."""
    from tritium import _device
    from tritium.ops import grouped_gemm as og
    from tritium.ref import grouped_gemm as rg
    t = torch.empty(1)
    assert og.impl(t, True) is rg and og.impl(t, False) is rg  # this CPU: the twins
    setenv("TRITIUM_FP8_GEMM", choice)
    monkeypatch.setattr(_device, "use_triton", lambda t: True)
    monkeypatch.setattr(_device, "fp8_tensor_cores", lambda t: True)
    for fast_accum, want in {True: fprop, False: precise}.items():
        got = og.impl(t, fast_accum)
        assert (got is og._Cublas) == (want == "cublas")
        assert hasattr(got, "grouped_fp8_gemm_wgrad") and got is not rg
