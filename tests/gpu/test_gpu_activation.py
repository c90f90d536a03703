"""gpu tier: the activation kernels against their ref twins on CUDA, at the benchmark shape
(8192 x 14336 bf16, gated input 8192 x 28672) for swiglu and gelu and at odd sizes for every
kind and dtype; the functional API against eager torch.

Tolerances (why not bit for bit): on the GPU the kernel's exp is ex2.approx after a multiply by
log2(e) (relative error ~|z| * 6e-8), its fp32 division is div.full (2 ulp), and LLVM contracts
multiply-adds into FMAs; the twin runs torch's exp and IEEE division. So for fp32
|kernel - ref| <= 2e-6 |ref| + 1e-5 max(1, |multiplier|) (TE's fp32 atol; the multiplier is dy,
b or dy * b, which scales an absolute error of act'(a) near its zeros, see
tests/interp/test_activation_kernels.py), and 16-bit outputs are within one ulp of the dtype
plus that allowance, and equal almost everywhere.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from tritium.functional.activation import activation
from tritium.kernels import activation as kact
from tritium.ref import activation as ract

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANT = {torch.bfloat16: 7, torch.float16: 10}
ODD = [(1, 1), (3, 33), (37, 1000), (1000, 4097), (8191, 24)]  # (rows, F)


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _, e = torch.frexp(t.abs())
    tiny = torch.finfo(dtype).tiny * 2.0 ** -MANT[dtype]
    return torch.clamp(torch.ldexp(torch.ones_like(t), e - 1 - MANT[dtype]), min=tiny)


def _assert_close(got, want, scale, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{what}: NaN at different places"
    g, w, scale = g.nan_to_num(0.0), w.nan_to_num(0.0), scale.float()
    allow = 2e-6 * w.abs() + 1e-5 * torch.clamp(scale.abs(), min=1.0)
    if got.dtype != torch.float32:
        allow = allow + _ulp(torch.maximum(g.abs(), w.abs()), got.dtype)
        same = (g == w).float().mean().item()
        assert same >= 0.95, f"{what}: only {same:.3f} of values equal"
    bad = (g - w).abs() > allow
    if bad.any():
        k = bad.reshape(-1).nonzero()[0].item()
        raise AssertionError(f"{what}: {bad.sum().item()} of {g.numel()} differ; first got "
                             f"{g.reshape(-1)[k].item()!r}, want {w.reshape(-1)[k].item()!r}")


def _scales(kind, x, dy):
    xf, dyf = x.float(), dy.float()
    if kind in ract.GATED:
        b = xf[:, xf.shape[1] // 2:]
        return b, torch.cat([dyf * b, dyf], dim=1)
    return torch.zeros_like(dyf), dyf


def _data(kind, rows, f, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * f if kind in ract.GATED else f
    x = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(dtype)
    dy = torch.randn(rows, f, device="cuda", generator=g).to(dtype)
    return x, dy


def _check(kind, x, dy):
    y_scale, dx_scale = _scales(kind, x, dy)
    y = kact.activation_fwd(x, kind)
    _assert_close(y, ract.activation_fwd(x, kind), y_scale, f"{kind} forward")
    dx = kact.activation_bwd(dy, x, kind)
    _assert_close(dx, ract.activation_bwd(dy, x, kind), dx_scale, f"{kind} backward")
    # the second call takes the Launcher's direct path (the first compiles): same bits
    assert torch.equal(kact.activation_fwd(x, kind), y)
    assert torch.equal(kact.activation_bwd(dy, x, kind), dx)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_benchmark_shape_bf16(kind):
    x, dy = _data(kind, 8192, 14336, torch.bfloat16, seed=1)
    _check(kind, x, dy)


@pytest.mark.parametrize("shape", ODD, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ract.ACTIVATIONS)
def test_odd_shapes(kind, dtype, shape):
    x, dy = _data(kind, *shape, dtype, seed=zlib.crc32(f"{kind}{dtype}{shape}".encode()))
    _check(kind, x, dy)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_strided_rows(kind):
    x, dy = _data(kind, 333, 1000, torch.bfloat16, seed=3)
    wide = torch.zeros(333, x.shape[1] + 24, device="cuda", dtype=x.dtype)
    wide[:, 8:8 + x.shape[1]] = x
    _check(kind, wide[:, 8:8 + x.shape[1]], dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_functional_swiglu_vs_eager(dtype):
    """activation(x, "swiglu") on [B, S, 2F] == silu(gate) * up computed in fp32, rounded once."""
    x, dy = _data("swiglu", 4 * 512, 1408, dtype, seed=4)
    x = x.reshape(4, 512, -1).requires_grad_(True)
    y = activation(x, "swiglu")
    y.backward(dy.reshape(4, 512, -1))
    xf = x.detach().float().requires_grad_(True)
    yf = F.silu(xf[..., :1408]) * xf[..., 1408:]
    yf.backward(dy.float().reshape(4, 512, -1))
    torch.testing.assert_close(y.float(), yf.to(dtype).float(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(x.grad.float(), xf.grad.to(dtype).float(), rtol=1.6e-2, atol=1e-4)
