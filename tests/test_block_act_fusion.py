"""LayerNormMLP under Float8BlockScaling: the activation fused with fc2's 1x128 input casts
(`kernels.act_block_cast`, twin `ref.activation.activation_fwd_blocks`) vs the unfused chain
(activation in high precision, then the block Linear's own quantize_blocks).

Fused and unfused must agree bit for bit: outputs, input gradients and every parameter gradient
over 3 steps of fresh random data, several activations (gated and plain), token counts that are
not multiples of 128 (nor of 16), with and without fc1's bias (the backward's fused cast then
returns a zero-stride carrier instead of the high-precision gradient). The backward half (the
activation backward fused with fc1's 1x128 grad_output casts) is covered by the same runs.
Spies on the fused entry points prove which path ran.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8 import block as block_ops
from tritium.functional.fused_cast import fused_casts

from testlib import assert_bits

pytestmark = pytest.mark.cpu


@pytest.fixture
def spy(monkeypatch):
    """Records (fwd / bwd, columnwise[, write_hp]) per call of the fused entry points."""
    calls = []
    fwd, bwd = block_ops.activation_fwd_blocks, block_ops.activation_bwd_blocks

    def wrapped_fwd(*a, **k):
        calls.append(("fwd", k["columnwise"]))
        return fwd(*a, **k)

    def wrapped_bwd(*a, **k):
        calls.append(("bwd", k["columnwise"], k["write_hp"]))
        return bwd(*a, **k)
    monkeypatch.setattr(block_ops, "activation_fwd_blocks", wrapped_fwd)
    monkeypatch.setattr(block_ops, "activation_bwd_blocks", wrapped_bwd)
    return calls


def _run(module, fused, rec, shape, dtype, steps=3, grad=True):
    gen = torch.Generator().manual_seed(4321)
    record = []
    with fused_casts(fused):
        for step in range(steps):
            x = (torch.randn(shape, generator=gen) * (1 + step)).to(dtype).requires_grad_(grad)
            with torch.set_grad_enabled(grad), te.fp8_autocast(fp8_recipe=rec):
                y = module(x)
            record.append((f"step{step}.out", y.detach().clone()))
            if not grad:
                continue
            y.backward(torch.randn(y.shape, generator=gen).to(dtype))
            record.append((f"step{step}.dx", x.grad.clone()))
            for name, p in module.named_parameters():
                record.append((f"step{step}.d{name}", p.grad.clone()))
                p.grad = None
    return record


CASES = [("swiglu", torch.float32, (3, 47, 64), recipe.Float8BlockScaling()),
         ("gelu", torch.bfloat16, (141, 64), recipe.Float8BlockScaling()),
         ("srelu", torch.float32, (2, 9, 64), recipe.Float8BlockScaling(w_block_scaling_dim=1)),
         ("geglu", torch.bfloat16, (130, 64), recipe.Float8BlockScaling(
             fp8_quant_fwd_inp=recipe.QParams(power_2_scale=False, amax_epsilon=1e-3)))]


@pytest.mark.parametrize("activation,dtype,shape,rec", CASES, ids=lambda v: str(v)[:24])
def test_fused_activation_block_cast_equals_unfused(activation, dtype, shape, rec, spy):
    torch.manual_seed(0)
    bias = activation != "srelu"
    mlp = te.LayerNormMLP(64, 144, activation=activation, params_dtype=dtype, device="cpu",
                          bias=bias)
    unfused = copy.deepcopy(mlp)
    got = _run(mlp, True, rec, shape, dtype)
    # the fused paths ran every step: forward with columnwise blocks (fc2's wgrad), backward
    # with the high-precision grad only where fc1's bias needs it
    assert spy == [("fwd", True), ("bwd", True, bias)] * 3
    want = _run(unfused, False, rec, shape, dtype)
    assert len(spy) == 6      # and not with the fusion off
    assert [k for k, _ in got] == [k for k, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert_bits(g, w, name)
    assert any(g.abs().max() > 0 for name, g in got if name.endswith("dfc1_weight"))


def test_inference_fused_rowwise_only_and_checkpoint_unfused(spy):
    torch.manual_seed(0)
    rec = recipe.Float8BlockScaling()
    mlp = te.LayerNormMLP(64, 144, activation="swiglu", device="cpu")
    got = _run(mlp, True, rec, (37, 64), torch.float32, steps=1, grad=False)
    assert spy == [("fwd", False)]   # no grad: no columnwise blocks, no backward
    want = _run(mlp, False, rec, (37, 64), torch.float32, steps=1, grad=False)
    assert_bits(got[0][1], want[0][1], "no-grad output")
    ckpt = te.LayerNormMLP(64, 144, activation="swiglu", device="cpu", checkpoint=True)
    _run(ckpt, True, rec, (37, 64), torch.float32, steps=1)
    assert len(spy) == 1  # checkpoint=True keeps the unfused chain
    _run(mlp, True, recipe.MXFP8BlockScaling(), (37, 64), torch.float32, steps=1)
    assert len(spy) == 1  # MXFP8 is not fused


def test_pre_quantized_input_of_the_wrong_form_is_refused():
    from tritium.functional.fused_cast import block_carrier
    from tritium.ref.block_cast import quantize_blocks

    layer = te.Linear(64, 32, device="cpu")
    bq = quantize_blocks(torch.randn(48, 64), torch.float8_e5m2, columnwise=True)
    carrier = block_carrier(bq, (40, 64), torch.float32)  # 40 tokens pad to 48, but e5m2
    with pytest.raises(ValueError, match=r"pre-quantized input must hold 1x128 .*e4m3fn"):
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
            layer(carrier)
