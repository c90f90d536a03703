"""cpu tier: te.LayerNorm / te.RMSNorm (through the PyTorch twins) against torch.nn.

Parity: with weights copied into torch.nn.LayerNorm / torch.nn.RMSNorm (eps passed explicitly:
torch's RMSNorm default differs), fp32 output and input/weight/bias gradients agree at TE's fp32
tolerance. 16-bit modules are compared with the fp32 torch module fed the same values upcast:
tritium computes in fp32 and rounds once, so only that rounding separates them (TE's bf16
tolerance; fp16 at torch's default fp16 tolerance, rtol 1e-3). Also: zero_centered_gamma
(torch module with weight 1 + w), odd hidden sizes, 3D inputs, input dtype != params dtype,
non-contiguous inputs and gradients, empty inputs, and the errors.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.functional.norm import layer_norm, rms_norm

from testlib import BF16_TOL, FP32_TOL

pytestmark = pytest.mark.cpu

FP16_TOL = dict(rtol=1e-3, atol=1e-5)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL}
SHAPES = [(4, 7, 64), (5, 100), (3, 2, 257), (2, 1000)]
KINDS = ["LayerNorm", "RMSNorm"]


def _make(kind, hidden, eps=1e-5, zc=False, dtype=torch.float32):
    cls = te.LayerNorm if kind == "LayerNorm" else te.RMSNorm
    return cls(hidden, eps=eps, zero_centered_gamma=zc, params_dtype=dtype, device="cpu")


def _randomize(mod, randn):
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(randn(*p.shape, scale=0.5).to(p.dtype) + (0.0 if mod.zero_centered_gamma
                                                               or p is mod.bias else 1.0))


def _torch_twin(mod, eps):
    """torch.nn module (fp32) holding mod's effective parameters, upcast."""
    hidden = mod.hidden_size
    if isinstance(mod, te.LayerNorm):
        ref = torch.nn.LayerNorm(hidden, eps=eps)
    else:
        ref = torch.nn.RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        w = mod.weight.float()
        ref.weight.copy_(w + 1.0 if mod.zero_centered_gamma else w)
        if mod.bias is not None:
            ref.bias.copy_(mod.bias.float())
    return ref


def _run(mod, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = mod(x)
    y.backward(dy)
    grads = [x.grad] + [p.grad for p in mod.parameters()]
    return y, grads


def _compare(kind, shape, dtype, randn, zc=False, eps=1e-5, params_dtype=None, x_scale=2.0):
    mod = _make(kind, shape[-1], eps=eps, zc=zc, dtype=params_dtype or dtype)
    _randomize(mod, randn)
    x = (randn(*shape, scale=x_scale) + 0.5).to(dtype)
    dy = randn(*shape).to(dtype)
    y, grads = _run(mod, x, dy)
    ref = _torch_twin(mod, eps)
    y_ref, grads_ref = _run(ref, x.float(), dy.float())
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])
    names = ["dx", "dweight", "dbias"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        want_dtype = dtype if name == "dx" else (params_dtype or dtype)
        assert g.dtype == want_dtype, name
        tol = TOL[dtype] if name == "dx" else TOL[params_dtype or dtype]
        torch.testing.assert_close(g.float(), g_ref, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_torch(kind, shape, randn):
    _compare(kind, shape, torch.float32, randn)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4, 7, 64), (3, 257)], ids=str)
def test_16bit_matches_fp32_torch(kind, dtype, shape, randn):
    _compare(kind, shape, dtype, randn)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_centered_gamma(kind, dtype, randn):
    mod = _make(kind, 48, zc=True)
    assert torch.equal(mod.weight, torch.zeros(48))
    _compare(kind, (6, 48), dtype, randn, zc=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dtype,p_dtype", [(torch.bfloat16, torch.float32),
                                             (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.bfloat16)], ids=str)
def test_input_dtype_differs_from_params(kind, x_dtype, p_dtype, randn):
    _compare(kind, (3, 5, 96), x_dtype, randn, params_dtype=p_dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_large_eps_and_scale(kind, randn):
    _compare(kind, (4, 33), torch.float32, randn, eps=0.5, x_scale=0.1)
    _compare(kind, (4, 33), torch.float32, randn, x_scale=300.0)


def test_initial_parameters_and_names():
    ln, rms = te.LayerNorm((16,), device="cpu"), te.RMSNorm(16, device="cpu")
    assert set(ln.state_dict()) == {"weight", "bias"} and set(rms.state_dict()) == {"weight"}
    assert torch.equal(ln.weight, torch.ones(16)) and torch.equal(ln.bias, torch.zeros(16))
    assert rms.bias is None and torch.equal(rms.weight, torch.ones(16))
    zc = te.LayerNorm(16, zero_centered_gamma=True, params_dtype=torch.bfloat16, device="cpu")
    assert torch.equal(zc.weight, torch.zeros(16, dtype=torch.bfloat16))
    assert zc.weight.dtype == zc.bias.dtype == torch.bfloat16
    sp = te.RMSNorm(16, sequence_parallel=True, device="cpu")
    assert sp.sequence_parallel and sp.weight.sequence_parallel
    assert te.LayerNorm(16).weight.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "LayerNorm" in te.__all__ and "RMSNorm" in te.__all__


def test_fresh_module_is_identity_normalization(randn):
    x = randn(3, 40) * 4 + 1
    torch.testing.assert_close(te.LayerNorm(40, device="cpu")(x),
                               torch.nn.functional.layer_norm(x, (40,)), **FP32_TOL)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_functional_non_contiguous_and_expanded_grad(fn, randn):
    base = randn(24, 10, requires_grad=True)
    x = base.t()  # [10, 24], rows not contiguous
    w = randn(24, requires_grad=True)
    b = randn(24, requires_grad=True)
    call = (lambda t, ww: layer_norm(t, ww, b, 1e-5, False)) if fn == "layer_norm" \
        else (lambda t, ww: rms_norm(t, ww, 1e-5, False))
    y = call(x, w)
    y.sum().backward()  # an expanded (stride 0) grad_output
    xc, wc = base.detach().t().contiguous().requires_grad_(True), w.detach().requires_grad_(True)
    yc = (torch.nn.functional.layer_norm(xc, (24,), wc, b.detach()) if fn == "layer_norm"
          else torch.nn.functional.rms_norm(xc, (24,), wc, 1e-5))
    yc.sum().backward()
    torch.testing.assert_close(y, yc, **FP32_TOL)
    torch.testing.assert_close(base.grad.t(), xc.grad, **FP32_TOL)
    torch.testing.assert_close(w.grad, wc.grad, **FP32_TOL)


def test_layer_norm_without_bias_and_frozen_params(randn):
    x = randn(5, 12, requires_grad=True)
    w = randn(12)  # no grad wanted for the weight
    y = layer_norm(x, w, None, 1e-5, False)
    y.backward(randn(5, 12))
    assert x.grad is not None and w.grad is None
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (12,), w), **FP32_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_input(kind):
    mod = _make(kind, 8)
    x = torch.empty(0, 3, 8, requires_grad=True)
    y = mod(x)
    y.sum().backward()
    assert y.shape == (0, 3, 8) and x.grad.shape == (0, 3, 8)
    assert torch.equal(mod.weight.grad, torch.zeros(8))


@pytest.mark.parametrize("kind", KINDS)
def test_errors_name_the_argument(kind):
    cls = te.LayerNorm if kind == "LayerNorm" else te.RMSNorm
    for bad in ((16, 2), 0, "16", True):
        with pytest.raises(ValueError, match="normalized_shape"):
            cls(bad, device="cpu")
    with pytest.raises(ValueError, match="eps"):
        cls(16, eps=-1.0, device="cpu")
    with pytest.raises(TypeError, match="params_dtype"):
        cls(16, params_dtype=torch.int32, device="cpu")
    mod = cls(16, device="cpu")
    with pytest.raises(ValueError, match="last dim must be normalized_shape=16"):
        mod(torch.randn(3, 15))
    with pytest.raises(TypeError, match="inp dtype torch.int64"):
        mod(torch.ones(3, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="inp dtype torch.float64"):
        mod(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="inp must be a torch.Tensor"):
        mod([1.0] * 16)
    with pytest.raises(ValueError, match="inp is on meta"):
        mod(torch.empty(3, 16, device="meta"))
