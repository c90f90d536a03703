"""Bitwise comparison and fresh random data for the interp tier.

Kernel and twin must agree bit for bit: floats are compared as integer views, so -0.0 != 0.0 and
every rounding counts. NaN is the one exception where noted: its payload/sign is not a numerical
result, so `assert_same_bits(..., nan_as_nan=True)` only demands NaN in the same places.
"""
from __future__ import annotations

import torch

from tritium.fp8.tensor import Float8Tensor

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def assert_same_bits(got, want, what: str = "", nan_as_nan: bool = False) -> None:
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert got is not None, f"{what}: got None"
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    g, w = bits(got).reshape(-1), bits(want).reshape(-1)
    gf, wf = got.float().reshape(-1), want.float().reshape(-1)
    if nan_as_nan:
        gn, wn = gf.isnan(), wf.isnan()
        assert torch.equal(gn, wn), f"{what}: NaN at different places"
        g, w, gf, wf = g[~gn], w[~wn], gf[~gn], wf[~wn]
    diff = (g != w).nonzero().reshape(-1)
    if diff.numel():
        k = diff[0].item()
        raise AssertionError(f"{what}: {diff.numel()} of {g.numel()} differ; first (flat {k}): "
                             f"got {gf[k].item()!r} ({g[k].item():#x}), "
                             f"want {wf[k].item()!r} ({w[k].item():#x})")


def assert_same_optimizer_results(params, opt, want_params, want_opt,
                                  nan_as_nan: bool = False) -> None:
    """Two optimizer runs agree bit for bit: each parameter (a Float8Tensor's data, scale_inv,
    amax and transpose) and its exp_avg / exp_avg_sq / master_param state (entries that are
    None in `want_opt` are skipped)."""
    for a, b in zip(params, want_params):
        if isinstance(b, Float8Tensor):
            for name in ("_data", "_scale_inv", "_amax", "_transpose"):
                assert_same_bits(getattr(a, name), getattr(b, name), name, nan_as_nan)
        else:
            assert_same_bits(a.detach(), b.detach(), "param", nan_as_nan)
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            if want_opt.state[b][name] is not None:
                assert_same_bits(opt.state[a][name], want_opt.state[b][name], name, nan_as_nan)


def wide_randn(shape, dtype: torch.dtype, gen: torch.Generator,
               decades: float = 3.0) -> torch.Tensor:
    """Normal values times 10**U(-decades, decades): many magnitudes, never zero."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    e = torch.empty(shape, dtype=torch.float64).uniform_(-decades, decades, generator=gen)
    x = x * 10.0 ** e
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)
