"""The API around the modules that TE 2.x code calls: recipe predicates, FP8GlobalStateManager,
capability queries, `tritium.utils`, and the quantizer API round-tripping through Float8Tensor."""
from __future__ import annotations

import io
import math

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.recipe import Recipe

pytestmark = pytest.mark.cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PREDICATES = ("delayed", "float8_current_scaling", "float8_per_tensor_scaling",
              "float8_block_scaling", "mxfp8", "nvfp4", "custom")


# ---------------------------------------------------------------- recipes
@pytest.mark.parametrize("r, true", [
    (recipe.DelayedScaling(), {"delayed", "float8_per_tensor_scaling"}),
    (recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=4),
     {"delayed", "float8_per_tensor_scaling"}),
    (recipe.Float8CurrentScaling(), {"float8_current_scaling", "float8_per_tensor_scaling"}),
])
def test_recipe_predicates(r, true):
    assert isinstance(r, recipe.Recipe)
    for name in PREDICATES:
        assert getattr(r, name)() is (name in true), name


def test_predicates_follow_a_recipe_class_added_later():
    """A recipe class named as TE names it makes its predicate true with no other edit (how
    Float8BlockScaling / MXFP8BlockScaling join); the capability query follows the class."""
    from tritium.fp8 import recipe as rmod
    saved = dict(rmod._RECIPE_CLASSES)
    try:
        for name, predicate in (("MXFP8BlockScaling", "mxfp8"), ("CustomRecipe", "custom")):
            rmod._RECIPE_CLASSES.pop(name, None)
            r = type(name, (Recipe,), {})()
            assert getattr(r, predicate)() and not r.delayed() and not r.float8_block_scaling()
        assert te.is_mxfp8_available()
        rmod._RECIPE_CLASSES.pop("MXFP8BlockScaling")
        ok, reason = te.is_mxfp8_available(return_reason=True)
        assert not ok and "MXFP8BlockScaling" in reason
    finally:
        rmod._RECIPE_CLASSES.clear()
        rmod._RECIPE_CLASSES.update(saved)


def test_mmparams_qparams_and_current_scaling_fields():
    r = recipe.Float8CurrentScaling(power_2_scale=True, amax_epsilon=1e-3)
    assert r.fp8_gemm_fprop == recipe.MMParams(use_split_accumulator=False)
    assert r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == recipe.MMParams()
    assert r.fp8_quant_fwd_inp == r.fp8_quant_bwd_grad == recipe.QParams(True, 1e-3)
    with pytest.raises(NotImplementedError, match="fp8_gemm_fprop"):
        recipe.Float8CurrentScaling(fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=True))
    assert recipe.DelayedScaling(fp8_dpa=True).fp8_dpa
    assert recipe.DelayedScaling(fp8_mha=True).fp8_mha


def test_get_default_recipe():
    assert te.get_default_recipe() == recipe.DelayedScaling()
    assert te.quantization.get_default_recipe() == te.get_default_recipe()


# ---------------------------------------------------------------- FP8GlobalStateManager
def test_global_state_outside_and_inside_nested_autocasts():
    M = te.FP8GlobalStateManager
    from tritium.fp8 import FP8GlobalStateManager as M2
    assert M2 is M and te.quantization.FP8GlobalStateManager is M
    assert not M.is_fp8_enabled() and not M.is_fp8_calibration()
    assert M.get_fp8_recipe() == te.get_default_recipe() and M.get_fp8_group() is None
    assert not M.is_first_fp8_module() and not M.fp8_graph_capturing()
    outer, inner = recipe.Float8CurrentScaling(), recipe.DelayedScaling(amax_history_len=8)
    with te.fp8_autocast(enabled=True, fp8_recipe=outer):
        assert M.is_fp8_enabled() and M.get_fp8_recipe() is outer
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=inner):
            assert not M.is_fp8_enabled() and M.is_fp8_calibration()
            assert M.get_fp8_recipe() is inner
            assert M.is_first_fp8_module()       # once per outermost autocast ...
            saved = M.get_autocast_state()
        assert M.is_fp8_enabled() and not M.is_fp8_calibration() and M.get_fp8_recipe() is outer
        assert not M.is_first_fp8_module()       # ... then False
        M.set_autocast_state(saved)              # recompute helpers put a saved state back
        assert M.get_fp8_recipe() is inner and M.is_fp8_calibration()
        M.set_fp8_autocast_state(M.get_fp8_autocast_state())
    M.reset()
    assert not M.is_fp8_enabled() and M.get_fp8_recipe() == te.get_default_recipe()
    with te.fp8_autocast():
        assert M.is_first_fp8_module()           # a new outermost autocast: True again


def test_global_state_sees_modules_and_model_init():
    M = te.FP8GlobalStateManager
    assert not M.with_fp8_parameters()
    cs = recipe.Float8CurrentScaling()
    with te.fp8_model_init(enabled=True, recipe=cs, preserve_high_precision_init_val=True):
        assert M.with_fp8_parameters() and M.with_high_precision_init_val()
        assert M.get_fp8_recipe() is cs  # TE's model init sets the recipe too
        with te.fp8_model_init(enabled=False):
            assert not M.with_fp8_parameters()
    assert not M.with_fp8_parameters()
    with pytest.raises(NotImplementedError, match="global amax buffers"):
        M.reduce_and_update_fp8_tensors(forward=True)


def test_reset_after_an_exception_inside_autocast():
    M = te.FP8GlobalStateManager
    gen = te.fp8_autocast()
    gen.__enter__()          # a test that stopped inside an autocast leaves it open
    assert M.is_fp8_enabled()
    M.reset()
    assert not M.is_fp8_enabled()
    gen.__exit__(None, None, None)  # closing it later is harmless
    assert not M.is_fp8_enabled()


# ---------------------------------------------------------------- capabilities and utils
def test_capability_queries_signatures():
    for fn in (te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available,
               te.is_nvfp4_available, te.is_bf16_available):
        ok, reason = fn(return_reason=True)
        assert isinstance(ok, bool) and isinstance(reason, str)
        assert fn() is ok
    assert te.is_fp8_available()  # delayed / current scaling run everywhere (emulated on CPU)
    ok, reason = te.is_nvfp4_available(return_reason=True)
    assert not ok and "NVFP4" in reason
    assert te.FP8GlobalStateManager.is_fp8_available() == te.is_fp8_available(return_reason=True)
    cc, cudnn = te.get_device_compute_capability(), te.get_cudnn_version()
    assert len(cc) == 2 and len(cudnn) == 3
    if not torch.cuda.is_available():
        assert cc == (0, 0)
        assert "emulated" in te.is_fp8_available(return_reason=True)[1]
    assert te.utils.get_device_compute_capability() == cc


def test_cudnn_version_decoding(monkeypatch):
    from tritium import _device
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for raw, want in ((91002, (9, 10, 2)), (90100, (9, 1, 0)), (8907, (8, 9, 7))):
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda raw=raw: raw)
        assert _device.cudnn_version() == want


def test_init_methods_and_attention_mask_func():
    torch.manual_seed(0)
    w = torch.empty(400, 400)
    te.utils.init_method_normal(0.02)(w)
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    te.utils.scaled_init_method_normal(0.02, 8)(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(16)) < 0.0003
    with pytest.raises(ValueError, match="num_layers"):
        te.utils.scaled_init_method_normal(0.02, 0)
    scores = torch.randn(2, 3, 4, 4)
    mask = torch.rand(2, 1, 4, 4) > 0.5
    want = torch.where(mask, torch.tensor(-10000.0), scores)
    out = te.utils.attention_mask_func(scores, mask)
    assert out is scores and torch.equal(out, want)


@pytest.mark.parametrize("shape", [(8,), (8, 5)])
def test_glu_interleave_round_trip(shape):
    gate = torch.arange(shape[0] // 2 * math.prod(shape[1:]), dtype=torch.float32)
    w = torch.cat([gate, 1000 + gate]).reshape(shape)       # [gate; up]
    inter = te.interleave_glu_tensor(w, 2)
    half = shape[0] // 2
    want = torch.cat([w[0:2], w[half:half + 2], w[2:4], w[half + 2:half + 4]])
    assert torch.equal(inter, want)
    assert torch.equal(te.deinterleave_glu_tensor(inter, 2), w)
    assert torch.equal(te.utils.deinterleave_glu_tensor(te.interleave_glu_tensor(w, 1), 1), w)
    with pytest.raises(ValueError, match="multiple of"):
        te.interleave_glu_tensor(w, 3)
    with pytest.raises(ValueError, match="interleave_size"):
        te.deinterleave_glu_tensor(w, 0)


# ---------------------------------------------------------------- quantizers
def _fp8_ref(x, scale, fp8_dtype):
    limit = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2, te.DType.kFloat8E4M3])
def test_float8_quantizer_round_trip(fp8_dtype):
    torch.manual_seed(1)
    torch_dtype = fp8_dtype.to_torch_dtype() if isinstance(fp8_dtype, te.DType) else fp8_dtype
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16) * 3
    scale, amax = torch.tensor([20.0]), torch.zeros(1)
    q = te.Float8Quantizer(scale, amax, fp8_dtype)
    y = q(x)
    assert isinstance(y, te.Float8Tensor) and isinstance(y, te.QuantizedTensor)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and y._quantizer is q
    assert torch.equal(y._data.view(torch.uint8),
                       _fp8_ref(x, scale, torch_dtype).view(torch.uint8))
    assert torch.equal(amax, x.float().abs().amax().reshape(1))
    assert torch.equal(y._scale_inv, 1.0 / scale)
    # dequantize == fp8 value / scale, within the format's rounding of x
    rtol = 0.0625 if torch_dtype == E4M3 else 0.125
    torch.testing.assert_close(y.dequantize(torch.float32), x.float(), rtol=rtol, atol=1 / 20 / 8)
    # columnwise usage = the transpose of the data flattened to 2D
    assert torch.equal(y._transpose.view(torch.uint8), y._data.reshape(15, 32).t().view(torch.uint8))
    q.set_usage(columnwise=False)
    assert q.quantize(x)._transpose is None
    # requantize into it (quantize_ / copy_ / quantize(out=))
    x2 = torch.randn_like(x)
    y.quantize_(x2)
    assert torch.equal(y._data.view(torch.uint8), _fp8_ref(x2, scale, torch_dtype).view(torch.uint8))
    y.copy_(x)
    assert torch.equal(y._data.view(torch.uint8), _fp8_ref(x, scale, torch_dtype).view(torch.uint8))
    assert q.quantize(x2, out=y) is y
    assert torch.equal(y._transpose.view(torch.uint8), y._data.reshape(15, 32).t().view(torch.uint8))


def test_current_scaling_quantizer_round_trip():
    torch.manual_seed(2)
    x = torch.randn(16, 48) * 7
    q = te.Float8CurrentScalingQuantizer(E4M3, "cpu", force_pow_2_scales=False)
    y = q.quantize(x)
    amax = x.abs().amax()
    assert torch.equal(q.amax, amax.reshape(1))
    assert torch.equal(q.scale, (torch.tensor(448.0) / amax).reshape(1))
    assert torch.equal(y._data.view(torch.uint8), _fp8_ref(x, q.scale, E4M3).view(torch.uint8))
    torch.testing.assert_close(y.dequantize(), x, rtol=0.0625, atol=amax.item() / 448 / 8)
    # requantizing a smaller tensor takes its own scale (and the tensor keeps its own copy)
    y.quantize_(x / 100)
    assert torch.equal(y._scale, q.scale) and y._scale is not q.scale
    torch.testing.assert_close(y.dequantize(), x / 100, rtol=0.0625, atol=amax.item() / 448 / 800)
    p2 = te.Float8CurrentScalingQuantizer(E4M3, "cpu", force_pow_2_scales=True)
    p2(x)
    assert math.log2(p2.scale.item()).is_integer()


def test_quantizer_errors_and_make_empty():
    with pytest.raises(TypeError, match="fp8_dtype"):
        te.Float8Quantizer(torch.ones(1), torch.zeros(1), torch.bfloat16)
    with pytest.raises(TypeError, match="scale"):
        te.Float8Quantizer(torch.ones(2), torch.zeros(1), E4M3)
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E5M2, "cpu")
    with pytest.raises(NotImplementedError, match="rowwise"):
        q.set_usage(rowwise=False)
    e = q.make_empty((4, 32), dtype=torch.bfloat16)
    assert e.dtype == torch.bfloat16 and e._fp8_dtype == E5M2 and e._transpose.shape == (32, 4)
    x = torch.randn(4, 32)
    e.quantize_(x)
    torch.testing.assert_close(e.dequantize(torch.float32), x, rtol=0.125, atol=1e-2)
    e.update_usage(columnwise_usage=False)
    assert e._transpose is None
    e.update_usage(columnwise_usage=True)
    assert torch.equal(e._transpose.view(torch.uint8), e._data.t().view(torch.uint8))


def test_quantized_tensors_load_weights_only():
    torch.manual_seed(3)
    q = te.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1), te.DType.kFloat8E4M3)
    c = te.Float8CurrentScalingQuantizer(E5M2, "cpu")
    sd = {"a": q(torch.randn(8, 16)), "b": c(torch.randn(4, 16))}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    for k in sd:
        assert torch.equal(back[k].dequantize(), sd[k].dequantize())
        assert type(back[k]._quantizer) is type(sd[k]._quantizer)
