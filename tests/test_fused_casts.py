"""cpu tier: the fused FP8 casts (norm + cast, activation + cast, activation backward + cast) give
BIT-identical results to the unfused path (norm / activation, then the GEMM's own cast).

Each case builds one module, deep-copies it, and runs both copies for several steps of fresh
data under fp8_autocast(DelayedScaling(amax_history_len=3)): once as shipped (fused) and once
inside `fused_casts(False)`. Every output, input grad, param grad and every FP8 state tensor
(forward/backward scale and amax history, after each step's updates) must match as integer bits.
Spies on the fused twins prove which path ran. Token counts are 21 (not divisible by 16: padded
rows) and 32; sizes make the unfused fc1 backward take both the single-pass and the blocked path
(`functional.linear.backward_blocks`), while the fused fp8 grad always runs in one pass: the
same bits either way.
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.tensor import Float8Tensor
from tritium.functional.fused_cast import fp8_operands, fusable_state, fused_casts, wrap_fp8
from tritium.ref import activation as ref_act
from tritium.ref.cast import cast_transpose
from tritium.ref import norm as ref_norm

from testlib import assert_bits

pytestmark = pytest.mark.cpu

REC = recipe.DelayedScaling(amax_history_len=3)


@pytest.fixture
def spies(monkeypatch):
    """Counts calls of the fused twins (the cpu tier runs the twins)."""
    counts = {}
    for mod, name in ((ref_norm, "layernorm_fwd_fp8"), (ref_norm, "rmsnorm_fwd_fp8"),
                      (ref_act, "activation_fwd_fp8"), (ref_act, "activation_bwd_fp8")):
        fn = getattr(mod, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)
    return counts


def _states(m):
    meta = m.fp8_meta
    return {f"{d}.{k}": getattr(getattr(meta, d), k).clone()
            for d in ("fwd", "bwd") for k in ("scale", "amax_history")}


def _run(module, fused, steps, shape, dtype, rec=REC, hp_grad=True, grad_enabled=True):
    """Outputs, grads and FP8 states of `steps` fwd+bwd steps (fresh data each step)."""
    gen = torch.Generator().manual_seed(1234)
    dev = next(module.parameters()).device
    record = []
    with fused_casts(fused):
        for step in range(steps):
            x = (torch.randn(shape, generator=gen) * (1 + step)).to(dev, dtype).requires_grad_()
            with torch.set_grad_enabled(grad_enabled), te.fp8_autocast(fp8_recipe=rec):
                outs = module(x)
            outs = outs if isinstance(outs, tuple) else (outs,)
            record += [(f"step{step}.out{i}", o.detach().clone()) for i, o in enumerate(outs)
                       if isinstance(o, torch.Tensor)]
            if grad_enabled:
                tensors = [o for o in outs if isinstance(o, torch.Tensor) and o.grad_fn]
                if not hp_grad:
                    tensors = tensors[:1]
                grads = [torch.randn(o.shape, generator=gen).to(dev, o.dtype) for o in tensors]
                torch.autograd.backward(tensors, grads)
                record.append((f"step{step}.dx", x.grad.clone()))
                for name, p in module.named_parameters():
                    if p.grad is not None:
                        record.append((f"step{step}.d{name}", p.grad.clone()))
                        p.grad = None
            record += [(f"step{step}.{k}", v) for k, v in _states(module).items()]
    return record


def _compare(module, steps=3, shape=(3, 7, 32), dtype=torch.float32, exact=True, **kw):
    """Fused vs unfused runs: bit for bit, or (exact=False, the GPU, where the fused norm's
    reductions may round y one ulp differently and so flip an fp8 rounding or a scale)
    normwise within 2e-2 (tests/gpu/test_gpu_fused_casts.py says why)."""
    fused, unfused = module, copy.deepcopy(module)
    got = _run(fused, True, steps, shape, dtype, **kw)
    want = _run(unfused, False, steps, shape, dtype, **kw)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (name, g), (_, w) in zip(got, want):
        if exact:
            assert_bits(g, w, name)
            continue
        g, w = g.double(), w.double()
        err, size = (g - w).norm().item(), w.norm().item()
        assert err <= 2e-2 * size + 1e-12, f"{name}: |fused - unfused| = {err:.3g}, |unfused| = {size:.3g}"
    return got


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("return_ln", [False, True], ids=["", "ln_out"])
def test_layernorm_linear_fused_equals_unfused(dtype, normalization, bias, return_ln, spies):
    m = te.LayerNormLinear(32, 48, normalization=normalization, bias=bias,
                           return_layernorm_output=return_ln, params_dtype=dtype, device="cpu")
    _compare(m, dtype=dtype)
    norm = "layernorm_fwd_fp8" if normalization == "LayerNorm" else "rmsnorm_fwd_fp8"
    assert spies.get(norm) == 3, spies  # fused steps only; the unfused run never calls it


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 16, 64)], ids=["T21", "T32"])
def test_layernorm_linear_single_pass_backward_and_zero_centered(shape, spies):
    m = te.LayerNormLinear(64, 16, zero_centered_gamma=True, return_bias=True,
                           return_layernorm_output=True, device="cpu")
    _compare(m, shape=shape, hp_grad=False)  # ln_out returned but given no gradient
    assert spies.get("layernorm_fwd_fp8") == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "geglu", "srelu"])
@pytest.mark.parametrize("normalization,bias", [("RMSNorm", False), ("LayerNorm", True)],
                         ids=["rms_nobias", "ln_bias"])
@pytest.mark.parametrize("hidden,ffn", [(32, 48), (64, 16)], ids=["blocked", "onepass"])
def test_layernorm_mlp_fused_equals_unfused(dtype, activation, normalization, bias, hidden, ffn,
                                            spies):
    m = te.LayerNormMLP(hidden, ffn, normalization=normalization, bias=bias,
                        activation=activation, params_dtype=dtype, device="cpu")
    _compare(m, shape=(3, 7, hidden), dtype=dtype)
    assert spies.get("activation_fwd_fp8") == 3 and spies.get("activation_bwd_fp8") == 3, spies


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_layernorm_mlp_checkpoint_and_layernorm_output(dtype, activation, spies):
    kw = dict(normalization="LayerNorm", activation=activation, params_dtype=dtype,
              device="cpu", return_layernorm_output=True, return_bias=True)
    m = te.LayerNormMLP(32, 48, checkpoint=True, **kw)
    _compare(m, dtype=dtype)
    # the recompute ran the fused activation again, with frozen scales and no recording
    assert spies["activation_fwd_fp8"] == 6 and spies["activation_bwd_fp8"] == 3, spies
    # and checkpoint=True (fused) is bit-identical to checkpoint=False (fused)
    a = te.LayerNormMLP(32, 48, checkpoint=True, **kw)
    b = te.LayerNormMLP(32, 48, checkpoint=False, **kw)
    b.load_state_dict(a.state_dict())
    ra, rb = _run(a, True, 3, (3, 7, 32), dtype), _run(b, True, 3, (3, 7, 32), dtype)
    for (name, g), (_, w) in zip(ra, rb):
        assert_bits(g, w, name)


def test_no_fusion_outside_delayed_scaling(spies):
    """Current scaling, calibration, high precision, torch.autocast: the unfused path."""
    m = te.LayerNormMLP(32, 48, activation="swiglu", device="cpu")
    x = torch.randn(3, 7, 32)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        m(x).sum().backward()
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=REC):
        m(x).sum().backward()
    m(x).sum().backward()
    assert not spies, spies
    # torch.autocast: the unfused path casts the norm output to the autocast dtype first
    with torch.autocast("cpu", dtype=torch.bfloat16), te.fp8_autocast(fp8_recipe=REC):
        assert fusable_state(x) is None
    with te.fp8_autocast(fp8_recipe=REC):
        assert fusable_state(x) is not None
        with fused_casts(False):
            assert fusable_state(x) is None


def test_inference_no_grad(spies):
    """Under no_grad the fused norm writes no transpose and the results still match."""
    m = te.LayerNormMLP(32, 48, activation="geglu", device="cpu")
    _compare(m, grad_enabled=False)
    assert spies.get("layernorm_fwd_fp8") == 3 and "activation_bwd_fp8" not in spies


def test_fp8_params_fused_equals_unfused():
    with te.fp8_model_init(recipe=REC):
        m = te.LayerNormMLP(32, 48, activation="swiglu", normalization="RMSNorm", bias=False,
                            device="cpu")
    _compare(m)


def test_float8_tensor_operands_and_autograd():
    """The hand-off itself: a Float8Tensor output of one Function feeds the next, its padded
    buffers are used as they are, and a detached copy (checkpointing) re-pads to the same bits;
    autograd takes a Float8Tensor as the gradient of a plain tensor."""
    e4 = torch.float8_e4m3fn
    x = torch.randn(21, 32)
    data, data_t, si = cast_transpose(x, torch.tensor([3.0]), None, e4, pad_rows_to=16,
                                               write_transpose=True)
    t = wrap_fp8(data, data_t, si, e4, torch.float32, (3, 7, 32))
    assert isinstance(t, Float8Tensor) and t.shape == (3, 7, 32) and t.dtype == torch.float32
    d, dt, s = fp8_operands(t, True)
    assert d is data and dt is data_t and s is si
    d2, dt2, _ = fp8_operands(t.detach(), True)  # detach drops the padded buffer
    assert_bits(d2, data, "re-padded data")
    assert_bits(dt2, data_t, "transpose")

    class Grad8(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h * 2

        @staticmethod
        def backward(ctx, g):
            return wrap_fp8(*cast_transpose(g.reshape(-1, 32), torch.tensor([1.0]), None,
                                                     e4, pad_rows_to=16), e4, g.dtype, g.shape)
    seen = []

    class Sink(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(type(g))
            return g.dequantize() if isinstance(g, Float8Tensor) else g
    x = torch.randn(3, 7, 32, requires_grad=True)
    Grad8.apply(Sink.apply(x)).sum().backward()
    assert seen == [Float8Tensor] and x.grad.shape == x.shape


def test_fused_one_pass_equals_unfused_blocks(monkeypatch):
    """More blocks than the shapes pick by default for the unfused backward; the fused fp8 grad
    runs in one pass (its fp8 copies exist whole): same bits."""
    flinear = importlib.import_module("tritium.functional.linear")
    monkeypatch.setattr(flinear, "backward_blocks", lambda t, k, n: 3)
    m = te.LayerNormMLP(32, 48, activation="swiglu", normalization="RMSNorm", device="cpu")
    _compare(m, shape=(5, 9, 32))
