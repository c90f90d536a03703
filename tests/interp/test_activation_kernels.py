"""`tritium.kernels.activation` == `tritium.ref.activation` under the Triton interpreter.

Every kind, fp32/bf16/fp16, forward and backward, at tiny shapes (rows 1..5, F 1, 8, 33, 100;
interpreter tiles are 2 rows x up to 32 columns, so these cross row and column block edges and
exercise the masks), plus strided rows (the 2D path for plain kinds), a transposed input, the
functional API routed to the kernel, and inf/NaN/huge inputs.

Tolerances, and why not bit for bit: kernel and twin follow the same formula step by step, but
the interpreter evaluates tl.exp with numpy and the twin with torch, and the two differ in the
last bit or two of fp32 (in ~40% of inputs). Everything else (IEEE +, *, /, the final rounding)
is identical. So
  * fp32: |kernel - ref| <= 1e-6 * max(1, |ref|, |multiplier|) (rtol = atol = 1e-6, a few fp32
    ulps), where the multiplier is dy (dx), b (gated y) or dy * b (gated d_a): near a zero of
    act'(a) (e.g. gelu' at -0.75) an ulp-level difference in exp leaves an absolute difference
    of ~1e-8 in act'(a), which d_a = (dy * b) * act'(a) scales by |dy * b|, not by |d_a|;
  * 16-bit outputs: within 1 ulp of the output dtype (two fp32 values an ulp apart can round to
    neighbouring 16-bit values) plus the same fp32-level allowance, and equal almost everywhere.
"""
from __future__ import annotations

import pytest
import torch

from tritium import _device
from tritium.functional import activation as fact
from tritium.kernels import activation as kact
from tritium.ref import activation as ract

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,  # exp overflows to inf inside sigmoid by design
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (2, 8), (3, 33), (5, 100)]  # (rows, F); gated inputs are [rows, 2F]
MANT = {torch.bfloat16: 7, torch.float16: 10}


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _, e = torch.frexp(t.double().abs())
    tiny = torch.finfo(dtype).tiny * 2.0 ** -MANT[dtype]
    return torch.clamp(torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 1 - MANT[dtype]),
                       min=tiny)


def assert_close_kernel(got, want, scale, what):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    g, w = got.double(), want.double()
    assert torch.equal(g.isnan(), w.isnan()), f"{what}: NaN at different places"
    ok = ~w.isnan()
    g, w, scale = g[ok], w[ok], scale.double()[ok]
    inf = w.isinf()
    assert torch.equal(g[inf], w[inf]), f"{what}: infinities differ"
    g, w, scale = g[~inf], w[~inf], scale[~inf]
    allow = 1e-6 * torch.maximum(torch.maximum(w.abs(), scale.abs()), torch.ones_like(w))
    if got.dtype != torch.float32:
        allow = allow + ulp(torch.maximum(g.abs(), w.abs()), got.dtype)
        assert (g == w).double().mean() >= 0.95 if g.numel() >= 20 else True, \
            f"{what}: too many values an ulp apart"
    diff = (g - w).abs()
    bad = (diff > allow).nonzero().reshape(-1)
    if bad.numel():
        k = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} differ; first: got "
                             f"{g[k].item()!r}, want {w[k].item()!r} (allowed {allow[k].item():.3g})")


def scales(kind, x, dy):
    """Multipliers of y and dx (see the module docstring), fp32."""
    xf, dyf = x.float(), dy.float()
    if kind in ract.GATED:
        b = xf[:, xf.shape[1] // 2:]
        return b, torch.cat([dyf * b, dyf], dim=1)
    return torch.zeros_like(dyf), dyf


def check(kind, x, dy):
    y_k, y_r = kact.activation_fwd(x, kind), ract.activation_fwd(x, kind)
    dx_k, dx_r = kact.activation_bwd(dy, x, kind), ract.activation_bwd(dy, x, kind)
    y_scale, dx_scale = scales(kind, x, dy)
    assert_close_kernel(y_k, y_r, y_scale, f"{kind} forward")
    assert_close_kernel(dx_k, dx_r, dx_scale, f"{kind} backward")
    return y_k, dx_k


def data(kind, rows, f, dtype, gen, scale=3.0):
    width = 2 * f if kind in ract.GATED else f
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    dy = torch.randn(rows, f, generator=gen).to(dtype)
    return x, dy


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ract.ACTIVATIONS)
def test_kernel_matches_ref(kind, dtype, shape, gen):
    x, dy = data(kind, *shape, dtype, gen)
    y, dx = check(kind, x, dy)
    assert y.shape == dy.shape and dx.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ract.ACTIVATIONS)
def test_strided_rows(kind, dtype, gen):
    """Rows further apart than their width (a column slice): the 2D path for every kind."""
    rows, f = 5, 33
    width = 2 * f if kind in ract.GATED else f
    x = (torch.randn(rows, width + 7, generator=gen) * 3).to(dtype)[:, :width]
    dy = torch.randn(rows, f + 3, generator=gen).to(dtype)[:, 1:f + 1]
    assert not x.is_contiguous() and x.stride(-1) == 1
    check(kind, x, dy)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_transposed_input(kind, gen):
    x, dy = data(kind, 6, 12, torch.float32, gen)
    x_t = x.t().contiguous().t()  # same values, last-dim stride != 1
    y, dx = check(kind, x_t, dy)
    assert_same_bits(y, kact.activation_fwd(x, kind), "forward")
    assert_same_bits(dx, kact.activation_bwd(dy, x, kind), "backward")


@pytest.mark.parametrize("kind", ["qgelu", "sreglu"])
def test_functional_runs_the_kernel(kind, gen):
    x, dy = data(kind, 4, 8, torch.bfloat16, gen)
    x3 = x.reshape(2, 2, -1).requires_grad_(True)
    assert _device.use_triton(x3) and fact._impl(x3) is kact
    y = fact.activation(x3, kind)
    y.backward(dy.reshape(2, 2, -1))
    assert_same_bits(y.detach().reshape(4, -1), kact.activation_fwd(x, kind), "forward")
    assert_same_bits(x3.grad.reshape(4, -1), kact.activation_bwd(dy, x, kind), "backward")


@pytest.mark.parametrize("kind", ract.ACTIVATIONS)
def test_special_values(kind):
    vals = [-float("inf"), -1e30, -1e4, -100.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 100.0, 1e4,
            float("inf"), float("nan"), 1.0, -1.0, 0.5]
    v = torch.tensor(vals)
    if kind in ract.GATED:
        x = torch.stack([torch.cat([v, v.flip(0)]), torch.cat([v, torch.ones_like(v)])])
    else:
        x = torch.stack([v, v.flip(0)])
    dy = torch.ones(2, len(vals))
    check(kind, x, dy)
    y = kact.activation_fwd(x, kind)
    if kind in ("relu", "srelu", "silu", "gelu", "qgelu"):
        assert y[0, 12].isnan(), "NaN must propagate"  # vals[12] is NaN


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown activation"):
        kact.activation_fwd(torch.ones(2, 4), "swish")
    with pytest.raises(ValueError, match="even"):
        kact.activation_fwd(torch.ones(2, 5), "geglu")
    with pytest.raises(ValueError, match="dy must be"):
        kact.activation_bwd(torch.ones(2, 4), torch.ones(2, 4), "geglu")
    assert kact.activation_fwd(torch.ones(0, 4), "glu").shape == (0, 2)
    assert kact.activation_bwd(torch.ones(3, 0), torch.ones(3, 0), "relu").shape == (3, 0)
