"""fp8_model_init(Float8BlockScaling) weights through the Triton kernels (interpreter): the
block-cast kernel makes the weight's blocks, the block GEMM reads them, the fused Adam kernel
steps the fp32 master and the cast kernel requantizes it; two steps give bit for bit the loss
and master of the same Linear with fp32 weights (whose weight the cast kernel quantizes each
forward), and the blocks equal the cast kernel's output for the new master."""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8 import block as block_ops
from tritium.optimizers import FusedAdam

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]


def test_block_fp8_param_steps_through_kernels(gen):
    kcast = block_ops._kernels()[0]
    r = recipe.Float8BlockScaling()
    with te.fp8_model_init(recipe=r, preserve_high_precision_init_val=True):
        fp8 = te.Linear(128, 128, params_dtype=torch.float32)
    hp = te.Linear(128, 128, params_dtype=torch.float32)
    with torch.no_grad():
        hp.weight.copy_(fp8.weight.get_high_precision_init_val())
        hp.bias.copy_(fp8.bias)
    opt8 = FusedAdam(fp8.parameters(), lr=1e-2, master_weights=True)
    opt_hp = FusedAdam(hp.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(16, 128, generator=gen)
        losses = []
        for model, opt in ((fp8, opt8), (hp, opt_hp)):
            with te.fp8_autocast(fp8_recipe=r):
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        master = opt8.get_master_param(fp8.weight)
        assert torch.equal(master, hp.weight.detach()) and not torch.equal(
            master, fp8.weight.get_high_precision_init_val())
        want = kcast.quantize_blocks(master, torch.float8_e4m3fn, block_2d=True, rowwise=True,
                                     columnwise=True)
        for got, ref in zip(fp8.weight.operands(), want):
            assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                               ref.view(torch.uint8) if ref.element_size() == 1 else ref)
