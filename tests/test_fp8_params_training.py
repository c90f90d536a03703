"""cpu tier: FP8 params (modules built under fp8_model_init) trained by FusedAdam with master
weights, the issue's end-to-end contract.

  * after every step each FP8 weight's data is exactly the clamped E4M3 cast of master * scale
    (the scale the step read: the module's forward slot), scale_inv is exactly 1/scale, the
    transpose is the data's transpose, and the amax of the new master is in history row 0;
  * the master starts from the kept high-precision init with preserve_high_precision_init_val;
  * a small model (two LayerNormMLP blocks and a Linear head, RMSNorm, swiglu) trains 50 steps
    under fp8_autocast with FP8 params to the same final loss as with bf16 params (within 1%
    relative), from the same initial values and batches.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.optimizers import FusedAdam

pytestmark = pytest.mark.cpu

RECIPE = recipe.DelayedScaling(amax_history_len=8)
H, F, OUT = 64, 96, 16


def _bits(t):
    return t.contiguous().view(torch.uint8)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(normalization="RMSNorm", activation="swiglu", bias=False, device="cpu",
                  params_dtype=torch.bfloat16)
        self.blocks = torch.nn.ModuleList([te.LayerNormMLP(H, F, **kw) for _ in range(2)])
        self.head = te.Linear(H, OUT, bias=False, device="cpu", params_dtype=torch.bfloat16)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _fp8_weights(model):
    return [p for p in model.parameters() if isinstance(p, te.Float8Tensor)]


def test_fp8_param_data_is_the_cast_of_its_master(randn):
    with te.fp8_model_init(enabled=True, recipe=RECIPE, preserve_high_precision_init_val=True):
        model = Model()
    weights = _fp8_weights(model)
    assert len(weights) == 5
    inits = [w.get_high_precision_init_val().float() for w in weights]
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    for step in range(3):
        x, y = randn(24, H).to(torch.bfloat16), randn(24, OUT)
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for i, w in enumerate(weights):
            master = opt.get_master_param(w)
            if step == 0:  # the first master came from the kept init, then moved by one step
                assert (master - inits[i]).abs().max() < 0.05
            scale = w._scale
            expect = (master * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(_bits(w._data), _bits(expect)), f"step {step} weight {i}"
            assert torch.equal(w._scale_inv, 1.0 / scale)
            assert torch.equal(_bits(w._transpose), _bits(w._data.t()))
            assert torch.equal(w._amax, master.abs().max().reshape(1))


def _train(fp8_params: bool, init_state, batches):
    with te.fp8_model_init(enabled=fp8_params, recipe=RECIPE, preserve_high_precision_init_val=True):
        model = Model()
    fp8 = {id(p) for p in _fp8_weights(model)}
    opt = FusedAdam(model.parameters(), lr=3e-3, master_weights=True)
    for name, p in model.named_parameters():
        opt.set_master_param(p, init_state[name])  # same fp32 start for both runs
    losses = []
    for x, y in batches:
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert len(fp8) == (5 if fp8_params else 0)
    return losses


def test_fp8_params_train_like_bf16_params(randn):
    torch.manual_seed(0)
    reference = Model()
    init_state = {n: p.detach().float().clone() for n, p in reference.named_parameters()}
    teacher = randn(H, OUT, scale=H ** -0.5)
    batches = []
    for _ in range(50):
        x = randn(32, H)
        batches.append((x.to(torch.bfloat16), torch.tanh(x @ teacher)))
    bf16 = _train(False, init_state, batches)
    fp8 = _train(True, init_state, batches)
    final_bf16, final_fp8 = sum(bf16[-5:]) / 5, sum(fp8[-5:]) / 5
    assert final_bf16 < 0.5 * bf16[0]  # it did learn
    assert abs(final_fp8 - final_bf16) <= 0.01 * final_bf16, (final_bf16, final_fp8)
