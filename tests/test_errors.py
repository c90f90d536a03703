"""Clear errors, raised early: bad inputs to Linear (type, dtype, device, last dim), feature
sizes that FP8 GEMMs cannot take (before any cast or GEMM, and without disturbing the autocast
region), bad fp8_autocast arguments, unsupported options; and the torch.autocast path working."""
from __future__ import annotations

import importlib

import pytest
import torch

import tritium as te
from testlib import BF16_TOL, E4M3, E5M2, FP8_TOL, emulated_linear
from tritium import recipe
from tritium.functional.gemm import check_fp8_gemm_operands

pytestmark = pytest.mark.cpu

# The module (tritium.functional re-exports the function `linear` under the same name).
fl = importlib.import_module("tritium.functional.linear")
fplan = importlib.import_module("tritium.functional.fp8_plan")  # where the casts are made


def test_wrong_input_dtype(randn):
    lin = te.Linear(32, 16, device="cpu")
    with pytest.raises(TypeError, match="float64"):
        lin(randn(4, 32).double())
    with pytest.raises(TypeError, match="int64"):
        lin(torch.arange(4 * 32).reshape(4, 32))
    with pytest.raises(TypeError, match="params_dtype"):
        lin(randn(4, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        lin([[1.0] * 32])


def test_device_mismatch(randn):
    lin = te.Linear(32, 16, device="cpu")
    with pytest.raises(ValueError, match="meta.*cpu"):
        lin(torch.empty(4, 32, device="meta"))
    meta_lin = te.Linear(32, 16, device="meta")
    assert meta_lin.weight.device.type == "meta"
    with pytest.raises(ValueError, match="cpu.*meta"):
        meta_lin(randn(4, 32))


def test_wrong_last_dim(randn):
    lin = te.Linear(32, 16, device="cpu")
    with pytest.raises(ValueError, match=r"\(4, 31\).*in_features=32"):
        lin(randn(4, 31))
    with pytest.raises(ValueError, match="in_features=32"):
        lin(randn(32, 4))


@pytest.mark.parametrize("in_f, out_f, bad, pad_to", [(40, 32, "in_features=40", 48),
                                                      (32, 20, "out_features=20", 32)])
@pytest.mark.parametrize("rcp", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_feature_sizes_must_be_multiples_of_16(randn, monkeypatch, in_f, out_f, bad,
                                                   pad_to, rcp):
    lin = te.Linear(in_f, out_f, device="cpu")
    calls = []
    x = randn(5, in_f, requires_grad=True)
    with monkeypatch.context() as m:
        m.setattr(fl, "fp8_gemm_tn", lambda *a, **k: calls.append("gemm"))
        m.setattr(fplan, "quantize_2d", lambda *a, **k: calls.append("cast"))
        m.setattr(fplan, "quantize_pair", lambda *a, **k: calls.append("cast"))
        with pytest.raises(ValueError) as info:
            with te.fp8_autocast(fp8_recipe=rcp):
                lin(x)
    msg = str(info.value)
    assert bad in msg and "divisible by 16" in msg and str(pad_to) in msg
    assert calls == []
    fwd = lin.fp8_meta.fwd
    assert fwd is None or not bool(fwd.amax_history.any())
    # The same module runs in high precision and under calibration.
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    with te.fp8_autocast(enabled=False, calibrating=True):
        lin(x)


def test_feature_size_error_leaves_the_region_working(randn):
    """A module that refuses FP8 must not become the region's 'first module' (which runs the
    backward update): the modules after it still get their backward scales updated."""
    bad, good = te.Linear(40, 32, device="cpu"), te.Linear(32, 16, device="cpu")
    x = randn(5, 32, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        with pytest.raises(ValueError):
            bad(randn(5, 40))
        y = good(x)
    dy = randn(5, 16)
    y.backward(dy)
    expect = torch.tensor(57344.0) / dy.abs().max()
    assert good.fp8_meta.bwd.scale.item() == expect.item()


def test_bad_fp8_recipe_type():
    for bad in ("delayed", {"margin": 0}, recipe.Format.HYBRID):
        with pytest.raises(TypeError, match="fp8_recipe"):
            with te.fp8_autocast(fp8_recipe=bad):
                pass
    with pytest.raises(TypeError, match="fp8_recipe"):
        with te.autocast(recipe=object()):
            pass


def test_bad_fp8_group_type():
    for bad in (1, "world", [0, 1]):
        with pytest.raises(TypeError, match="fp8_group"):
            with te.fp8_autocast(fp8_group=bad):
                pass


def test_te_autocast_alias(randn):
    lin = te.Linear(32, 16, device="cpu")
    with te.autocast(recipe=recipe.DelayedScaling(margin=1, amax_history_len=2)):
        lin(randn(5, 32, requires_grad=True))
    assert lin.fp8_meta.recipe == recipe.DelayedScaling(margin=1, amax_history_len=2)
    assert lin.fp8_meta.fwd.scale[0].item() != 1.0


def test_unsupported_options(randn):
    # tensor parallelism without torch.distributed: a clear error at the first forward
    lin = te.Linear(32, 16, tp_size=2, parallel_mode="column", device="cpu")
    assert tuple(lin.weight.shape) == (8, 32)
    with pytest.raises(RuntimeError, match="tp_size=2 needs torch.distributed"):
        lin(randn(4, 32))
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        te.Linear(32, 16, tp_size=0, device="cpu")
    for kw in (dict(in_features=0), dict(out_features=True), dict(in_features=3.0)):
        args = dict(in_features=32, out_features=16, device="cpu") | kw
        with pytest.raises(ValueError, match=next(iter(kw))):
            te.Linear(**args)
    with pytest.raises(TypeError, match="params_dtype"):
        te.Linear(32, 16, params_dtype=torch.int32, device="cpu")


def test_gemm_rules():
    a = torch.zeros(16, 32).to(E5M2)
    with pytest.raises(TypeError, match="e5m2 by e5m2"):
        check_fp8_gemm_operands(a, torch.zeros(16, 32).to(E5M2))
    with pytest.raises(ValueError, match="divisible by 16"):
        check_fp8_gemm_operands(torch.zeros(8, 32).to(E4M3), torch.zeros(16, 32).to(E4M3))


def test_torch_autocast_high_precision(randn):
    lin = te.Linear(32, 16, device="cpu")
    with torch.no_grad():
        lin.bias.copy_(randn(16))
    ref = torch.nn.Linear(32, 16)
    ref.load_state_dict({"weight": lin.weight.detach(), "bias": lin.bias.detach()})
    x = randn(3, 5, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = lin(x), ref(xr)
        lin(randn(4, 32, dtype=torch.bfloat16))      # bf16 input into fp32 params: allowed here
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(y, yr, **BF16_TOL)
    dy = randn(3, 5, 16, dtype=torch.bfloat16)
    y.backward(dy)
    yr.backward(dy)
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xr.grad, **BF16_TOL)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **BF16_TOL)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **BF16_TOL)


def test_torch_autocast_with_fp8(randn):
    lin = te.Linear(32, 16, device="cpu")
    rcp = recipe.Float8CurrentScaling()
    x = randn(3, 5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.fp8_autocast(fp8_recipe=rcp):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    dy = randn(3, 5, 16, dtype=torch.bfloat16)
    y.backward(dy)
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    xb = x.detach().to(torch.bfloat16).float()        # the input is cast to bf16, then to fp8
    w = lin.weight.detach()
    scales = [torch.tensor(448.0) / xb.abs().max(), torch.tensor(448.0) / w.abs().max(),
              torch.tensor(57344.0) / dy.float().abs().max()]
    out, dx, dw, _ = emulated_linear(xb, w, lin.bias.detach(), dy.float(), *scales, E4M3, E5M2)
    torch.testing.assert_close(y.float(), out, **FP8_TOL)
    torch.testing.assert_close(x.grad, dx, **FP8_TOL)
    torch.testing.assert_close(lin.weight.grad, dw, **FP8_TOL)


def test_second_backward_through_fp8_linear_is_a_clear_error():
    lin = te.Linear(32, 16, device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    with te.fp8_autocast():
        y = lin(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.sum().backward()


def test_unknown_fp8_gemm_choice_names_the_variable(setenv):
    with pytest.raises(ValueError, match="TRITIUM_FP8_GEMM='cutlass': use auto, triton or cublas"):
        setenv("TRITIUM_FP8_GEMM", "cutlass")
    setenv("TRITIUM_FP8_GEMM", "cublas")
    from tritium import _env
    assert _env.fp8_gemm() == "cublas"
    setenv("TRITIUM_FP8_GEMM", "auto")
