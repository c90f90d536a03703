"""gpu tier: LayerNorm / RMSNorm fused with Float8BlockScaling's 1x128 casts
(`kernels.norm_block_cast`) on Hopper, bit for bit against the unfused kernel chain (norm kernel,
zero rows to 16, `kernels.block_cast.quantize_blocks`): pass 1 shares the plain forward's tile
(`_norm_fwd_tile`), and pass 2 recomputes y elementwise with the same expression, which this
file checks is contracted the same way on the GPU. Then LayerNormLinear and LayerNormMLP fused vs
unfused over three steps (outputs, input and parameter gradients).
Sizes: 8192 x 4096 bf16 (the LayerNormMLP benchmark's hidden), and odd ones.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8 import block as block_ops
from tritium.functional.fused_cast import fused_casts
from tritium.kernels import block_cast as kbc
from tritium.kernels import norm as knorm
from tritium.kernels import norm_block_cast as knbc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

E4M3 = torch.float8_e4m3fn


def _same(got, want, what):
    if want is None:
        assert got is None, what
        return
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    g = got.contiguous().view(ints[got.element_size()])
    w = want.contiguous().view(ints[want.element_size()])
    assert got.shape == want.shape and torch.equal(g, w), \
        f"{what}: {(g != w).sum().item()} of {g.numel()} differ"


def _padded(y):
    rows_p = -(-y.shape[0] // 16) * 16
    return torch.cat([y, y.new_zeros(rows_p - y.shape[0], y.shape[1])])


@pytest.mark.parametrize("norm,rows,h,dtype,zc", [("LayerNorm", 8192, 4096, torch.bfloat16, False),
                                                  ("RMSNorm", 8192, 4096, torch.bfloat16, True),
                                                  ("LayerNorm", 1000, 3000, torch.bfloat16, True),
                                                  ("RMSNorm", 77, 200, torch.float32, False),
                                                  ("LayerNorm", 130, 136, torch.float16, False)])
def test_fused_equals_unfused_kernels(norm, rows, h, dtype, zc):
    torch.manual_seed(0)
    x = (torch.randn(rows, h, device="cuda") * 2 + 0.5).to(dtype)
    w = (torch.randn(h, device="cuda") * 0.3 + (0.0 if zc else 1.0)).to(dtype)
    b = (torch.randn(h, device="cuda") * 0.1).to(dtype)
    if norm == "LayerNorm":
        hp, got, mean, rstd = knbc.layernorm_fwd_blocks(x, w, b, 1e-5, zc, E4M3, write_hp=True)
        y, want_mean, want_rstd = knorm.layernorm_fwd(x, w, b, 1e-5, zc)
        _same(mean, want_mean, "mean")
    else:
        hp, got, rstd = knbc.rmsnorm_fwd_blocks(x, w, 1e-5, zc, E4M3, write_hp=True)
        y, want_rstd = knorm.rmsnorm_fwd(x, w, 1e-5, zc)
    _same(rstd, want_rstd, "rstd")
    _same(hp, y, "y")
    want = kbc.quantize_blocks(_padded(y), E4M3, rowwise=True, columnwise=True)
    for name, g, wt in zip(("data", "scale_inv", "data_t", "scale_inv_t"), got, want):
        _same(g, wt, name)


@pytest.mark.parametrize("kind,norm", [("LayerNormLinear", "LayerNorm"),
                                       ("LayerNormMLP", "RMSNorm")])
def test_modules_fused_equal_unfused(kind, norm, monkeypatch):
    torch.manual_seed(0)
    if kind == "LayerNormLinear":
        module = te.LayerNormLinear(1024, 3072, normalization=norm, params_dtype=torch.bfloat16,
                                    device="cuda")
    else:
        module = te.LayerNormMLP(1024, 2816, normalization=norm, activation="swiglu",
                                 params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        module.layer_norm_weight.add_(torch.randn(1024, device="cuda").bfloat16() * 0.2)
    calls = []
    fwd = block_ops.norm_fwd_blocks
    monkeypatch.setattr(block_ops, "norm_fwd_blocks",
                        lambda *a, **k: calls.append(1) or fwd(*a, **k))
    runs = []
    for mod, fused in ((module, True), (copy.deepcopy(module), False)):
        gen = torch.Generator(device="cuda").manual_seed(7)
        rec = []
        with fused_casts(fused):
            for _ in range(3):
                x = torch.randn(3, 333, 1024, device="cuda", generator=gen).bfloat16()
                x.requires_grad_()
                with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
                    y = mod(x)
                y.backward(torch.randn(y.shape, device="cuda", generator=gen).bfloat16())
                rec += [y.detach(), x.grad]
                for p in mod.parameters():
                    rec.append(p.grad)
                    p.grad = None
        runs.append(rec)
    assert len(calls) == 3
    for i, (g, w) in enumerate(zip(*runs)):
        _same(g, w, f"tensor {i}")
