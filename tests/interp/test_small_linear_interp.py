"""A small FP8 Linear / LayerNormMLP on the one-launch GEMM forms (`tritium.kernels.small_gemm`)
equals the same step on separate casts and GEMMs, bit for bit, under the interpreter.

On a GPU those forms run where every GEMM is small (`ops.gemm.HOST_BOUND_MACS`): the forward
casts its high-precision operands inside the GEMM's launch, the backward casts dy inside
dgrad + wgrad's. Here the CPU takes the CUDA path (`_device.fp8_tensor_cores` patched True:
the Triton kernels run in the interpreter) once with them and once without
(`FP8Plan.casts_weight_in_gemm` False, the backward's one-launch call None), under delayed and
current scaling: outputs, every gradient and the FP8 state after two steps must be the same.
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

import tritium as te
from tritium import _device, recipe
from tritium.kernels import small_gemm as ksmall

from ._helpers import assert_same_bits

flinear = importlib.import_module("tritium.functional.linear")  # the package exports linear()

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling}
MODULES = {"Linear": lambda: te.Linear(48, 32, bias=True, params_dtype=torch.bfloat16,
                                       device="cpu"),
           "LayerNormMLP": lambda: te.LayerNormMLP(32, 48, normalization="RMSNorm",
                                                   activation="swiglu", bias=False,
                                                   params_dtype=torch.bfloat16, device="cpu")}


def _steps(module, x, dy, rec):
    outs = []
    for _ in range(2):
        for p in [*module.parameters(), x]:
            p.grad = None
        with te.fp8_autocast(fp8_recipe=rec):
            out = module(x)
        out.backward(dy)
        outs += [out.detach(), x.grad, *(p.grad for p in module.parameters())]
    return outs


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("kind", MODULES)
def test_one_launch_forms_equal_separate_casts_and_gemms(monkeypatch, scaling, kind):
    monkeypatch.setattr(_device, "fp8_tensor_cores", lambda t: True)
    calls = []
    for name in ("fp8_gemm_tn_cast_ab", "fp8_gemm_tn_cast_b", "fp8_dgrad_wgrad"):
        real = getattr(ksmall, name)
        monkeypatch.setattr(ksmall, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    torch.manual_seed(0)
    fused = MODULES[kind]()
    if kind == "LayerNormMLP":
        with torch.no_grad():
            fused.layer_norm_weight.normal_(1.0, 0.2)
    separate = copy.deepcopy(fused)
    in_features = 32 if kind == "LayerNormMLP" else 48  # both: 32 out
    x = torch.randn(40, in_features, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(40, 32, dtype=torch.bfloat16)
    got = _steps(fused, x, dy, RECIPES[scaling]())
    assert calls and "fp8_dgrad_wgrad" in calls, "the one-launch forms ran"
    calls.clear()
    monkeypatch.setattr(flinear.FP8Plan, "casts_weight_in_gemm", lambda *a: False)
    monkeypatch.setattr(flinear, "fp8_dgrad_wgrad_on_one_launch", lambda *a, **k: None)
    want = _steps(separate, x, dy, RECIPES[scaling]())
    assert calls == []
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.abs().max() > 0
        assert_same_bits(g, w, f"result {i}")
    if scaling == "delayed":
        for name in ("fwd", "bwd"):
            a, b = (getattr(m.fp8_meta, name) for m in (fused, separate))
            assert a.amax_history.abs().max() > 0
            assert_same_bits(a.amax_history, b.amax_history, f"{name} amax history")
            assert_same_bits(a.scale, b.scale, f"{name} scale")
