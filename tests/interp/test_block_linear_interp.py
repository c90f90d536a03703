"""A Linear under Float8BlockScaling through the Triton kernels (interpreter) == through the
twins (TRITIUM_FORCE_REF=1), bit for bit: the dispatch, the scale layouts each GEMM reads
(fprop, dgrad with the weight's transposed 128x128 grid, wgrad along tokens) and the token
padding are the same on both paths. Integer-valued inputs keep every slice sum exact."""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import _env, recipe
from tritium.fp8 import block as block_ops

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]


@pytest.mark.parametrize("w_dim", [1, 2])
def test_block_linear_kernels_equal_twins(w_dim, gen, monkeypatch):
    t, k, n = 40, 256, 144
    layer = te.Linear(k, n, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-8, 9, (n, k), generator=gen).float())
    x = torch.randint(-8, 9, (t, k), generator=gen).float()
    dy = torch.randint(-8, 9, (t, n), generator=gen).float()
    r = recipe.Float8BlockScaling(w_block_scaling_dim=w_dim)
    kcast, kgemm = block_ops._kernels()
    calls = []
    for mod, name in ((kcast, "quantize_blocks"), (kgemm, "block_gemm_tn")):
        def spy(*args, _fn=getattr(mod, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(mod, name, spy)
    results = []
    for force_ref in ("0", "1"):
        monkeypatch.setenv("TRITIUM_FORCE_REF", force_ref)
        _env.reload()
        if force_ref == "1":  # the kernels ran: 3 GEMMs and 3 casts (x, w, dy; this small a
            # weight's columnwise blocks are made in forward and kept: functional/_recast.py)
            assert sorted(calls) == ["block_gemm_tn"] * 3 + ["quantize_blocks"] * 3, calls
        xi = x.clone().requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        with te.fp8_autocast(fp8_recipe=r):
            y = layer(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, layer.weight.grad))
    for name, got, want in zip(("y", "dx", "dw"), *results):
        assert got.abs().max() > 0
        assert_same_bits(got, want, name)


@pytest.fixture(autouse=True)
def _reload_env_after():
    yield
    _env.reload()
