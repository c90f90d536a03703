"""cpu tier: fp8_model_init / quantized_model_init under Float8BlockScaling.

What must hold: each GEMM weight of Linear / LayerNormLinear / LayerNormMLP is a
Float8BlockTensor whose rowwise and columnwise forms are exactly `quantize_blocks` of the
high-precision init (128x128 blocks, or 1x128 tiles with w_block_scaling_dim=1); forward and
backward under Float8BlockScaling read them without casting the weight, and give the same bits
as the same model with fp32 weights equal to the masters; a few FusedAdam(master_weights=True)
steps give bit for bit the losses, grads and masters of that fp32 model (whose weight is
quantized from it each step), the FP8 blocks after every step being the cast of the new master;
the state dict round-trips with torch.load(weights_only=True); bad uses raise clear errors.
"""
from __future__ import annotations

import io

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8 import block as block_ops
from tritium.fp8.block_tensor import Float8BlockTensor
from tritium.functional import _recast as recast_rule
from tritium.optimizers import FusedAdam, FusedSGD
from tritium.ref.block_cast import quantize_blocks

pytestmark = pytest.mark.cpu

H, F, OUT = 64, 144, 32   # F > 128: partial 128x128 blocks
E4M3 = torch.float8_e4m3fn


def _bits(t):
    return t.contiguous().view(torch.uint8)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(params_dtype=torch.float32)
        self.ln_lin = te.LayerNormLinear(H, H, **kw)
        self.mlp = te.LayerNormMLP(H, F, activation="swiglu", **kw)
        self.head = te.Linear(H, OUT, **kw)

    def forward(self, x):
        return self.head(self.mlp(self.ln_lin(x)))


GEMM_WEIGHTS = ("ln_lin.weight", "mlp.fc1_weight", "mlp.fc2_weight", "head.weight")


def _assert_blocks_of(w, value, r):
    q = quantize_blocks(value.float(), E4M3, block_2d=r.w_block_scaling_dim == 2, rowwise=True,
                        columnwise=True)
    for got, want in zip(w.operands(), q):
        assert torch.equal(_bits(got) if got.dtype == E4M3 else got,
                           _bits(want) if want.dtype == E4M3 else want)


@pytest.mark.parametrize("wdim", [2, 1])
def test_weights_are_block_fp8_of_their_init(wdim):
    r = recipe.Float8BlockScaling(w_block_scaling_dim=wdim)
    with te.quantized_model_init(recipe=r, preserve_high_precision_init_val=True):
        model = Model()
    params = dict(model.named_parameters())
    for name in GEMM_WEIGHTS:
        w = params[name]
        assert isinstance(w, Float8BlockTensor) and isinstance(w, torch.nn.Parameter), name
        assert w.requires_grad and w.dtype == torch.float32 and w._block_2d == (wdim == 2)
        init = w.get_high_precision_init_val()
        assert init is not None and init.abs().max() > 0
        _assert_blocks_of(w, init, r)
        # values: within E4M3 rounding of the init (2^-4 relative; subnormals ~2e-7 here)
        torch.testing.assert_close(w.dequantize(), init, rtol=2 ** -4, atol=1e-6)
    assert not isinstance(params["ln_lin.layer_norm_weight"], Float8BlockTensor)


def _pair(seed=0):
    """(model with block FP8 weights, fp32 model whose weights are those FP8 weights' inits)."""
    torch.manual_seed(seed)
    r = recipe.Float8BlockScaling()
    with te.fp8_model_init(recipe=r, preserve_high_precision_init_val=True):
        fp8 = Model()
    hp = Model()
    with torch.no_grad():
        for (name, p), q in zip(fp8.named_parameters(), hp.parameters()):
            init = p.get_high_precision_init_val() if name in GEMM_WEIGHTS else p
            q.copy_(init)
    return r, fp8, hp


def test_forward_backward_use_the_fp8_weight_as_is(monkeypatch):
    r, fp8, hp = _pair()
    x = torch.randn(40, H)
    casts = []
    real = block_ops.quantize_blocks

    def counting(t, dtype, **kw):
        casts.append(kw.get("block_2d", False))
        return real(t, dtype, **kw)
    monkeypatch.setattr(block_ops, "quantize_blocks", counting)
    outs, grads = [], []
    for model in (fp8, hp):
        casts.clear()
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=r):
            y = model(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad))
        grads.append([p.grad for p in model.parameters()])
        if model is fp8:
            assert not any(casts), "an FP8 weight was cast again"
        else:
            # the fp32 model casts each weight once in forward, both directions where it is
            # small enough to keep them, else rowwise and columnwise again in backward
            # (functional/_recast.py)
            small = [w.numel() <= recast_rule.KEEP_TRANSPOSE_MAX_NUMEL
                     for n, w in hp.named_parameters() if n in GEMM_WEIGHTS]
            assert len(small) == len(GEMM_WEIGHTS)
            assert sum(casts) == sum(1 if s else 2 for s in small)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for g0, g1 in zip(*grads):
        assert type(g0) is torch.Tensor and g0.abs().max() > 0 and torch.equal(g0, g1)


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedSGD])
def test_training_equals_fp32_weights_bit_for_bit(opt_cls):
    r, fp8, hp = _pair(1)
    kw = dict(lr=1e-2, weight_decay=0.01) if opt_cls is FusedAdam else dict(lr=0.05, momentum=0.9)
    opt8 = opt_cls(fp8.parameters(), master_weights=True, **kw)
    opt_hp = opt_cls(hp.parameters(), **kw)
    teacher = torch.randn(H, OUT) * H ** -0.5
    for step in range(3):
        x = torch.randn(32, H)
        y = torch.tanh(x @ teacher)
        losses = []
        for model, opt in ((fp8, opt8), (hp, opt_hp)):
            with te.fp8_autocast(fp8_recipe=r):
                loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        for name, p in fp8.named_parameters():
            q = dict(hp.named_parameters())[name]
            if name in GEMM_WEIGHTS:
                master = opt8.get_master_param(p)
                assert torch.equal(master, q.detach()), (step, name)
                _assert_blocks_of(p, master, r)   # requantized from the new master
            else:
                assert torch.equal(p.detach(), q.detach()), (step, name)


def test_set_master_param_and_checkpoint_round_trip():
    r, fp8, _ = _pair(2)
    opt = FusedAdam(fp8.parameters(), lr=1e-3, master_weights=True)
    w = fp8.head.weight
    new = torch.randn(OUT, H) * 0.05
    opt.set_master_param(w, new)
    assert torch.equal(opt.get_master_param(w), new)
    _assert_blocks_of(w, new, r)
    buf = io.BytesIO()
    torch.save(fp8.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert isinstance(sd["head.weight"], Float8BlockTensor)
    with te.fp8_model_init(recipe=r):
        other = Model()
    other.load_state_dict(sd)
    for name in GEMM_WEIGHTS:
        a, b = dict(fp8.named_parameters())[name], dict(other.named_parameters())[name]
        assert isinstance(b, Float8BlockTensor)
        for x, y in zip(a.operands(), b.operands()):
            assert torch.equal(_bits(x) if x.dtype == E4M3 else x,
                               _bits(y) if y.dtype == E4M3 else y)
    # a high-precision state dict loads into FP8 params by requantizing
    plain = {k: (v.dequantize() if isinstance(v, Float8BlockTensor) else v) for k, v in sd.items()}
    other.load_state_dict(plain)
    _assert_blocks_of(other.head.weight, plain["head.weight"], r)


def test_block_params_outside_block_recipes():
    r, fp8, hp = _pair(3)
    x = torch.randn(16, H)
    with torch.no_grad():   # no autocast: the dequantized weights in fp32
        for name in GEMM_WEIGHTS:
            dict(hp.named_parameters())[name].copy_(dict(fp8.named_parameters())[name].dequantize())
        torch.testing.assert_close(fp8(x), hp(x), rtol=1.3e-6, atol=1e-5)
    xi = x.clone().requires_grad_(True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        fp8(xi).sum().backward()
    assert fp8.head.weight.grad.abs().max() > 0 and xi.grad.abs().max() > 0


def test_errors():
    with pytest.raises(NotImplementedError, match="Float8BlockScaling"):
        with te.fp8_model_init(recipe=recipe.MXFP8BlockScaling()):
            pass
    with te.fp8_model_init(recipe=recipe.Float8BlockScaling()):
        layer = te.Linear(H, OUT)
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam(layer.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="float32 masters"):
        FusedAdam(layer.parameters(), lr=1e-3, master_weights=True,
                  master_weight_dtype=torch.float16)
