"""te.MoE on the CPU path, and converting HF Mixtral / Qwen3-MoE models.

The layer against a plain per-token PyTorch MoE (softmax top-k renormalised, swiglu experts) at
fp32 tolerance, outputs and every gradient; its FP8 run against the same plain MoE at fp8
tolerance; as TransformerLayer's MLP; the aux loss. Tiny Mixtral and Qwen3-MoE models
(transformers; Qwen3 with and without renormalised top-k, and a dense layer left alone)
converted with `convert_moe` give HF's logits and grads at fp32 tolerance, and map back to HF's
keys.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tritium as te
from testlib import FP8_TOL, FP32_TOL
from tritium import recipe

pytestmark = pytest.mark.cpu

H, FF, E, K = 32, 48, 4, 2


def plain_moe(moe, x):
    """Per token: softmax top-k of the router logits, renormalised; swiglu experts."""
    x2 = x.reshape(-1, H)
    if moe.normalization == "RMSNorm":
        x2 = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + moe.eps) * moe.layer_norm_weight
    p = torch.softmax(F.linear(x2, moe.router_weight), -1)
    top, idx = p.topk(K, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x2)
    for t in range(x2.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            w1 = getattr(moe.experts_fc1, f"weight{e}")
            w2 = getattr(moe.experts_fc2, f"weight{e}")
            gate, up = F.linear(x2[t], w1).chunk(2)
            out[t] = out[t] + top[t, j] * F.linear(F.silu(gate) * up, w2)
    return out.view(x.shape)


def test_moe_matches_plain_pytorch(randn):
    moe = te.MoE(H, FF, te.MoEConfig(num_experts=E, topk=K), normalization="RMSNorm",
                 device="cpu")
    with torch.no_grad():
        moe.layer_norm_weight.copy_(1 + randn(H, scale=0.1))
    ref = copy.deepcopy(moe)
    x = randn(3, 5, H, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = moe(x)
    want = plain_moe(ref, x2)
    torch.testing.assert_close(y, want, **FP32_TOL)
    dy = randn(3, 5, H)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, **FP32_TOL)
    for (name, p), (_, q) in zip(moe.named_parameters(), ref.named_parameters()):
        assert q.grad is not None or p.grad is None, name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **FP32_TOL, msg=name)
    assert moe.router_weight.grad.abs().max() > 0


@pytest.mark.parametrize("rcp", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_moe_fp8_close_to_plain(randn, rcp):
    moe = te.MoE(H, FF, te.MoEConfig(num_experts=E, topk=K), device="cpu")
    x = randn(24, H, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=rcp):
        y = moe(x)
    y.backward(randn(24, H))
    want = plain_moe(moe, x.detach())
    torch.testing.assert_close(y, want, **FP8_TOL)
    assert not torch.allclose(y, want, rtol=1e-5, atol=1e-6)  # FP8 really ran
    assert moe.experts_fc1.fp8_meta.fwd is not None or isinstance(rcp, recipe.Float8CurrentScaling)
    assert moe.experts_fc2.weight1.grad is not None


def test_moe_as_transformer_layer_mlp(randn):
    layer = te.TransformerLayer(H, FF, 4, normalization="RMSNorm", bias=False,
                                hidden_dropout=0.0, attention_dropout=0.0, activation="swiglu",
                                device="cpu")
    layer.layernorm_mlp = te.MoE(H, FF, te.MoEConfig(num_experts=E, topk=K),
                                 normalization="RMSNorm", eps=1e-5, device="cpu")
    x = randn(6, 2, H, requires_grad=True)  # sbhd
    y = layer(x)
    attn = layer.self_attention(x)
    mid = x + attn
    torch.testing.assert_close(y, mid + plain_moe(layer.layernorm_mlp, mid), **FP32_TOL)
    y.sum().backward()
    assert layer.layernorm_mlp.experts_fc2.weight0.grad is not None


def test_aux_loss_and_errors(randn):
    cfg = te.MoEConfig(num_experts=E, topk=K, aux_loss_coeff=1e-2)
    moe = te.MoE(H, FF, cfg, device="cpu")
    x = randn(10, H)
    moe(x)
    p = torch.softmax(F.linear(x, moe.router_weight), -1)
    tpe = torch.zeros(E).scatter_add(0, p.topk(K, -1).indices.reshape(-1), torch.ones(10 * K))
    want = (p.sum(0) * tpe).sum() * E * 1e-2 / (K * 10 * 10)
    torch.testing.assert_close(moe.aux_loss, want, **FP32_TOL)
    moe.eval()
    moe(x)
    assert moe.aux_loss is None
    with pytest.raises(ValueError, match="topk"):
        te.MoEConfig(num_experts=4, topk=5)
    with pytest.raises(ValueError, match="expert_bias"):
        te.MoEConfig(num_experts=4, expert_bias=True)
    with pytest.raises(ValueError, match="hidden_size"):
        moe(randn(3, H + 1))


# --------------------------------------------------------------------------------------------
# HF Mixtral
# --------------------------------------------------------------------------------------------
def _hf_model(transformers, family):
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=K, max_position_embeddings=64)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=FF, num_local_experts=E, **common)
        return transformers.MixtralForCausalLM(cfg)
    # Qwen3-MoE, layer 0 a dense MLP (left alone), with or without renormalised top-k
    cfg = transformers.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=FF,
                                      num_experts=E, norm_topk_prob=family == "qwen3-norm",
                                      mlp_only_layers=[0], head_dim=8, **common)
    return transformers.Qwen3MoeForCausalLM(cfg)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-norm", "qwen3"])
def test_convert_matches_hf(family):
    transformers = pytest.importorskip("transformers")
    from tritium.integrations.hf_moe import convert_moe, to_hf_moe_state_dict
    hf = _hf_model(transformers, family).float().eval()
    with torch.no_grad():  # Qwen3-MoE's router starts at zero: ties everywhere
        for p in hf.parameters():
            if p.abs().max() == 0:
                p.normal_(0.0, 0.5)
    ours = convert_moe(copy.deepcopy(hf))
    moe_layers = [i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, te.MoE)]
    assert moe_layers == ([0, 1] if family == "mixtral" else [1])
    ids = torch.randint(0, 64, (2, 9))
    want = hf(input_ids=ids, labels=ids)
    got = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, **FP32_TOL)
    want.loss.backward()
    got.loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for i in moe_layers:
        moe, pre = ours.model.layers[i].mlp, f"model.layers.{i}.mlp."
        torch.testing.assert_close(moe.router_weight.grad, hf_grads[pre + "gate.weight"],
                                   **FP32_TOL)
        for e in range(E):
            torch.testing.assert_close(getattr(moe.experts_fc1, f"weight{e}").grad,
                                       hf_grads[pre + "experts.gate_up_proj"][e], **FP32_TOL)
            torch.testing.assert_close(getattr(moe.experts_fc2, f"weight{e}").grad,
                                       hf_grads[pre + "experts.down_proj"][e], **FP32_TOL)
    moe_prefixes = tuple(f"model.layers.{i}.mlp." for i in moe_layers)
    for n, p in ours.named_parameters():  # everything else is HF's own, dense MLPs included
        if not n.startswith(moe_prefixes):
            torch.testing.assert_close(p.grad, hf_grads[n], **FP32_TOL, msg=n)
    sd = to_hf_moe_state_dict(ours)
    fresh = _hf_model(transformers, family).float()
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh(input_ids=ids).logits, want.logits, **FP32_TOL)


def test_convert_refuses_jitter():
    transformers = pytest.importorskip("transformers")
    from tritium.integrations.hf_moe import convert_moe
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=H, intermediate_size=FF,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=E,
                                     router_jitter_noise=0.1)
    with pytest.raises(NotImplementedError, match="router_jitter_noise"):
        convert_moe(transformers.MixtralForCausalLM(cfg))
