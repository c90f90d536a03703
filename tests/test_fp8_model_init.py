"""cpu tier: fp8_model_init / quantized_model_init (FP8 params) in Linear, LayerNormLinear and
LayerNormMLP.

What must hold: the GEMM weights become Float8Tensor Parameters whose fp8 data is exactly the
clamped cast of the initial value times the first scale (fp8_max / amax of that value), with
scale_inv the exactly rounded 1/scale; each param is tied to its module's forward slot (`_scale`
and `_amax` are views of the live state, relinked when the state is replaced); forward and
backward under fp8_autocast match the independent FP8 emulation in testlib fed the FP8 weight's
own values; checkpoints round-trip through torch.load(weights_only=True) bit for bit; the
unsupported combinations raise.
"""
from __future__ import annotations

import io

import pytest
import torch

import tritium as te
from tritium import recipe

from testlib import BF16_TOL, E4M3, E5M2, FP8_MAX, emulated_linear

pytestmark = pytest.mark.cpu

DELAYED = recipe.DelayedScaling(amax_history_len=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _linear(dtype=torch.bfloat16, preserve=False, **kwargs):
    with te.fp8_model_init(enabled=True, recipe=DELAYED, preserve_high_precision_init_val=preserve):
        return te.Linear(64, 48, device="cpu", params_dtype=dtype, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_fp8_with_first_scale_from_their_amax(dtype):
    layer = _linear(dtype, preserve=True)
    w = layer.weight
    assert isinstance(w, te.Float8Tensor) and isinstance(w, torch.nn.Parameter)
    assert w.requires_grad and w.dtype == dtype and w._data.dtype == E4M3
    assert layer.primary_weights_in_fp8 and not isinstance(layer.bias, te.Float8Tensor)
    init = w.get_high_precision_init_val()
    assert init is not None and init.device.type == "cpu" and init.dtype == dtype
    amax = init.abs().max().float()
    scale = torch.tensor(FP8_MAX[E4M3], dtype=torch.float32) / amax
    state = layer.fp8_meta.fwd
    assert torch.equal(state.scale[1:2], scale.reshape(1))
    assert torch.equal(state.amax_history[0, 1:2], amax.reshape(1))
    expect = (init.float() * scale).clamp(-448, 448).to(E4M3)
    assert torch.equal(_bits(w._data), _bits(expect))
    assert torch.equal(_bits(w._transpose), _bits(expect.t().contiguous()))
    assert torch.equal(w._scale_inv, (1.0 / scale).reshape(1))
    # tied to the live state: views, not copies
    assert w._scale.data_ptr() == state.scale[1:2].data_ptr()
    assert w._amax.data_ptr() == state.amax_history[0, 1:2].data_ptr()
    w.clear_high_precision_init_val()
    assert w.get_high_precision_init_val() is None


def test_disabled_builds_plain_params():
    with te.fp8_model_init(enabled=False):
        layer = te.Linear(32, 16, device="cpu")
    assert type(layer.weight) is torch.nn.Parameter and not layer.primary_weights_in_fp8


@pytest.mark.parametrize("use_bias", [True, False])
def test_forward_backward_match_emulation(randn, use_bias):
    layer = _linear(torch.bfloat16, bias=use_bias)
    with torch.no_grad():
        if use_bias:
            layer.bias.normal_()
    w_values = layer.weight.dequantize(torch.float32)
    x = randn(3, 11, 64).to(torch.bfloat16).requires_grad_()
    dy = randn(3, 11, 48).to(torch.bfloat16)
    with te.fp8_autocast(enabled=True, fp8_recipe=DELAYED):
        y = layer(x)
    y.backward(dy)
    # first step: input and grad scales are 1; the weight's values are its fp8 values exactly
    ref_y, ref_dx, ref_dw, ref_db = emulated_linear(x.detach(), w_values, layer.bias, dy,
                                                    1.0, 1.0 / layer.weight._scale_inv, 1.0,
                                                    E4M3, E5M2)
    torch.testing.assert_close(y.float(), ref_y, **BF16_TOL)
    torch.testing.assert_close(x.grad.float(), ref_dx, **BF16_TOL)
    grad = layer.weight.grad
    assert type(grad) is torch.Tensor and grad.dtype == torch.bfloat16 and grad.shape == (48, 64)
    torch.testing.assert_close(grad.float(), ref_dw, **BF16_TOL)
    if use_bias:
        torch.testing.assert_close(layer.bias.grad.float(), ref_db, **BF16_TOL)


def test_outside_autocast_uses_the_fp8_values(randn):
    layer = _linear(torch.float32)
    x = randn(5, 64, requires_grad=True)
    y = layer(x)
    expect = x @ layer.weight.dequantize().t() + layer.bias
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
    dy = randn(5, 48)
    y.backward(dy)
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x.detach(), rtol=1e-5, atol=1e-5)


def test_weight_slot_rolls_only_when_new_data_was_written(randn):
    layer = _linear()
    state = layer.fp8_meta.fwd
    init_amax = state.amax_history[0, 1].clone()
    x = randn(16, 64).to(torch.bfloat16)
    with te.fp8_autocast(enabled=True, fp8_recipe=DELAYED):
        layer(x).sum().backward()
    assert state.amax_history[-1, 1] == init_amax and state.amax_history[0, 1] == 0
    scale_after_first = state.scale[1].clone()
    with te.fp8_autocast(enabled=True, fp8_recipe=DELAYED):  # nothing rewrote the weight
        layer(x).sum().backward()
    assert state.amax_history[-1, 1] == init_amax and state.scale[1] == scale_after_first


def test_relinked_when_the_recipe_changes_the_history(randn):
    layer = _linear()
    longer = recipe.DelayedScaling(amax_history_len=8)
    with te.fp8_autocast(enabled=True, fp8_recipe=longer):
        layer(randn(16, 64).to(torch.bfloat16))
    state = layer.fp8_meta.fwd
    assert state.amax_history.shape[0] == 8
    assert layer.weight._amax.data_ptr() == state.amax_history[0, 1:2].data_ptr()
    assert layer.weight._scale.data_ptr() == state.scale[1:2].data_ptr()


def test_layernorm_modules_hold_fp8_weights(randn):
    with te.quantized_model_init(enabled=True, recipe=DELAYED):
        mlp = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu", bias=False,
                              device="cpu", params_dtype=torch.bfloat16)
        lnl = te.LayerNormLinear(64, 32, device="cpu", params_dtype=torch.bfloat16)
    assert isinstance(mlp.fc1_weight, te.Float8Tensor) and isinstance(mlp.fc2_weight, te.Float8Tensor)
    assert not isinstance(mlp.layer_norm_weight, te.Float8Tensor)
    assert isinstance(lnl.weight, te.Float8Tensor)
    fwd = mlp.fp8_meta.fwd
    assert mlp.fc1_weight._scale.data_ptr() == fwd.scale[1:2].data_ptr()
    assert mlp.fc2_weight._scale.data_ptr() == fwd.scale[3:4].data_ptr()
    x = randn(2, 8, 64).to(torch.bfloat16).requires_grad_()
    with te.fp8_autocast(enabled=True, fp8_recipe=DELAYED):
        out = mlp(x) + lnl(x).sum(-1, keepdim=True)
    out.float().pow(2).mean().backward()
    for p in (mlp.fc1_weight, mlp.fc2_weight, lnl.weight, mlp.layer_norm_weight):
        assert p.grad is not None and torch.isfinite(p.grad.float()).all() and p.grad.abs().sum() > 0


def test_checkpoint_round_trip_weights_only(randn):
    layer = _linear()
    with te.fp8_autocast(enabled=True, fp8_recipe=DELAYED):
        layer(randn(16, 64).to(torch.bfloat16)).sum().backward()
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = _linear()
    fresh.load_state_dict(loaded)
    for name in ("_data", "_transpose"):
        assert torch.equal(_bits(getattr(fresh.weight, name)), _bits(getattr(layer.weight, name)))
    assert torch.equal(fresh.weight._scale_inv, layer.weight._scale_inv)
    assert torch.equal(fresh.fp8_meta.fwd.scale, layer.fp8_meta.fwd.scale)
    assert torch.equal(fresh.fp8_meta.fwd.amax_history, layer.fp8_meta.fwd.amax_history)
    assert fresh.weight._scale.data_ptr() == fresh.fp8_meta.fwd.scale[1:2].data_ptr()
    assert torch.equal(fresh.bias, layer.bias)


def test_reset_parameters_requantizes(randn):
    layer = _linear()
    old = layer.weight
    torch.manual_seed(1234)
    layer.reset_parameters()
    assert isinstance(layer.weight, te.Float8Tensor) and layer.weight is not old
    assert not torch.equal(_bits(layer.weight._data), _bits(old._data))


def test_unsupported_combinations_raise():
    with pytest.raises(NotImplementedError, match="Float8CurrentScaling"):
        with te.fp8_model_init(enabled=True, recipe=recipe.Recipe()):
            pass
    with pytest.raises(NotImplementedError, match="parameters_split"):
        with te.fp8_model_init(enabled=True):
            te.Linear(32, 32, device="cpu", parameters_split=("query", "key"))


@pytest.mark.parametrize("rcp", [DELAYED, recipe.Float8CurrentScaling(),
                                 recipe.Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_loaded_weights_drop_the_kept_init(rcp):
    """preserve_high_precision_init_val keeps each FP8 weight's init for the optimizer's master;
    a state dict loaded afterwards replaces it: the master starts from the loaded weight, and a
    step that leaves the master as it is (zero grads) keeps the loaded fp8 values."""
    from tritium.optimizers import FusedAdam
    torch.manual_seed(0)
    with te.fp8_model_init(recipe=rcp, preserve_high_precision_init_val=True):
        src = te.Linear(256, 128, device="cpu")
        dst = te.Linear(256, 128, device="cpu")
    assert dst.weight.get_high_precision_init_val() is not None
    dst.load_state_dict(src.state_dict())
    assert dst.weight.get_high_precision_init_val() is None
    assert src.weight.get_high_precision_init_val() is not None   # the source keeps its own
    loaded = dst.weight.dequantize(torch.float32)
    assert not torch.equal(loaded, src.weight.get_high_precision_init_val())  # fp8-rounded
    opt = FusedAdam(dst.parameters(), lr=1e-3, master_weights=True)
    for p in dst.parameters():
        p.grad = torch.zeros(p.shape)
    opt.step()
    assert torch.equal(opt.get_master_param(dst.weight), loaded)
    assert torch.equal(dst.weight.dequantize(torch.float32), loaded)
