"""`tritium.kernels.cross_entropy` == `tritium.ref.cross_entropy` under the Triton interpreter.

Not bit for bit: the kernel's online log-sum-exp adds the exponentials block by block (rescaling
the running sum when the max grows) and sums the logits in another order than torch's full-row
reductions, so fp32 stats, loss and lse agree to rtol 1e-6 / atol 1e-6; the gradient is
exp(x - lse) of the same lse up to those ulps, so fp32 gradients agree to the same tolerance and
16-bit gradients to one unit in the last place (both round a near-identical fp32 value once).
The interpreter's bf16 casts are routed through torch by the conftest patch.

Sizes: 1 to 6 rows, vocabularies 5 (one partial block of 16), 16, 37 and 100 (several blocks and
a ragged tail), targets ignored, out of a vocab slice, and at both ends of a row.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.kernels import cross_entropy as kce
from tritium.ref import cross_entropy as rce

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

TOL = dict(rtol=1e-6, atol=1e-6)


def _close(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")
    else:
        ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=torch.finfo(
            want.dtype).tiny)
        assert ((got.float() - want.float()).abs() <= ulp + 1e-30).all(), what


def _data(rows, v, dtype, gen):
    x = (torch.randn(rows, v, generator=gen) * 3).to(dtype)
    t = torch.randint(0, v, (rows,), generator=gen)
    t[0] = v - 1
    if rows > 2:
        t[1], t[2] = -100, 0
    return x, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,v", [(1, 5), (3, 16), (4, 37), (6, 100)])
@pytest.mark.parametrize("eps,z", [(0.0, 0.0), (0.2, 1e-2)])
def test_fused(dtype, rows, v, eps, z, gen):
    x, t = _data(rows, v, dtype, gen)
    scale = torch.rand(1, generator=gen) + 0.5
    gk, gr = torch.empty_like(x), torch.empty_like(x)
    lk, sk = kce.ce_fused(x, t, gk, scale, -100, eps, z)
    lr, sr = rce.ce_fused(x, t, gr, scale, -100, eps, z)
    _close(lk, lr, "loss")
    _close(sk, sr, "lse")
    _close(gk, gr, "grad")
    # in place: the gradient overwrites the logits
    xi = x.clone()
    li, _ = kce.ce_fused(xi, t, xi, scale, -100, eps, z)
    _close(li, lr, "loss (in place)")
    _close(xi, gr, "grad (in place)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 20])
def test_stats_and_grad_of_a_vocab_slice(dtype, start, gen):
    x, t = _data(5, 37, dtype, gen)
    t = t + start // 2  # some targets fall outside the slice [start, start + 37)
    t[1] = -100
    _close(kce.ce_stats(x, t, start), rce.ce_stats(x, t, start), "stats")
    lse = torch.randn(5, generator=gen) + 4
    scale = torch.rand(5, generator=gen)  # one scale per row
    gk, gr = torch.empty_like(x), torch.empty_like(x)
    kce.ce_grad(x, t, lse, gk, scale, -100, start, 80, 0.1, 1e-3)
    rce.ce_grad(x, t, lse, gr, scale, -100, start, 80, 0.1, 1e-3)
    _close(gk, gr, "grad")
    assert (gk[1] == 0).all()


def test_strided_rows(gen):
    base = torch.randn(4, 48, generator=gen)
    x = base[:, :37]  # row stride 48
    t = torch.randint(0, 37, (4,), generator=gen)
    g = torch.empty(4, 40)[:, :37]
    lk, _ = kce.ce_fused(x, t, g, torch.ones(1), -100, 0.0, 0.0)
    gr = torch.empty(4, 37)
    lr, _ = rce.ce_fused(x, t, gr, torch.ones(1), -100, 0.0, 0.0)
    _close(lk, lr, "loss")
    _close(g.contiguous(), gr, "grad")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_kernel_path(reduction, setenv, gen):
    """The whole chunked function on the kernel path == on the ref path (in-place gradients,
    a ragged last chunk, label smoothing and z-loss)."""
    h = torch.randn(21, 16, generator=gen)
    w = torch.randn(37, 16, generator=gen) * 0.5
    t = torch.randint(0, 37, (21,), generator=gen)
    t[3] = -100
    gout = torch.randn(21, generator=gen) if reduction == "none" else torch.tensor(1.0)
    results = []
    for force_ref in ("0", "1"):
        setenv("TRITIUM_FORCE_REF", force_ref)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = te.linear_cross_entropy(hh, ww, t, reduction=reduction, label_smoothing=0.1,
                                       lse_square_scale=1e-2, chunk_size=8)
        loss.backward(gout)
        results.append((loss.detach(), hh.grad, ww.grad))
    for got, want, what in zip(results[0], results[1], ("loss", "dh", "dw")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
