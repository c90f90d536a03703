"""cpu tier: fp8_model_init / quantized_model_init under Float8CurrentScaling.

What must hold: each GEMM weight is a Float8Tensor that owns its scale (not a view of the
module's delayed-scaling state), first taken from its own amax (fp8_max / amax); after every
FusedAdam step the scale is the current scale of the NEW master (amax_epsilon / power-of-2 rules
included) and the fp8 data is exactly the clamped cast of master * scale, with its transpose;
a small model with such weights trains under fp8_autocast(Float8CurrentScaling) like the same
model with bf16 weights (final loss within 2%); the state dict loads with weights_only=True.
"""
from __future__ import annotations

import io

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.optimizers import FusedAdam

pytestmark = pytest.mark.cpu

H, F, OUT = 32, 64, 16
E4M3 = torch.float8_e4m3fn


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _current_scale(master, eps=0.0, pow2=False):
    amax = master.abs().max().clamp_min(eps)
    s = torch.tensor(448.0) / amax
    if pow2:
        s = torch.tensor(2.0) ** torch.floor(torch.log2(s))
    return s.reshape(1)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(bias=False, device="cpu", params_dtype=torch.bfloat16)
        self.mlp = te.LayerNormMLP(H, F, normalization="RMSNorm", activation="swiglu", **kw)
        self.head = te.Linear(H, OUT, **kw)

    def forward(self, x):
        return self.head(x + self.mlp(x))


def test_weights_own_their_scale_from_their_amax():
    r = recipe.Float8CurrentScaling(power_2_scale=True)
    with te.quantized_model_init(enabled=True, recipe=r, preserve_high_precision_init_val=True):
        layer = te.Linear(64, 48, device="cpu", params_dtype=torch.bfloat16)
    w = layer.weight
    assert isinstance(w, te.Float8Tensor) and w._data.dtype == E4M3 and layer.primary_weights_in_fp8
    assert w._current_scaling == (0.0, True) and getattr(w, "_amax", None) is None
    assert layer.fp8_meta.fwd is None  # no delayed-scaling state behind it
    init = w.get_high_precision_init_val().float()
    scale = _current_scale(init, pow2=True)
    assert torch.equal(w._scale, scale) and torch.equal(w._scale_inv, 1.0 / scale)
    assert torch.equal(_bits(w._data), _bits((init * scale).clamp(-448, 448).to(E4M3)))
    assert torch.equal(_bits(w._transpose), _bits(w._data.t()))
    # a later delayed-scaling autocast does not tie it to the module's state
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
        layer(torch.randn(16, 64).bfloat16())
    assert layer.weight._scale is w._scale and getattr(layer.weight, "_amax", None) is None


def _train(fp8_params, init_state, batches, check=False):
    r = recipe.Float8CurrentScaling(amax_epsilon=1e-6)
    with te.fp8_model_init(enabled=fp8_params, recipe=r):
        model = Model()
    opt = FusedAdam(model.parameters(), lr=3e-3, master_weights=True)
    for name, p in model.named_parameters():
        opt.set_master_param(p, init_state[name])
    fp8 = [p for p in model.parameters() if isinstance(p, te.Float8Tensor)]
    assert len(fp8) == (3 if fp8_params else 0)
    losses = []
    for x, y in batches:
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if check:
            for w in fp8:
                master = opt.get_master_param(w)
                scale = _current_scale(master, eps=1e-6)
                assert torch.equal(w._scale, scale)
                assert torch.equal(_bits(w._data), _bits((master * scale).clamp(-448, 448).to(E4M3)))
                assert torch.equal(w._scale_inv, 1.0 / scale)
                assert torch.equal(_bits(w._transpose), _bits(w._data.t()))
    return model, losses


def test_fp8_params_under_current_scaling_train_like_bf16(randn):
    torch.manual_seed(0)
    init_state = {n: p.detach().float().clone() for n, p in Model().named_parameters()}
    teacher = randn(H, OUT, scale=H ** -0.5)
    batches = []
    for _ in range(25):
        x = randn(32, H)
        batches.append((x.to(torch.bfloat16), torch.tanh(x @ teacher)))
    _, bf16 = _train(False, init_state, batches)
    model, fp8 = _train(True, init_state, batches, check=True)
    final_bf16, final_fp8 = sum(bf16[-5:]) / 5, sum(fp8[-5:]) / 5
    assert final_bf16 < 0.6 * bf16[0]
    assert abs(final_fp8 - final_bf16) <= 0.02 * final_bf16, (final_bf16, final_fp8)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    w = sd["head.weight"]
    assert isinstance(w, te.Float8Tensor)
    assert torch.equal(w.dequantize(), model.head.weight.dequantize())
