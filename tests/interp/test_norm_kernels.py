"""`tritium.kernels.norm` == `tritium.ref.norm` under the Triton interpreter, to within rounding.

Why not bit for bit, unlike the cast kernels: these are reductions. The row sums (mean,
variance, the two backward dot products) and the column sums of dweight/dbias add the same
fp32 terms in a different order in the kernel (tree reductions, per-program partial sums) and
in the twin (torch's vectorized sums), so fp32 results differ by a few ulps. Hence:
  * fp32 outputs (y, dx, mean, rstd, fp32 dweight/dbias): rtol 1e-6, atol 1e-6;
  * 16-bit outputs: at most one unit in the last place of the output dtype apart (both round a
    near-identical fp32 value once, so a different rounding can only move one step).
Everything else about the contract is exact: dtypes, shapes, the saved mean/rstd.

Sizes are tiny and odd: rows 1..9 (under the interpreter a forward tile has 2 rows and the
backward runs at most 3 programs, so row tiles are masked and programs loop over several tiles
and sum their partial dgamma rows), hidden 16, 100 and 257 (masked columns). Data has a non-zero
mean and a spread of 2 so LayerNorm's mean subtraction matters.
"""
from __future__ import annotations

import pytest
import torch

from tritium.functional import norm as fnorm
from tritium.kernels import norm as knorm
from tritium.ref import norm as rnorm

# The interpreter turns a program id used as a loop bound into an int through a deprecated
# numpy path; it says nothing about the kernels.
pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 2, 5, 9]
HIDDEN = [16, 100, 257]
# (zero_centered_gamma, weight dtype: None = x's dtype)
GAMMA = [(False, None), (True, torch.float32)]
_INT = {2: torch.int16, 4: torch.int32}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Integers that step by one between neighbouring floats of t's dtype (+0 == -0)."""
    i = t.contiguous().view(_INT[t.element_size()]).long()
    mag = i & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def assert_near(got, want, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")
        return
    steps = (_ordered(got) - _ordered(want)).abs()
    if steps.max() > 1:
        k = int(steps.argmax())
        raise AssertionError(f"{what}: {int((steps > 1).sum())} of {steps.numel()} more than one "
                             f"ulp apart; first: got {got.view(-1)[k].item()!r}, "
                             f"want {want.view(-1)[k].item()!r}")


def _data(rows, hidden, dtype, w_dtype, gen):
    x = (torch.randn(rows, hidden, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(w_dtype or dtype)
    b = (torch.randn(hidden, generator=gen) * 0.5).to(w_dtype or dtype)
    return x, dy, w, b


def _check_layernorm(x, dy, w, b, eps, zc, need_bias_grad=True):
    (ky, kmean, krstd), (ry, rmean, rrstd) = (m.layernorm_fwd(x, w, b, eps, zc)
                                               for m in (knorm, rnorm))
    for name, g, want in (("y", ky, ry), ("mean", kmean, rmean), ("rstd", krstd, rrstd)):
        assert_near(g, want, name)
    # Both backwards read the twin's saved statistics: this compares the backward alone.
    kb = knorm.layernorm_bwd(dy, x, w, rmean, rrstd, zc, need_bias_grad=need_bias_grad)
    rb = rnorm.layernorm_bwd(dy, x, w, rmean, rrstd, zc, need_bias_grad=need_bias_grad)
    for name, g, want in zip(("dx", "dweight", "dbias"), kb, rb):
        assert_near(g, want, name)


@pytest.mark.parametrize("zc,w_dtype", GAMMA, ids=["gamma", "zero_centered_fp32w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_layernorm(rows, hidden, dtype, zc, w_dtype, gen):
    x, dy, w, b = _data(rows, hidden, dtype, w_dtype, gen)
    _check_layernorm(x, dy, w, b, 1e-5, zc)


@pytest.mark.parametrize("zc,w_dtype", GAMMA, ids=["gamma", "zero_centered_fp32w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm(rows, hidden, dtype, zc, w_dtype, gen):
    x, dy, w, _ = _data(rows, hidden, dtype, w_dtype, gen)
    (ky, krstd), (ry, rrstd) = (m.rmsnorm_fwd(x, w, 1e-5, zc) for m in (knorm, rnorm))
    assert_near(ky, ry, "y")
    assert_near(krstd, rrstd, "rstd")
    kb = knorm.rmsnorm_bwd(dy, x, w, rrstd, zc)
    rb = rnorm.rmsnorm_bwd(dy, x, w, rrstd, zc)
    for name, g, want in zip(("dx", "dweight"), kb, rb):
        assert_near(g, want, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_no_bias_no_bias_grad_large_eps(dtype, gen):
    x, dy, w, _ = _data(7, 48, dtype, None, gen)
    _check_layernorm(x, dy, w, None, 0.25, False, need_bias_grad=False)


def test_strided_rows(gen):
    """Rows that are views into a wider tensor (row stride != hidden) and an expanded dy."""
    big = torch.randn(6, 80, generator=gen) + 1
    x = big[:, 3:67]
    w = torch.randn(64, generator=gen)
    dy = torch.randn(1, 64, generator=gen).expand(6, 64)
    assert x.stride(0) == 80 and dy.stride(0) == 0
    ky, kmean, krstd = knorm.layernorm_fwd(x, w, w, 1e-5, False)
    ry, rmean, rrstd = rnorm.layernorm_fwd(x, w, w, 1e-5, False)
    assert_near(ky, ry, "y")
    for name, g, want in zip(("dx", "dweight", "dbias"),
                             knorm.layernorm_bwd(dy, x, w, rmean, rrstd, False),
                             rnorm.layernorm_bwd(dy, x, w, rmean, rrstd, False)):
        assert_near(g, want, name)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_functional_kernels_vs_ref(kind, dtype, gen, setenv):
    """Autograd Functions on 3D inputs: kernels (interpreted) vs TRITIUM_FORCE_REF=1."""
    x0 = (torch.randn(3, 3, 40, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(3, 3, 40, generator=gen).to(dtype)
    w0 = torch.randn(40, generator=gen).to(dtype)
    b0 = torch.randn(40, generator=gen).to(dtype)
    outs = []
    for force_ref in ("0", "1"):
        setenv("TRITIUM_FORCE_REF", force_ref)
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        impl = fnorm._impl(x)
        assert impl is (rnorm if force_ref == "1" else knorm)
        y = fnorm.layer_norm(x, w, b, 1e-5, True) if kind == "layer_norm" \
            else fnorm.rms_norm(x, w, 1e-5, True)
        y.backward(dy)
        outs.append((y, x.grad, w.grad, b.grad))
    for name, g, want in zip(("y", "dx", "dweight", "dbias"), *outs):
        assert_near(g, want, name)


def test_empty_rows():
    x = torch.empty(0, 16)
    w = torch.ones(16)
    y, mean, rstd = knorm.layernorm_fwd(x, w, w, 1e-5, False)
    assert y.shape == (0, 16) and mean.shape == rstd.shape == (0,)
    dx, dw, db = knorm.layernorm_bwd(x, x, w, mean, rstd, False)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16)) and torch.equal(db, dw)


def test_tile_choice_and_limit():
    assert fnorm._MAX_HIDDEN == knorm.MAX_HIDDEN
    for hidden in (100, 768, 1000, 4096, 5000, 8192, 12288, knorm.MAX_HIDDEN):
        for backward in (False, True):
            block_rows, block_n, warps = knorm._tile(hidden, False, backward)
            assert block_n >= hidden and block_n & (block_n - 1) == 0
            assert warps in (4, 8, 16, 32) and 1 <= block_rows <= 16
            assert block_rows == 1 or block_rows * block_n <= 4096
    assert knorm._tile(4096, False) == knorm._tile(4096, False, True) == (1, 4096, 8)
    assert knorm._tile(12288, False, True) == (1, 16384, 32)
    with pytest.raises(ValueError, match="hidden size"):
        knorm._tile(knorm.MAX_HIDDEN + 1, False)
    wide = torch.randn(2, knorm.MAX_HIDDEN + 1)
    assert fnorm._impl(wide) is rnorm  # the functional layer falls back to the twin


@pytest.mark.parametrize("prefetch", [False, True], ids=["load_in_loop", "prefetch"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_with_and_without_prefetch(is_rms, prefetch, gen, monkeypatch):
    """The backward's next-tile prefetch (the default) and the plain in-loop loads (the bench
    sweep's other setting) give the twin's gradients; 9 rows over 3 programs of 2-row tiles
    make each program loop, prefetching past the last tile."""
    monkeypatch.setattr(knorm, "_BWD_PREFETCH", prefetch)
    x, dy, w, b = _data(9, 100, torch.bfloat16, None, gen)
    if is_rms:
        _, rstd = rnorm.rmsnorm_fwd(x, w, 1e-5, False)
        got, want = (m.rmsnorm_bwd(dy, x, w, rstd, False) for m in (knorm, rnorm))
    else:
        _, mean, rstd = rnorm.layernorm_fwd(x, w, b, 1e-5, False)
        got, want = (m.layernorm_bwd(dy, x, w, mean, rstd, False) for m in (knorm, rnorm))
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        assert_near(g, r, name)
