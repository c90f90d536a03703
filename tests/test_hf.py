"""cpu tier: tritium.integrations.hf.convert_llama / to_hf_state_dict against the transformers
Llama it converts (a tiny random LlamaConfig built offline; skipped without transformers).

fp32: logits, loss and the gradients of every weight (mapped back to HF names) equal the
original model's at TE's fp32 tolerance (rtol 1.3e-6, atol 1e-5); with padding (left-padded
rows, HF's 4D mask -> TE's arbitrary mask) on the real tokens; with per-row position_ids. The
norm weights are perturbed away from 1 so a swapped or missing norm shows. FP8 (HYBRID delayed
scaling, all dims multiples of 16): the loss within fp8 tolerance (relative 0.125). Round trip:
to_hf_state_dict == the original state_dict (same keys, order, values), and it loads into a
fresh LlamaForCausalLM that then matches the converted model.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te

transformers = pytest.importorskip("transformers")

from tritium.integrations.hf import (TritiumLlamaDecoderLayer, convert_llama,  # noqa: E402
                                     fuse_cross_entropy, to_hf_state_dict)

from testlib import FP32_TOL  # noqa: E402

pytestmark = pytest.mark.cpu

VOCAB = 96


def _hf_model(hidden=64, ffn=96, heads=4, kv=2, layers=2, head_dim=None, attn="sdpa"):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=500.0, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation=attn)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # norms away from 1, and larger weights than HF's 0.02 init
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def _pair(**kw):
    hf = _hf_model(**kw)
    return hf, convert_llama(copy.deepcopy(hf))


def _grads_by_hf_name(model) -> dict:
    """Gradients under HF names: for a converted model, to_hf_state_dict over the grads."""
    if any(isinstance(m, TritiumLlamaDecoderLayer) for m in model.modules()):
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.grad)
        grads = {k: v.clone() for k, v in to_hf_state_dict(model).items()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        return {k: v for k, v in grads.items() if "rotary" not in k}
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kw", [dict(), dict(heads=4, kv=1, layers=3),
                                dict(hidden=64, heads=2, kv=2, head_dim=48, ffn=80)])
def test_fp32_logits_and_grads_match(kw):
    hf, conv = _pair(**kw)
    assert not any(isinstance(m, transformers.models.llama.modeling_llama.LlamaAttention)
                   for m in conv.modules())  # HF's q/k/v/o modules are gone
    assert isinstance(conv.model.norm, te.RMSNorm)  # the final norm too (same weight, eps)
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(conv(input_ids=ids).logits, hf(input_ids=ids).logits,
                                   **FP32_TOL)
    ref, out = hf(input_ids=ids, labels=ids), conv(input_ids=ids, labels=ids)
    assert out.logits is None  # training with labels: the fused loss, no logits
    torch.testing.assert_close(out.loss, ref.loss, **FP32_TOL)
    ref.loss.backward()
    out.loss.backward()
    ref_grads, grads = _grads_by_hf_name(hf), _grads_by_hf_name(conv)
    assert list(grads) == list(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)


def test_padding_mask_and_eager_attention():
    hf, conv = _pair(attn="eager")  # eager: HF passes an additive float mask
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    ref, out = hf(input_ids=ids, attention_mask=mask), conv(input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], **FP32_TOL)
    hf.config._attn_implementation = conv.config._attn_implementation = "sdpa"  # bool mask
    ref, out = hf(input_ids=ids, attention_mask=mask), conv(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], **FP32_TOL)


def test_output_hidden_states_match():
    """output_hidden_states=True: the embeddings and every layer's output, as HF's model gives
    them (transformers >= 4.54 records them with hooks on its own layer class)."""
    hf, conv = _pair(layers=3)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True).hidden_states
        out = conv(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(out) == len(ref) == 4
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_layer_compiles_fullgraph_with_the_converted_models_hooks():
    """The converted model's pre-hooks add nothing to a layer that a per-layer
    `compile(fullgraph=True)` must trace (HF's capture hook appears only when asked)."""
    hf, conv = _pair()
    ids = torch.randint(0, VOCAB, (2, 9))
    torch._dynamo.reset()
    conv.model.layers[0].compile(fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(conv(input_ids=ids).logits, hf(input_ids=ids).logits,
                                   **FP32_TOL)


def test_per_row_position_ids():
    hf, conv = _pair()
    ids = torch.randint(0, VOCAB, (2, 9))
    pos = torch.stack([torch.arange(9), torch.arange(9) + 5])
    ref, out = hf(input_ids=ids, position_ids=pos), conv(input_ids=ids, position_ids=pos)
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)


def test_no_mask_skips_hf_packed_sequence_check(monkeypatch):
    """Without attention_mask and position_ids the converted model skips HF's mask code (its
    packed-sequence check reads a device tensor on the host: a sync per forward); with
    position_ids that pack two sequences into a row, HF's check runs and its packed mask is
    followed (RoPE restarts and no attention across the boundary), as in HF's model."""
    from transformers import masking_utils
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        pytest.skip("this transformers has no packed-sequence check")
    calls = []
    check = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda pos: calls.append(1) or check(pos))
    hf, conv = _pair()
    hf.config.use_cache = False  # as a training step (with a cache HF checks nothing)
    ids = torch.randint(0, VOCAB, (2, 12))
    ref, out = hf(input_ids=ids, labels=ids), conv(input_ids=ids, labels=ids)
    assert len(calls) == 1  # HF's model only
    torch.testing.assert_close(out.loss, ref.loss, **FP32_TOL)
    out.loss.backward()  # the marker is no tensor of the graph
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, 12)
    with torch.no_grad():
        ref, out = hf(input_ids=ids, position_ids=pos), conv(input_ids=ids, position_ids=pos)
    assert len(calls) == 3
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)
    with torch.no_grad():  # packing changes the logits: the packed mask was followed
        assert not torch.allclose(conv(input_ids=ids).logits[:, 5:], out.logits[:, 5:])


def test_layer_inputs_follow_position_ids_changes():
    """The decoder layers share one forward's mask and angles (made once, reused while the
    same tensors come in): a changed position_ids, in place or new, gives new angles."""
    hf, conv = _pair()
    ids = torch.randint(0, VOCAB, (2, 9))
    pos = torch.arange(9)[None].clone()
    ref, out = hf(input_ids=ids, position_ids=pos), conv(input_ids=ids, position_ids=pos)
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)
    layer = conv.model.layers[0]
    h = torch.randn(2, 9, 64)
    first = layer._inputs.get(layer, h, None, pos)[2]
    assert layer._inputs.get(layer, h, None, pos)[2] is first  # reused
    pos.mul_(2)  # same tensor, new version
    torch.testing.assert_close(layer._inputs.get(layer, h, None, pos)[2],
                               layer._freqs(pos[0]), rtol=0, atol=0)
    pos2 = torch.stack([torch.arange(9), torch.arange(9) + 2])
    ref, out = hf(input_ids=ids, position_ids=pos2), conv(input_ids=ids, position_ids=pos2)
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)
    with torch.inference_mode():  # inference tensors have no version: never reused
        ref, out = hf(input_ids=ids), conv(input_ids=ids)
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)


def test_fp8_loss_within_fp8_tolerance():
    hf, conv = _pair(hidden=64, ffn=128, heads=4, kv=2)
    ids = torch.randint(0, VOCAB, (2, 32))
    ref = hf(input_ids=ids, labels=ids).loss
    recipe = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        out = conv(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss, ref, rtol=0.125, atol=0.0)
    grads = [p.grad for p in conv.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # and the FP8 forward really differs from fp32 (it ran in FP8)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            fp8_logits = conv(input_ids=ids).logits
        assert not torch.equal(fp8_logits, conv(input_ids=ids).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_fused_causal_lm_loss_equals_hf(tied):
    """Training mode with labels: HF's ForCausalLMLoss (shift, ignore -100, mean; sum over
    num_items_in_batch) through linear_cross_entropy, 1e-6 relative; logits None; gradients
    of every weight (the tied embedding included) at fp32 tolerance."""
    hf = _hf_model()
    if tied:
        hf.config.tie_word_embeddings = True
        hf.lm_head.weight = hf.model.embed_tokens.weight
    conv = convert_llama(copy.deepcopy(hf))
    assert (conv.lm_head.weight is conv.model.embed_tokens.weight) == tied
    ids = torch.randint(0, VOCAB, (3, 13))
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[2, 7] = -100
    for kwargs in (dict(), dict(num_items_in_batch=torch.tensor(50))):
        for m in (hf, conv):
            m.zero_grad(set_to_none=True)
        ref = hf(input_ids=ids, labels=labels, **kwargs)
        out = conv(input_ids=ids, labels=labels, **kwargs)
        assert out.logits is None and ref.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
        ref.loss.backward()
        out.loss.backward()
        ref_grads, grads = _grads_by_hf_name(hf), _grads_by_hf_name(conv)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)
    conv.eval()  # eval mode: HF's own forward, logits and loss
    with torch.no_grad():
        out, ref = conv(input_ids=ids, labels=labels), hf.eval()(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, **FP32_TOL)


def test_fuse_cross_entropy_alone_keeps_hf_layers():
    """fuse_cross_entropy on an unconverted model: HF's decoder layers stay, the training loss
    (shift_labels given directly, as a pre-shifted batch) equals HF's at 1e-6 relative and the
    gradients at fp32 tolerance; a model without an nn.Linear lm_head is refused."""
    hf = _hf_model()
    fused = fuse_cross_entropy(copy.deepcopy(hf))
    assert not any(isinstance(m, TritiumLlamaDecoderLayer) for m in fused.modules())
    ids, targets = torch.randint(0, VOCAB, (2, 11)), torch.randint(0, VOCAB, (2, 11))
    out = fused(input_ids=ids, shift_labels=targets)
    logits = hf(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=0)
    out.loss.backward()
    ref.backward()
    ref_grads = dict(hf.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, **FP32_TOL, msg=name)
    with pytest.raises(TypeError, match="lm_head"):
        fuse_cross_entropy(hf.model)


def test_round_trip_state_dict():
    hf = _hf_model(layers=3)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    conv = convert_llama(copy.deepcopy(hf))
    back = to_hf_state_dict(conv)
    assert list(back) == list(original)
    for k in original:
        assert torch.equal(back[k], original[k]), k
    fresh = transformers.LlamaForCausalLM(hf.config).float()
    fresh.load_state_dict(back)
    ids = torch.randint(0, VOCAB, (2, 7))
    torch.testing.assert_close(conv(input_ids=ids).logits, fresh(input_ids=ids).logits,
                               **FP32_TOL)


def test_unsupported_configs_and_calls():
    hf = _hf_model()
    hf.config.mlp_bias = True
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        convert_llama(copy.deepcopy(hf))
    hf.config.mlp_bias = False
    conv = convert_llama(copy.deepcopy(hf))
    assert conv.config.use_cache is False
    ids = torch.randint(0, VOCAB, (1, 5))
    with pytest.raises(NotImplementedError, match="KV cache"):
        conv(input_ids=ids, use_cache=True)
    import inspect
    names = [n for n in ("past_key_values", "cache")  # `cache` since transformers 5
             if n in inspect.signature(type(conv.model).forward).parameters]
    for name in names:
        with pytest.raises(NotImplementedError, match="KV cache"):
            conv(input_ids=ids, **{name: transformers.DynamicCache()})
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        convert_llama(torch.nn.Linear(2, 2))
