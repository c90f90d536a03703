"""gpu tier: fp8_model_init(recipe=Float8BlockScaling()) on Hopper, through the Triton kernels.

What must hold (the cpu tier checks the same through the twins): block FP8 weights are the
block-cast kernel's output for their init; a few FusedAdam(master_weights=True) steps of a model
with them give bit for bit the losses, grads and masters of the same model with fp32 weights
equal to the masters (each forward casting the weight with the same kernel), and after each
step every weight's blocks are the cast kernel's output for the new master.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.block_tensor import Float8BlockTensor
from tritium.kernels import block_cast as kcast
from tritium.optimizers import FusedAdam

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

H, F, OUT, T = 256, 528, 128, 384
E4M3 = torch.float8_e4m3fn


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(params_dtype=torch.float32, device="cuda")
        self.ln_lin = te.LayerNormLinear(H, H, **kw)
        self.mlp = te.LayerNormMLP(H, F, activation="swiglu", **kw)
        self.head = te.Linear(H, OUT, **kw)

    def forward(self, x):
        return self.head(self.mlp(self.ln_lin(x)))


def _same_blocks(w, value):
    want = kcast.quantize_blocks(value, E4M3, block_2d=w._block_2d, rowwise=True, columnwise=True)
    return all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b)
               for a, b in zip(w.operands(), want))


@pytest.mark.parametrize("wdim", [2, 1])
def test_block_fp8_params_train_like_fp32_weights_on_gpu(wdim):
    torch.manual_seed(0)
    r = recipe.Float8BlockScaling(w_block_scaling_dim=wdim)
    with te.fp8_model_init(recipe=r, preserve_high_precision_init_val=True):
        fp8 = Model()
    hp = Model()
    block = {n for n, p in fp8.named_parameters() if isinstance(p, Float8BlockTensor)}
    assert len(block) == 4
    with torch.no_grad():
        for (name, p), q in zip(fp8.named_parameters(), hp.parameters()):
            q.copy_(p.get_high_precision_init_val() if name in block else p)
            if name in block:
                assert _same_blocks(p, q.detach())
    opt8 = FusedAdam(fp8.parameters(), lr=1e-3, weight_decay=0.01, master_weights=True)
    opt_hp = FusedAdam(hp.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(3):
        x = torch.randn(T, H, device="cuda")
        y = torch.randn(T, OUT, device="cuda")
        losses = []
        for model, opt in ((fp8, opt8), (hp, opt_hp)):
            with te.fp8_autocast(fp8_recipe=r):
                loss = (model(x) - y).pow(2).mean()
            loss.backward()
            if model is fp8:
                grads = [p.grad.clone() for p in model.parameters()]
            else:
                assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        hp_params = dict(hp.named_parameters())
        for name, p in fp8.named_parameters():
            if name in block:
                master = opt8.get_master_param(p)
                assert torch.equal(master, hp_params[name].detach()), (step, name)
                assert _same_blocks(p, master), (step, name)
            else:
                assert torch.equal(p.detach(), hp_params[name].detach()), (step, name)
