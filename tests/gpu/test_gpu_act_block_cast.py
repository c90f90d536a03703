"""gpu tier: the activation fused with Float8BlockScaling's 1x128 casts (`kernels.act_block_cast`)
on Hopper, bit for bit against the unfused kernel chain (activation kernel, zero rows to 16,
`kernels.block_cast.quantize_blocks`; elementwise values through the shared `_fwd_values` /
`_bwd_values`, so exact on the GPU too), and LayerNormMLP fused vs unfused over three steps
(outputs, input and parameter gradients: the same fp8 operands reach the same GEMMs).
Sizes: 8192 x 14336 swiglu bf16 (the LayerNormMLP benchmark's FFN), and odd ones.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8 import block as block_ops
from tritium.functional.fused_cast import fused_casts
from tritium.kernels import act_block_cast as kabc
from tritium.kernels import activation as kact
from tritium.kernels import block_cast as kbc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


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


@pytest.mark.parametrize("kind,rows,f,dtype", [("swiglu", 8192, 14336, torch.bfloat16),
                                               ("gelu", 1000, 3000, torch.bfloat16),
                                               ("geglu", 77, 200, torch.float32),
                                               ("srelu", 130, 136, torch.float16)])
def test_fused_equals_unfused_kernels(kind, rows, f, dtype):
    torch.manual_seed(0)
    gated = kind in kact.GATED
    x = (torch.randn(rows, 2 * f if gated else f, device="cuda") * 2).to(dtype)
    dy = torch.randn(rows, f, device="cuda").to(dtype)
    got = kabc.activation_fwd_blocks(x, kind, E4M3)
    want = kbc.quantize_blocks(_padded(kact.activation_fwd(x, kind)), E4M3, rowwise=True,
                               columnwise=True)
    for name, g, w in zip(("data", "scale_inv", "data_t", "scale_inv_t"), got, want):
        _same(g, w, f"fwd {name}")
    hp, got = kabc.activation_bwd_blocks(dy, x, kind, E5M2, write_hp=True)
    dx = kact.activation_bwd(dy, x, kind)
    want = kbc.quantize_blocks(_padded(dx), E5M2, rowwise=True, columnwise=True)
    _same(hp, dx, "bwd hp")
    for name, g, w in zip(("data", "scale_inv", "data_t", "scale_inv_t"), got, want):
        _same(g, w, f"bwd {name}")


@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("gelu", False)])
def test_layernorm_mlp_fused_equals_unfused(activation, bias, monkeypatch):
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(1024, 2816, activation=activation, bias=bias,
                          params_dtype=torch.bfloat16, device="cuda")
    calls = []
    fwd = block_ops.activation_fwd_blocks
    monkeypatch.setattr(block_ops, "activation_fwd_blocks",
                        lambda *a, **k: calls.append(1) or fwd(*a, **k))
    runs = []
    for module, fused in ((mlp, True), (copy.deepcopy(mlp), False)):
        gen = torch.Generator(device="cuda").manual_seed(7)
        rec = []
        with fused_casts(fused):
            for _ in range(3):
                x = torch.randn(3, 333, 1024, device="cuda", generator=gen).bfloat16()
                x.requires_grad_()
                with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
                    y = module(x)
                y.backward(torch.randn(y.shape, device="cuda", generator=gen).bfloat16())
                rec += [y.detach(), x.grad]
                for p in module.parameters():
                    rec.append(p.grad)
                    p.grad = None
        runs.append(rec)
    assert len(calls) == 3
    for i, (g, w) in enumerate(zip(*runs)):
        _same(g, w, f"tensor {i}")
