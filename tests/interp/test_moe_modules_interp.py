"""GroupedLinear and te.MoE with every Triton kernel (interpreter) against the same modules on
the twins (TRITIUM_FORCE_REF=1): the grouped casts, the grouped GEMMs (forced on, as on an FP8
GPU), permute / unpermute and the router, forward and backward, under FP8 and not.
Tiny shapes; the GEMMs sum in another order, so fp32 rounding apart (casts see the same values).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import _env, recipe
from tritium.functional import grouped_linear as fgl

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _run(module, x, dy, fp8, **kw):
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.Float8CurrentScaling()):
        y = module(x, **kw)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_kernels_match_twins(fp8, monkeypatch, gen):
    # the GEMM kernels too
    monkeypatch.setattr(fgl, "_gemm_impl", lambda t, fast_accum: fgl._kernels())
    moe = te.MoE(32, 16, te.MoEConfig(num_experts=4, topk=2), normalization="RMSNorm",
                 device="cpu")
    twin = copy.deepcopy(moe)
    x, dy = torch.randn(10, 32, generator=gen), torch.randn(10, 32, generator=gen)
    got = _run(moe, x, dy, fp8)
    monkeypatch.setenv("TRITIUM_FORCE_REF", "1")
    monkeypatch.setattr(fgl, "_gemm_impl", lambda t, fast_accum: fgl.ref_grouped)
    _env.reload()
    want = _run(twin, x, dy, fp8)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
