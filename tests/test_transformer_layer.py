"""cpu tier: TransformerLayer and MultiheadAttention against an independent pure-PyTorch Llama
decoder layer (written here from the Llama paper's equations and HF's conventions: RMSNorm,
q/k/v projections, rotate-half RoPE with cos/sin [s, d], GQA by repeating KV heads, causal
softmax attention in fp32, o_proj, SwiGLU MLP), with the same weights, at fp32 tolerance.

Also: both QKV layouts (interleaved or not) give the same function once the weights are placed
by the loader; TE's other block variants (post-LN residual, output_layernorm,
parallel_attention_mlp) equal their definitions composed from the submodules; cross-attention
MHA; the whole block runs under fp8_autocast; errors.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tritium as te
from tritium.integrations.llama import load_llama_decoder_layer

from testlib import FP32_TOL

pytestmark = pytest.mark.cpu

# hidden, ffn, heads, kv groups (head dim = hidden / heads)
SHAPES = [(64, 96, 4, 2), (128, 160, 2, 1), (64, 128, 4, 4)]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _llama_layer(x, p, heads, groups, eps, base=10000.0):
    """x [b, s, hidden] -> [b, s, hidden]: one Llama decoder layer in plain PyTorch (fp32)."""
    b, s, hidden = x.shape
    d = hidden // heads
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    h = _rms(x, p["input_layernorm"], eps)
    q = (h @ p["q_proj"].t()).view(b, s, heads, d).transpose(1, 2)
    k = (h @ p["k_proj"].t()).view(b, s, groups, d).transpose(1, 2)
    v = (h @ p["v_proj"].t()).view(b, s, groups, d).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    attn = (probs @ v).transpose(1, 2).reshape(b, s, heads * d)
    x = x + attn @ p["o_proj"].t()
    h = _rms(x, p["post_attention_layernorm"], eps)
    mlp = (F.silu(h @ p["gate_proj"].t()) * (h @ p["up_proj"].t())) @ p["down_proj"].t()
    return x + mlp


def _llama_weights(randn, hidden, ffn, heads, groups):
    d = hidden // heads
    shapes = dict(q_proj=(heads * d, hidden), k_proj=(groups * d, hidden),
                  v_proj=(groups * d, hidden), o_proj=(hidden, heads * d),
                  gate_proj=(ffn, hidden), up_proj=(ffn, hidden), down_proj=(hidden, ffn))
    p = {n: randn(*s, scale=1 / math.sqrt(s[1])) for n, s in shapes.items()}
    p["input_layernorm"] = 1 + randn(hidden, scale=0.1)
    p["post_attention_layernorm"] = 1 + randn(hidden, scale=0.1)
    return p


def _llama_block(hidden, ffn, heads, groups, eps=1e-6, interleaved=False, fmt="bshd"):
    return te.TransformerLayer(hidden, ffn, heads, num_gqa_groups=groups, layernorm_epsilon=eps,
                               hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                               activation="swiglu", bias=False, fuse_qkv_params=True,
                               qkv_weight_interleaved=interleaved, attn_input_format=fmt,
                               self_attn_mask_type="causal", device="cpu",
                               params_dtype=torch.float32)


@pytest.mark.parametrize("hidden,ffn,heads,groups", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_llama_block_matches_reference(randn, hidden, ffn, heads, groups, interleaved):
    eps = 1e-6
    p = _llama_weights(randn, hidden, ffn, heads, groups)
    block = _llama_block(hidden, ffn, heads, groups, eps, interleaved)
    load_llama_decoder_layer(block, **p)
    b, s = 2, 12
    x = randn(b, s, hidden, requires_grad=True)
    rope = te.RotaryPositionEmbedding(hidden // heads)(s)
    out = block(x, rotary_pos_emb=rope)
    x_ref = x.detach().clone().requires_grad_()
    ref_params = {n: t.clone().requires_grad_() for n, t in p.items()}
    ref = _llama_layer(x_ref, ref_params, heads, groups, eps)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    dy = randn(b, s, hidden)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, **FP32_TOL)
    mlp, attn = block.layernorm_mlp, block.self_attention
    f = ffn
    torch.testing.assert_close(mlp.fc1_weight.grad[:f], ref_params["gate_proj"].grad, **FP32_TOL)
    torch.testing.assert_close(mlp.fc1_weight.grad[f:], ref_params["up_proj"].grad, **FP32_TOL)
    torch.testing.assert_close(mlp.fc2_weight.grad, ref_params["down_proj"].grad, **FP32_TOL)
    torch.testing.assert_close(attn.proj.weight.grad, ref_params["o_proj"].grad, **FP32_TOL)
    torch.testing.assert_close(attn.layernorm_qkv.layer_norm_weight.grad,
                               ref_params["input_layernorm"].grad, **FP32_TOL)
    torch.testing.assert_close(mlp.layer_norm_weight.grad,
                               ref_params["post_attention_layernorm"].grad, **FP32_TOL)
    qkv_grad = attn.layernorm_qkv.weight.grad
    d = hidden // heads
    if interleaved:  # back to [q | k | v] order
        per_group = qkv_grad.view(groups, heads // groups + 2, d, hidden)
        q_g = per_group[:, :heads // groups].reshape(-1, hidden)
        k_g, v_g = per_group[:, -2].reshape(-1, hidden), per_group[:, -1].reshape(-1, hidden)
    else:
        q_g, k_g, v_g = qkv_grad.split([heads * d, groups * d, groups * d])
    for name, g in (("q_proj", q_g), ("k_proj", k_g), ("v_proj", v_g)):
        torch.testing.assert_close(g, ref_params[name].grad, **FP32_TOL)


def test_sbhd_equals_bshd(randn):
    hidden, ffn, heads, groups = SHAPES[0]
    p = _llama_weights(randn, hidden, ffn, heads, groups)
    blocks = {}
    for fmt in ("bshd", "sbhd"):
        blocks[fmt] = _llama_block(hidden, ffn, heads, groups, fmt=fmt)
        load_llama_decoder_layer(blocks[fmt], **p)
    x = randn(3, 10, hidden)
    rope = te.RotaryPositionEmbedding(hidden // heads)(10)
    out_b = blocks["bshd"](x, rotary_pos_emb=rope)
    out_s = blocks["sbhd"](x.transpose(0, 1).contiguous(), rotary_pos_emb=rope)
    torch.testing.assert_close(out_s.transpose(0, 1), out_b, **FP32_TOL)


def _te_default_block(**kwargs):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, device="cpu",
                params_dtype=torch.float32)
    args.update(kwargs)
    return te.TransformerLayer(64, 128, 4, **args)


def test_te_defaults_compose_as_defined(randn):
    block = _te_default_block()
    assert block.self_attention.layernorm_qkv.normalization == "LayerNorm"
    assert block.layernorm_mlp.activation == "gelu" and block.layernorm_mlp.use_bias
    assert {"query_weight", "key_weight", "value_weight"} <= \
        {n for n, _ in block.self_attention.layernorm_qkv.named_parameters()}
    x = randn(6, 2, 64)  # sbhd
    with torch.no_grad():
        for p in block.parameters():  # biases start at zero: make them matter
            p.add_(randn(*p.shape, scale=0.05))
    attn_out, attn_bias = block.self_attention(x)
    mid = x + attn_out + attn_bias
    mlp_out, mlp_bias = block.layernorm_mlp(mid)
    torch.testing.assert_close(block(x), mid + mlp_out + mlp_bias, **FP32_TOL)


@pytest.mark.parametrize("variant", ["post_ln_residual", "output_layernorm", "parallel"])
def test_block_variants(randn, variant):
    kwargs = {"post_ln_residual": dict(apply_residual_connection_post_layernorm=True),
              "output_layernorm": dict(output_layernorm=True),
              "parallel": dict(parallel_attention_mlp=True)}[variant]
    block = _te_default_block(bias=False, **kwargs)
    x = randn(5, 2, 64)
    out = block(x)
    attn, mlp = block.self_attention, block.layernorm_mlp
    if variant == "post_ln_residual":
        a, ln1 = attn(x)  # bias=False: no bias is returned, the norm output is
        mid = ln1 + a
        m, ln2 = mlp(mid)
        expect = ln2 + m
    elif variant == "output_layernorm":
        assert not hasattr(attn, "layernorm_qkv") and hasattr(attn, "qkv")
        mid = x + attn(x)
        expect = block.layernorm(mid + mlp(mid))
    else:
        expect = x + attn(x) + mlp(x)
    torch.testing.assert_close(out, expect, **FP32_TOL)


def test_cross_attention_mha(randn):
    mha = te.MultiheadAttention(64, 4, num_gqa_groups=2, attention_dropout=0.0,
                                attention_type="cross", attn_mask_type="no_mask", bias=False,
                                device="cpu", params_dtype=torch.float32)
    x, enc = randn(5, 2, 64), randn(7, 2, 64)
    out = mha(x, encoder_output=enc)
    d = 16
    q = (x @ mha.query_layer.weight.t()).view(5, 2, 4, d).permute(1, 2, 0, 3)
    kv = torch.cat([mha.key_value.key_weight, mha.key_value.value_weight])
    k, v = (enc @ kv.t()).split(32, dim=-1)
    k = k.view(7, 2, 2, d).permute(1, 2, 0, 3).repeat_interleave(2, dim=1)
    v = v.view(7, 2, 2, d).permute(1, 2, 0, 3).repeat_interleave(2, dim=1)
    ctx = ((q @ k.transpose(-1, -2)) / math.sqrt(d)).softmax(-1) @ v
    expect = ctx.permute(2, 0, 1, 3).reshape(5, 2, 64) @ mha.proj.weight.t()
    torch.testing.assert_close(out, expect, **FP32_TOL)
    with pytest.raises(ValueError, match="encoder_output"):
        mha(x)


def test_block_runs_under_fp8_autocast(randn):
    block = _llama_block(64, 96, 4, 2)
    x = randn(2, 16, 64, requires_grad=True)
    rope = te.RotaryPositionEmbedding(16)(16)
    with te.fp8_autocast(enabled=True):
        out = block(x, rotary_pos_emb=rope)
    out.pow(2).mean().backward()
    assert torch.isfinite(out).all() and x.grad.abs().sum() > 0
    hp = block(x.detach(), rotary_pos_emb=rope)
    err = (out.detach() - hp).norm() / hp.norm()
    assert 0 < err < 0.1  # FP8 changes the result, but only by quantization error


def test_errors():
    with pytest.raises(ValueError, match="num_gqa_groups"):
        te.MultiheadAttention(64, 4, num_gqa_groups=3, device="cpu")
    with pytest.raises(ValueError, match="attention_type"):
        te.MultiheadAttention(64, 4, attention_type="both", device="cpu")
    with pytest.raises(NotImplementedError, match="layer_type"):
        te.TransformerLayer(64, 128, 4, layer_type="decoder", device="cpu")
    block = _llama_block(64, 96, 4, 2)
    with pytest.raises(ValueError, match="q_proj"):
        load_llama_decoder_layer(block, q_proj=torch.zeros(3, 64), k_proj=torch.zeros(32, 64),
                                 v_proj=torch.zeros(32, 64), o_proj=torch.zeros(64, 64),
                                 input_layernorm=torch.ones(64), gate_proj=torch.zeros(96, 64),
                                 up_proj=torch.zeros(96, 64), down_proj=torch.zeros(64, 96),
                                 post_attention_layernorm=torch.ones(64))


def _kept_storages(out) -> dict:
    """{data_ptr: nbytes} of every tensor the autograd graph behind `out` keeps for backward:
    saved tensors, and tensors (in lists / tuples) on a custom Function's context."""
    found, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions)
        items = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")]
        items += list(getattr(node, "saved_tensors", ()) or ())
        items += list(getattr(node, "__dict__", {}).values())
        for item in items:
            for t in item if isinstance(item, (list, tuple)) else (item,):
                if isinstance(t, torch.Tensor):
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return found


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_layer_does_not_keep_the_fused_qkv_output(randn, interleaved, fp8):
    """With RoPE, q and k are new tensors and v was a view of the fused QKV projection's output:
    attention's backward then kept that whole buffer alive for v alone. v is copied instead, so
    nothing the graph keeps is as large as the fused output (values unchanged: test above)."""
    hidden, heads, groups, b, s = 64, 4, 2, 2, 16
    block = _llama_block(hidden, 96, heads, groups, interleaved=interleaved)
    x = randn(b, s, hidden, requires_grad=True)
    rope = te.RotaryPositionEmbedding(hidden // heads)(s)
    with te.fp8_autocast(enabled=fp8):
        out = block(x, rotary_pos_emb=rope)
    fused = b * s * (heads + 2 * groups) * (hidden // heads) * x.element_size()
    kept = _kept_storages(out)
    for t in [x, *block.parameters()]:  # alive anyway (a recast in backward keeps the weight)
        kept.pop(t.untyped_storage().data_ptr(), None)
    assert kept and fused not in kept.values()
    v = b * s * groups * (hidden // heads) * x.element_size()
    assert v in kept.values()  # v's own copy, kept for attention's backward
