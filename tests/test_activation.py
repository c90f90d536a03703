"""cpu tier: `tritium.functional.activation` (the ref path) against independent formulas.

The oracle is each activation written here with plain torch ops (F.gelu(approximate="tanh"),
x * sigmoid(1.702 x), F.relu, F.relu(x) ** 2, F.silu, sigmoid) and TE's gated order
act(first half) * second half, evaluated in float64, with its backward from autograd. It is
run in float64 because torch's own fp32 formulas are less accurate than tritium's: fp32
F.gelu's backward computes 1 - tanh^2 and 1 - sigmoid with cancellation, ~2e-5 off in geglu's
dx at scale-3 inputs, while tritium stays within a few fp32 ulps (see tritium/ref/activation.py).

fp32 tolerance: 1e-6 in absolute terms for results of magnitude <= 1, relative above, where
"magnitude" includes the multiplier that scales the activation (b in act(a) * b, dy in dx,
dy * b in d_a): act'(a) carries an absolute error of about an ulp of 1 where it crosses zero,
and multiplying by dy * b (up to ~40 here) scales that error, not the result. 16-bit inputs:
the result must be the fp32 result rounded once to the dtype, so within 1 ulp (plus the fp32
bound above) of the float64 oracle rounded to that dtype, and equal to it almost everywhere
(absolute differences below 1e-12 count as equal: see TINY).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tritium.functional.activation import ACTIVATIONS, GATED, activation

pytestmark = pytest.mark.cpu

PLAIN = [k for k in ACTIVATIONS if k not in GATED]
BASE = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
        "swiglu": "silu", "glu": "sigmoid"}
ACT = {"gelu": lambda t: F.gelu(t, approximate="tanh"),
       "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
       "relu": F.relu,
       "srelu": lambda t: F.relu(t) ** 2,
       "silu": F.silu,
       "sigmoid": torch.sigmoid}
SHAPES = [(2, 7, 96), (5, 66), (1, 2)]  # last dim: 2F for gated kinds (F = 48, 33, 1)
MANT = {torch.bfloat16: 7, torch.float16: 10}
# Below this size 16-bit results are compared in absolute terms: fp32 math underflows where
# bf16 (fp32's exponent range) has subnormals, and the float64 oracle's 0.5 x (1 + tanh(u)) itself
# cancels for x < -5 (absolute error ~1e-16 |x|, relative error up to 100%: gelu(-8.75) ~ -1e-26
# comes out as 0).
TINY = 1e-12


def formula(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind in GATED:
        f = x.shape[-1] // 2
        return ACT[BASE[kind]](x[..., :f]) * x[..., f:]
    return ACT[kind](x)


def oracle(kind, x, dy):
    """y, dx and the multiplier scales of each, from the float64 formula."""
    xd = x.detach().double().requires_grad_(True)
    y = formula(kind, xd)
    y.backward(dy.double())
    if kind in GATED:
        f = x.shape[-1] // 2
        b = xd.detach()[..., f:]
        y_scale = b.abs()
        dx_scale = torch.cat([(dy.double() * b).abs(), dy.double().abs()], dim=-1)
    else:
        y_scale = torch.zeros_like(y)
        dx_scale = dy.double().abs()
    return y.detach(), xd.grad, y_scale, dx_scale


def assert_fp32_close(got, want, scale, what):
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: NaN"
    denom = torch.maximum(torch.maximum(want.abs(), scale), torch.ones_like(want))
    err = ((got.double() - want) / denom).abs()
    assert err.max().item() <= 1e-6, f"{what}: scaled error {err.max().item():.3g} > 1e-6"


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |t| (subnormal floor included), as float64."""
    _, e = torch.frexp(t.double().abs())
    tiny = torch.finfo(dtype).tiny * 2.0 ** -MANT[dtype]
    return torch.clamp(torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 1 - MANT[dtype]),
                       min=tiny)


def assert_rounded_once(got, want64, scale, what):
    """got == want64 rounded to got.dtype, give or take one ulp (near rounding ties) plus the
    fp32 error bound of the value that was rounded (it matters only near zeros of act')."""
    dtype = got.dtype
    want = want64.to(dtype)
    diff = (got.double() - want.double()).abs()
    fp32_err = 1e-6 * torch.maximum(torch.maximum(want64.abs(), scale), torch.ones_like(want64))
    limit = ulp(torch.maximum(got.double().abs(), want.double().abs()), dtype) + fp32_err
    assert (diff <= limit).all(), f"{what}: {(diff > limit).sum()} values off by more than 1 ulp"
    same = (got == want) | (diff <= TINY)
    assert same.double().mean() >= 0.98, f"{what}: too many values off by an ulp"


def run(kind, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = activation(x, kind)
    y.backward(dy)
    return y.detach(), x.grad


def make(randn, kind, shape, dtype=torch.float32):
    x = randn(*shape, scale=3.0, dtype=dtype)
    out = list(shape)
    if kind in GATED:
        out[-1] //= 2
    return x, randn(*out, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_fp32_matches_formula(kind, shape, randn):
    x, dy = make(randn, kind, shape)
    y, dx = run(kind, x, dy)
    want_y, want_dx, y_scale, dx_scale = oracle(kind, x, dy)
    assert y.shape == want_y.shape and dx.shape == x.shape
    assert_fp32_close(y, want_y, y_scale, f"{kind} forward")
    assert_fp32_close(dx, want_dx, dx_scale, f"{kind} backward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_16bit_is_fp32_math_rounded_once(kind, dtype, randn):
    x, dy = make(randn, kind, (4, 9, 2 * 64), dtype)
    y, dx = run(kind, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    want_y, want_dx, y_scale, dx_scale = oracle(kind, x, dy)  # from the 16-bit values
    assert_rounded_once(y, want_y, y_scale, f"{kind} forward")
    assert_rounded_once(dx, want_dx, dx_scale, f"{kind} backward")


@pytest.mark.parametrize("kind", sorted(GATED))
def test_gated_order_first_half_is_activated(kind, randn):
    """TE's order: act(first half) * second half, the opposite of torch's F.glu."""
    a, b = randn(3, 40, scale=3.0), randn(3, 40, scale=3.0)
    act = ACT[BASE[kind]]
    y = activation(torch.cat([a, b], dim=-1), kind)
    torch.testing.assert_close(y, act(a) * b, rtol=1e-5, atol=1e-5)
    assert (y - act(b) * a).abs().max() > 0.1
    if kind == "glu":
        assert (y - F.glu(torch.cat([a, b], dim=-1), dim=-1)).abs().max() > 0.1


def test_swiglu_is_silu_gate_times_up(randn):
    gate, up = randn(2, 5, 48, scale=3.0), randn(2, 5, 48, scale=3.0)
    x = torch.cat([gate, up], dim=-1).requires_grad_(True)
    y = activation(x, "swiglu")
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    dy = randn(2, 5, 48)
    y.backward(dy)
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    (F.silu(g) * u).backward(dy)
    torch.testing.assert_close(x.grad[..., :48], g.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad[..., 48:], u.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_strided_input_and_grad(kind, randn):
    """A non-contiguous input (a transposed view) and a non-contiguous upstream gradient."""
    x = randn(96, 6, scale=3.0).t()  # [6, 96], last dim stride 6
    out = x.shape[1] // 2 if kind in GATED else x.shape[1]
    dy = randn(out, 6).t()
    y, dx = run(kind, x, dy)
    want_y, want_dx, y_scale, dx_scale = oracle(kind, x, dy)
    assert_fp32_close(y, want_y, y_scale, "forward")
    assert_fp32_close(dx, want_dx, dx_scale, "backward")


def test_large_inputs_stay_finite():
    """|x| up to 1e4: exp overflows to inf inside sigmoid, results stay finite (x or 0)."""
    x = torch.tensor([[-1e4, -100.0, -30.0, 30.0, 100.0, 1e4]])
    for kind in ("gelu", "qgelu", "silu"):
        y, dx = run(kind, x, torch.ones_like(x))
        assert torch.isfinite(y).all() and torch.isfinite(dx).all(), kind
        torch.testing.assert_close(y, torch.where(x > 0, x, torch.zeros_like(x)), rtol=0, atol=1e-10)
        torch.testing.assert_close(dx, (x > 0).float(), rtol=0, atol=1e-10)
    y, dx = run("glu", torch.cat([x, torch.ones_like(x)], dim=-1), torch.ones_like(x))
    assert torch.isfinite(dx).all()


def test_zero_size_and_leading_dims(randn):
    x = randn(0, 3, 8, requires_grad=True)
    y = activation(x, "swiglu")
    assert y.shape == (0, 3, 4)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert activation(randn(7), "relu").shape == (7,)
    assert activation(randn(3, 0), "gelu").shape == (3, 0)


def test_errors(randn):
    with pytest.raises(ValueError, match="unknown activation 'swish'.*" + ", ".join(ACTIVATIONS)):
        activation(randn(2, 4), "swish")
    with pytest.raises(ValueError, match="must be even"):
        activation(randn(2, 5), "swiglu")
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        activation(randn(2, 4).double(), "gelu")
    with pytest.raises(ValueError, match="at least one dim"):
        activation(torch.tensor(1.0), "relu")
    from tritium.ref import activation as ref
    with pytest.raises(ValueError, match="dy must be"):
        ref.activation_bwd(randn(2, 3), randn(2, 8), "swiglu")
    with pytest.raises(ValueError, match="2D"):
        ref.activation_fwd(randn(2, 3, 4), "gelu")


def test_kernel_module_has_the_same_names():
    from tritium.kernels import activation as kernel
    from tritium.ref import activation as ref
    assert kernel.ACTIVATIONS == ref.ACTIVATIONS and kernel.GATED == ref.GATED
    assert set(ref.GATED) < set(ref.ACTIVATIONS) and PLAIN == ["gelu", "qgelu", "relu", "srelu",
                                                                 "silu"]
    for name in ("_K2", "_K2C", "_K2C3"):
        assert getattr(kernel, name).value == getattr(ref, name)
    assert kernel._QG.value == ref._QGELU
