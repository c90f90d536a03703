"""gpu tier: the LayerNorm/RMSNorm Triton kernels against their PyTorch twins on CUDA, at real
sizes (16384x4096 bf16, 8x12288, an odd 3x5000, a 2x65536 row at the register limit), and the
modules against torch.nn. Skipped without CUDA.

Tolerances (why not bitwise: see tests/interp/test_norm_kernels.py; on CUDA torch.rsqrt is also
an approximate instruction while the kernels round 1/sqrt exactly): fp32 results rtol 1e-5,
16-bit results at most one ulp of their dtype apart, or closer than an absolute slack that covers
fp32 reordering error where the fp32 value nearly cancels (1e-5 per element; the dweight/dbias
column sums over R rows get 1e-5 * sqrt(R)).
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.kernels import norm as knorm
from tritium.ref import norm as rnorm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALL = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(16384, 4096, torch.bfloat16)] + [(8, 12288, d) for d in ALL] \
    + [(3, 5000, d) for d in ALL] + [(1000, 768, torch.float16), (2, 65536, torch.bfloat16)]
_INT = {2: torch.int16, 4: torch.int32}


def _ordered(t):
    i = t.contiguous().view(_INT[t.element_size()]).long()
    mag = i & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def assert_near(got, want, what, atol=1e-5):
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    steps = (_ordered(got) - _ordered(want)).abs()
    close = (got.float() - want.float()).abs() <= atol
    bad = (steps > 1) & ~close
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} more than one ulp and "
                           f"{atol} apart")


def _data(rows, hidden, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    dy = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn(hidden, device="cuda", generator=g) * 0.5 + 1).to(dtype)
    b = (torch.randn(hidden, device="cuda", generator=g) * 0.5).to(dtype)
    return x, dy, w, b


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("rows,hidden,dtype", CASES, ids=str)
def test_layernorm_kernel_vs_ref(rows, hidden, dtype, zc):
    x, dy, w, b = _data(rows, hidden, dtype, seed=rows + hidden)
    k = knorm.layernorm_fwd(x, w, b, 1e-5, zc)
    r = rnorm.layernorm_fwd(x, w, b, 1e-5, zc)
    for name, g, want in zip(("y", "mean", "rstd"), k, r):
        assert_near(g, want, name)
    col = 1e-5 * rows ** 0.5
    kb = knorm.layernorm_bwd(dy, x, w, r[1], r[2], zc)
    rb = rnorm.layernorm_bwd(dy, x, w, r[1], r[2], zc)
    for name, g, want, atol in zip(("dx", "dweight", "dbias"), kb, rb, (1e-5, col, col)):
        assert_near(g, want, name, atol)


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("rows,hidden,dtype", CASES, ids=str)
def test_rmsnorm_kernel_vs_ref(rows, hidden, dtype, zc):
    x, dy, w, _ = _data(rows, hidden, dtype, seed=rows * hidden)
    k = knorm.rmsnorm_fwd(x, w, 1e-5, zc)
    r = rnorm.rmsnorm_fwd(x, w, 1e-5, zc)
    for name, g, want in zip(("y", "rstd"), k, r):
        assert_near(g, want, name)
    kb = knorm.rmsnorm_bwd(dy, x, w, r[1], zc)
    rb = rnorm.rmsnorm_bwd(dy, x, w, r[1], zc)
    for name, g, want, atol in zip(("dx", "dweight"), kb, rb, (1e-5, 1e-5 * rows ** 0.5)):
        assert_near(g, want, name, atol)


def test_backward_is_deterministic():
    """Partial sums, no atomics: the same call twice gives the same bits (the second call also
    takes the Launcher's cached fast path)."""
    x, dy, w, b = _data(4096, 4096, torch.bfloat16, seed=7)
    _, mean, rstd = knorm.layernorm_fwd(x, w, b, 1e-5, False)
    first = knorm.layernorm_bwd(dy, x, w, mean, rstd, False)
    second = knorm.layernorm_bwd(dy, x, w, mean, rstd, False)
    for a, c in zip(first, second):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_vs_torch(kind, dtype):
    hidden = 4096
    mod = getattr(te, kind)(hidden, eps=1e-5, params_dtype=dtype)
    ref = getattr(torch.nn, kind)(hidden, eps=1e-5, device="cuda")
    with torch.no_grad():
        for p, q in zip(mod.parameters(), ref.parameters()):
            p.copy_(torch.randn_like(p) * 0.5 + 1)
            q.copy_(p.float())
    x0 = torch.randn(4, 512, hidden, device="cuda").to(dtype)
    dy = torch.randn_like(x0)
    x, xr = x0.clone().requires_grad_(True), x0.float().requires_grad_(True)
    y, yr = mod(x), ref(xr)
    y.backward(dy)
    yr.backward(dy.float())
    tol = dict(rtol=1.3e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    col_tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else tol
    torch.testing.assert_close(y.float(), yr, **tol)
    torch.testing.assert_close(x.grad.float(), xr.grad, **tol)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad, **col_tol)
