"""LayerNormLinear and LayerNormMLP vs pure-PyTorch compositions, and the Llama MLP loader.

The seed question: a Llama MLP (RMSNorm in fp32, gate/up/down nn.Linear, SiLU) ported to
LayerNormMLP(swiglu, RMSNorm, bias=False) with `load_llama_mlp` must agree in fp32 (TF32 off)
to <= 1e-5 max abs on the output and every grad. Every activation is checked against its own
formula the same way; FP8 against an emulation written in this file; checkpoint=True against
checkpoint=False bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritium as te
from testlib import E4M3, E5M2, FP8_TOL, fake_quant
from tritium import recipe
from tritium.integrations.llama import llama_mlp_weights, load_llama_mlp

pytestmark = pytest.mark.cpu

FORMULAS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "srelu": lambda x: F.relu(x) ** 2,
    "silu": F.silu,
}
GATED = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
         "swiglu": "silu", "glu": None}


def act_formula(kind, h):
    if kind in FORMULAS:
        return FORMULAS[kind](h)
    a, b = h.chunk(2, dim=-1)
    gate = torch.sigmoid(a) if kind == "glu" else FORMULAS[GATED[kind]](a)
    return gate * b


def rmsnorm(x, w, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)) * w.float()


class LlamaMLP(torch.nn.Module):
    """The unfused reference: RMSNorm (fp32 math), gate/up/down projections, SiLU."""

    def __init__(self, hidden, ffn, eps):
        super().__init__()
        self.eps = eps
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        h = rmsnorm(x, self.norm_weight, self.eps).to(x.dtype)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def max_abs(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_llama_mlp_port_matches_unfused_reference_in_fp32():
    hidden, ffn, eps = 512, 1536, 1e-5
    ref = LlamaMLP(hidden, ffn, eps)
    mlp = te.LayerNormMLP(hidden, ffn, eps, bias=False, normalization="RMSNorm",
                          activation="swiglu", device="cpu")
    load_llama_mlp(mlp, gate_proj=ref.gate_proj, up_proj=ref.up_proj, down_proj=ref.down_proj,
                   norm_weight=ref.norm_weight)
    x = torch.randn(2, 1024, hidden)
    dy = torch.randn(2, 1024, hidden)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x1), mlp(x2)
    out_ref.backward(dy)
    out.backward(dy)
    assert max_abs(out, out_ref) <= 1e-5
    assert max_abs(x2.grad, x1.grad) <= 1e-5
    f = ffn
    assert max_abs(mlp.fc1_weight.grad[:f], ref.gate_proj.weight.grad) <= 1e-5
    assert max_abs(mlp.fc1_weight.grad[f:], ref.up_proj.weight.grad) <= 1e-5
    assert max_abs(mlp.fc2_weight.grad, ref.down_proj.weight.grad) <= 1e-5
    assert max_abs(mlp.layer_norm_weight.grad, ref.norm_weight.grad) <= 1e-5
    # and the order matters: swapping gate and up gives a different function
    swapped = te.LayerNormMLP(hidden, ffn, eps, bias=False, normalization="RMSNorm",
                              activation="swiglu", device="cpu")
    load_llama_mlp(swapped, gate_proj=ref.up_proj, up_proj=ref.gate_proj,
                   down_proj=ref.down_proj, norm_weight=ref.norm_weight)
    assert max_abs(swapped(x), out_ref) > 1e-3


@pytest.mark.parametrize("kind", list(FORMULAS) + list(GATED))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_every_activation_matches_its_formula_in_fp32(kind, normalization):
    hidden, ffn, eps = 64, 96, 1e-5
    mlp = te.LayerNormMLP(hidden, ffn, eps, normalization=normalization, activation=kind,
                          device="cpu")
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 5, hidden) * 2
    dy = torch.randn(3, 5, hidden)
    params = [p.detach().clone().requires_grad_() for p in mlp.parameters()]
    names = [n for n, _ in mlp.named_parameters()]
    P = dict(zip(names, params))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    if normalization == "LayerNorm":
        h = F.layer_norm(xr, (hidden,), P["layer_norm_weight"], P["layer_norm_bias"], eps)
    else:
        h = rmsnorm(xr, P["layer_norm_weight"], eps)
    ref = F.linear(act_formula(kind, F.linear(h, P["fc1_weight"], P["fc1_bias"])),
                   P["fc2_weight"], P["fc2_bias"])
    ref.backward(dy)
    out = mlp(xt)
    out.backward(dy)
    assert max_abs(out, ref) <= 1e-5
    assert max_abs(xt.grad, xr.grad) <= 1e-5
    for n, p in mlp.named_parameters():
        assert max_abs(p.grad, P[n].grad) <= 1e-5, n


def test_loader_round_trip_and_errors():
    mlp = te.LayerNormMLP(32, 48, bias=False, normalization="RMSNorm", activation="swiglu",
                          zero_centered_gamma=True, device="cpu")
    w = dict(gate_proj=torch.randn(48, 32), up_proj=torch.randn(48, 32),
             down_proj=torch.randn(32, 48), norm_weight=1 + torch.randn(32))
    load_llama_mlp(mlp, **w)
    back = llama_mlp_weights(mlp)
    for k in w:
        torch.testing.assert_close(back[k], w[k], rtol=0, atol=1e-6)
    before = mlp.fc1_weight.detach().clone()
    with pytest.raises(ValueError, match="up_proj"):
        load_llama_mlp(mlp, **{**w, "up_proj": torch.randn(47, 32)})
    assert torch.equal(mlp.fc1_weight, before)  # nothing changed
    with pytest.raises(ValueError, match="bias=False"):
        load_llama_mlp(te.LayerNormMLP(32, 48, normalization="RMSNorm", activation="swiglu",
                                       device="cpu"), **w)


def _fp8_step(mlp, x, dy, rec, checkpoint=False):
    mlp.checkpoint = checkpoint
    xi = x.clone().requires_grad_()
    for p in mlp.parameters():
        p.grad = None
    with te.fp8_autocast(fp8_recipe=rec):
        out = mlp(xi)
    out.backward(dy)
    return [out.detach(), xi.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(amax_history_len=4),
                                 recipe.Float8CurrentScaling()], ids=["delayed", "current"])
def test_checkpoint_recompute_is_bit_identical(rec):
    torch.manual_seed(0)
    a = te.LayerNormMLP(32, 64, normalization="RMSNorm", activation="swiglu", device="cpu")
    b = te.LayerNormMLP(32, 64, normalization="RMSNorm", activation="swiglu", device="cpu")
    b.load_state_dict(a.state_dict())
    x, dy = torch.randn(24, 32), torch.randn(24, 32)
    for _ in range(3):  # scales change between steps: the recompute must use the forward's
        ga, gb = _fp8_step(a, x, dy, rec), _fp8_step(b, x, dy, rec, checkpoint=True)
        for u, v in zip(ga, gb):
            assert torch.equal(u, v)
    if isinstance(rec, recipe.DelayedScaling):
        assert torch.equal(a.fp8_meta.fwd.amax_history, b.fp8_meta.fwd.amax_history)


def test_fp8_layernorm_mlp_matches_emulation():
    torch.manual_seed(1)
    rec = recipe.DelayedScaling(amax_history_len=4)
    mlp = te.LayerNormMLP(32, 48, normalization="RMSNorm", activation="swiglu", device="cpu")
    x, dy = torch.randn(20, 32), torch.randn(20, 32)
    _fp8_step(mlp, x, dy, rec)  # non-trivial scales for the checked step
    fwd, bwd = mlp.fp8_meta.fwd.scale.clone(), mlp.fp8_meta.bwd.scale.clone()
    got = _fp8_step(mlp, x, dy, rec)
    P = {n: p.detach().clone().requires_grad_() for n, p in mlp.named_parameters()}
    xr = x.clone().requires_grad_()
    h = rmsnorm(xr, P["layer_norm_weight"], 1e-5)
    def q(t, i):  # straight-through: the value is quantized, the gradient passes unchanged
        return t + (fake_quant(t, fwd[i], E4M3) - t).detach()

    class QGrad(torch.autograd.Function):  # fake-quantize the gradient flowing back
        @staticmethod
        def forward(ctx, t, s):
            ctx.s = s
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return fake_quant(g, ctx.s, E5M2), None
    # the bias gradient is the sum of the unquantized grad_output (as in tritium)
    fc1 = QGrad.apply(q(h, 0) @ q(P["fc1_weight"], 1).t(), bwd[0]) + P["fc1_bias"]
    act = act_formula("swiglu", fc1)
    out = QGrad.apply(q(act, 2) @ q(P["fc2_weight"], 3).t(), bwd[1]) + P["fc2_bias"]
    out.backward(dy)
    torch.testing.assert_close(got[0], out.detach(), **FP8_TOL)
    torch.testing.assert_close(got[1], xr.grad, **FP8_TOL)
    for g, (n, p) in zip(got[2:], P.items()):
        torch.testing.assert_close(g, p.grad, **FP8_TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_matches_norm_then_linear(normalization):
    lin = te.LayerNormLinear(64, 48, normalization=normalization, return_layernorm_output=True,
                             return_bias=True, device="cpu")
    with torch.no_grad():
        lin.layer_norm_weight.add_(0.1 * torch.randn(64))
    x = torch.randn(4, 6, 64, requires_grad=True)
    out, bias, ln_out = lin(x)
    if normalization == "LayerNorm":
        ref_ln = F.layer_norm(x, (64,), lin.layer_norm_weight, lin.layer_norm_bias, 1e-5)
    else:
        ref_ln = rmsnorm(x, lin.layer_norm_weight, 1e-5)
    assert bias is lin.bias
    assert max_abs(ln_out, ref_ln) <= 1e-5
    assert max_abs(out, F.linear(ref_ln, lin.weight)) <= 1e-5
    names = {n for n, _ in lin.named_parameters()}
    want = {"weight", "bias", "layer_norm_weight"} | ({"layer_norm_bias"}
                                                     if normalization == "LayerNorm" else set())
    assert names == want


def test_bf16_layernorm_mlp_close_to_fp32():
    """bf16 params and input: four roundings (norm, fc1, activation, fc2) away from fp32, so
    the relative error of the whole output is a few bf16 ulps (2**-8 each), far under 1e-2."""
    mlp16 = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu", device="cpu",
                            params_dtype=torch.bfloat16,
                            init_method=lambda w: torch.nn.init.normal_(w, std=0.2))
    mlp = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu", device="cpu")
    with torch.no_grad():
        for p, q in zip(mlp.parameters(), mlp16.parameters()):
            p.copy_(q.float())
    x = torch.randn(8, 64).bfloat16()
    out16, out = mlp16(x), mlp(x.float())
    assert out16.dtype == torch.bfloat16 and out.abs().max() > 0.5
    rel = ((out16.float() - out).norm() / out.norm()).item()
    assert 0 < rel < 1e-2


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fc1_fc2_weights_cast_together_same_bits(monkeypatch, normalization):
    """fc1's and fc2's weights are cast in one pair cast before fc1 runs (host time: one launch
    instead of two); outputs, grads, amaxes and scales after two steps are the bits of the two
    separate casts (the pair cast switched off)."""
    import importlib
    lnmlp = importlib.import_module("tritium.modules.layernorm_mlp")
    real = lnmlp.cast_weights_together
    used = []

    def spy(plans, weights, need_t, rows=None):
        out = real(plans, weights, need_t, rows)
        # new plans with weight_ready set; the ones given are left as they were
        used.append(all(p.weight_ready is not None for p in out)
                    and all(p.weight_ready is None for p in plans))
        return out

    def run(pair):
        monkeypatch.setattr(lnmlp, "cast_weights_together", spy if pair else
                            (lambda plans, weights, need_t, rows=None: plans))
        torch.manual_seed(0)
        m = te.LayerNormMLP(64, 96, normalization=normalization, device="cpu")
        x = torch.randn(3, 11, 64, requires_grad=True)
        dy = torch.randn(3, 11, 64)
        rec = recipe.DelayedScaling(amax_history_len=4)
        for _ in range(2):
            x.grad = None
            m.zero_grad(set_to_none=True)
            with te.fp8_autocast(fp8_recipe=rec):
                y = m(x)
            y.backward(dy)
        meta = m.fp8_meta
        return [y, x.grad, *(p.grad for p in m.parameters()), meta.fwd.amax_history,
                meta.fwd.scale, meta.bwd.amax_history, meta.bwd.scale]

    separate, paired = run(False), run(True)
    assert used == [True, True]
    assert separate[0].abs().max() > 0
    for a, b in zip(separate, paired):
        assert torch.equal(a.view(-1).view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(-1).view(torch.int16 if b.element_size() == 2 else torch.int32))


def test_fp8_dims_checked_at_every_call_until_they_pass():
    """The FP8 dims check runs once it has passed (a flag), so a bad size must still raise at
    every FP8 call, and a good module's later calls skip it."""
    bad = te.LayerNormMLP(64, 40, device="cpu")
    x = torch.randn(4, 64)
    for _ in range(2):
        with pytest.raises(ValueError, match="divisible by 16"):
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
                bad(x)
    assert bad(x).shape == (4, 64)  # without FP8: no check
    good = te.LayerNormMLP(64, 96, device="cpu")
    assert not good._fp8_dims_ok
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        good(x)
    assert good._fp8_dims_ok
