"""LayerNormLinear and LayerNormMLP under Float8BlockScaling: the norm fused with the first
GEMM's 1x128 input casts (`kernels.norm_block_cast`, twins `ref.norm.*_fwd_blocks`) vs the
unfused chain (the norm in high precision, then the block Linear's own quantize_blocks).

Fused and unfused must agree bit for bit: outputs, input gradients and every parameter gradient
over 3 steps of fresh random data, both modules, both norms, zero_centered_gamma, token counts
that are not multiples of 128 (nor of 16), hidden 192 (two 1x128 blocks a row, one partial),
return_layernorm_output (the high-precision output comes back too, and its gradient adds to the
GEMM's). Spies on the fused entry point prove which path ran, and that the skips hold
(fused_casts(False), checkpoint=True, MXFP8, no grad -> rowwise only).
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

H = 192


@pytest.fixture
def spy(monkeypatch):
    """Records (is_rms, columnwise, write_hp) per call of the fused norm entry point."""
    calls = []
    fwd = block_ops.norm_fwd_blocks

    def wrapped(x, weight, bias, eps, zc, is_rms, fp8_dtype, **k):
        calls.append((is_rms, k["columnwise"], k["write_hp"]))
        return fwd(x, weight, bias, eps, zc, is_rms, fp8_dtype, **k)
    monkeypatch.setattr(block_ops, "norm_fwd_blocks", wrapped)
    return calls


def _run(module, fused, rec, shape, dtype, steps=3, grad=True):
    gen = torch.Generator().manual_seed(1234)
    record = []
    with fused_casts(fused):
        for step in range(steps):
            x = (torch.randn(shape, generator=gen) * (1 + step) + 0.3).to(dtype)
            x.requires_grad_(grad)
            with torch.set_grad_enabled(grad), te.fp8_autocast(fp8_recipe=rec):
                out = module(x)
            outs = out if isinstance(out, tuple) else (out,)
            for i, o in enumerate(outs):
                record.append((f"step{step}.out{i}", o.detach().clone()))
            if not grad:
                continue
            loss = sum((o * torch.randn(o.shape, generator=gen).to(dtype)).sum() for o in outs)
            loss.backward()
            record.append((f"step{step}.dx", x.grad.clone()))
            for name, p in module.named_parameters():
                record.append((f"step{step}.d{name}", p.grad.clone()))
                p.grad = None
    return record


def _perturb(module, gen):
    with torch.no_grad():  # non-trivial norm parameters
        module.layer_norm_weight.add_(torch.randn(H, generator=gen).to(module.layer_norm_weight))
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.add_(torch.randn(H, generator=gen).to(module.layer_norm_bias))


# (module, normalization, zero_centered_gamma, return_layernorm_output, dtype, shape, recipe)
CASES = [("LayerNormLinear", "LayerNorm", False, False, torch.bfloat16, (141, H),
          recipe.Float8BlockScaling()),
         ("LayerNormLinear", "RMSNorm", True, True, torch.float32, (3, 47, H),
          recipe.Float8BlockScaling(w_block_scaling_dim=1)),
         ("LayerNormMLP", "RMSNorm", False, False, torch.bfloat16, (130, H),
          recipe.Float8BlockScaling()),
         ("LayerNormMLP", "LayerNorm", True, True, torch.float32, (2, 9, H),
          recipe.Float8BlockScaling(
              fp8_quant_fwd_inp=recipe.QParams(power_2_scale=False, amax_epsilon=1e-3)))]


def _make(kind, norm, zc, ret_ln, dtype):
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(H, 80, normalization=norm, zero_centered_gamma=zc,
                                  return_layernorm_output=ret_ln, params_dtype=dtype,
                                  device="cpu")
    return te.LayerNormMLP(H, 144, normalization=norm, zero_centered_gamma=zc,
                           return_layernorm_output=ret_ln, activation="swiglu",
                           params_dtype=dtype, device="cpu")


@pytest.mark.parametrize("kind,norm,zc,ret_ln,dtype,shape,rec", CASES, ids=lambda v: str(v)[:20])
def test_fused_norm_block_cast_equals_unfused(kind, norm, zc, ret_ln, dtype, shape, rec, spy):
    torch.manual_seed(0)
    module = _make(kind, norm, zc, ret_ln, dtype)
    _perturb(module, torch.Generator().manual_seed(7))
    unfused = copy.deepcopy(module)
    got = _run(module, True, rec, shape, dtype)
    assert spy == [(norm == "RMSNorm", True, ret_ln)] * 3  # the fused norm ran every step
    want = _run(unfused, False, rec, shape, dtype)
    assert len(spy) == 3      # and not with the fusion off
    assert [k for k, _ in got] == [k for k, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert_bits(g, w, name)
    assert any(g.abs().max() > 0 for name, g in got if name.endswith("dlayer_norm_weight"))


def test_fused_norm_skips(spy):
    torch.manual_seed(0)
    rec = recipe.Float8BlockScaling()
    lnl = te.LayerNormLinear(H, 64, device="cpu")
    got = _run(lnl, True, rec, (37, H), torch.float32, steps=1, grad=False)
    assert spy == [(False, False, False)]   # no grad: rowwise blocks only
    want = _run(lnl, False, rec, (37, H), torch.float32, steps=1, grad=False)
    assert_bits(got[0][1], want[0][1], "no-grad output")
    ckpt = te.LayerNormMLP(H, 144, device="cpu", checkpoint=True)
    _run(ckpt, True, rec, (37, H), torch.float32, steps=1)
    assert len(spy) == 1  # checkpoint=True keeps the unfused norm
    _run(lnl, True, recipe.MXFP8BlockScaling(), (37, H), torch.float32, steps=1)
    _run(lnl, True, recipe.DelayedScaling(), (37, H), torch.float32, steps=1)
    assert len(spy) == 1  # MXFP8 and tensorwise recipes do not take this path
