"""gpu tier: attention under torch.compile on CUDA, where the backend choice reads the device
(compute capability, cuDNN version, the cuDNN GQA probe: `backends.device_facts`, a constant for
Dynamo) and runs the fused ATen kernels. Skipped without CUDA.

  * each CUDA backend (cudnn, flash, efficient; skipped where this GPU rejects the call) and the
    auto choice: 0 graph breaks, compiled (fullgraph, aot_eager) == eager over 3 calls with
    one compiled frame. Tolerance: the same kernels run both ways, but the fused backward passes
    may accumulate dq with atomics (order not fixed) and the compiled graph may hand a kernel
    other strides, so results can differ by a 16-bit rounding: TE's bf16 tolerance (rtol
    1.6e-2, atol 1e-5) for the output and every grad.
  * thd on flash varlen (max_seqlen given): the same.
  * MultiheadAttention in bf16 (RMSNorm, GQA, RoPE) under the default inductor backend: 0 graph
    breaks, compiled == eager at bf16 tolerance (inductor fuses the projections' epilogues).
  * the tritium::flash_attn_fwd/_bwd custom ops on the Triton kernel: opcheck, and compiled ==
    the launchers bit for bit (no atomics in that kernel).
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tritium as te
import tritium.attention as A

from testlib import BF16_TOL

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, S, H, G, D = 2, 256, 8, 2, 64
BF16 = torch.bfloat16


def _breaks(fn, *args, **kwargs):
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args, **kwargs)
    return ex.graph_break_count, "\n".join(b.reason for b in ex.break_reasons)


def _qkv(fmt, gen):
    lead = (S, B) if fmt == "sbhd" else (B, S) if fmt == "bshd" else (B * S,)
    return [torch.randn(*lead, n, D, device="cuda", generator=gen).to(BF16) for n in (H, G, G)]


def _compiled_equals_eager(module, inputs, kwargs, gen, calls=3):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(module, fullgraph=True, backend=counter)
    for call in range(calls):
        xs = [x.normal_(generator=gen) for x in inputs]
        results = []
        for model in (fn, module):
            leaves = [x.detach().clone().requires_grad_(True) for x in xs]
            out = model(*leaves, **kwargs)
            out.backward(torch.ones_like(out))
            results.append([out] + [x.grad for x in leaves])
        for i, (a, b) in enumerate(zip(*results)):
            what = "output" if i == 0 else f"grad {i - 1}"
            torch.testing.assert_close(a, b, **BF16_TOL, msg=lambda m: f"call {call} {what}: {m}")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_backend_compiles_without_graph_break(backend, fmt):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = _qkv(fmt, gen)
    ex = A.explain(q, k, v, backend=backend, qkv_format=fmt, attn_mask_type="causal")
    if ex.backend is None:
        pytest.skip(f"{backend} rejects this call here: {ex.reasons.get(backend)}")
    dpa = A.DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt, backend=backend)
    count, why = _breaks(dpa, q, k, v)
    assert count == 0, why
    _compiled_equals_eager(dpa, [q, k, v], {}, gen)


def test_thd_flash_varlen_compiles_without_graph_break():
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = _qkv("thd", gen)
    cu = torch.tensor([0, 100, 256, 512], dtype=torch.int32, device="cuda")
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=256, max_seqlen_kv=256)
    ex = A.explain(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", **kwargs)
    assert ex.backend == "flash", str(ex)
    dpa = A.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                                attn_mask_type="padding_causal")
    count, why = _breaks(dpa, q, k, v, **kwargs)
    assert count == 0, why
    _compiled_equals_eager(dpa, [q, k, v], kwargs, gen)


def test_multihead_attention_bf16_inductor():
    torch.manual_seed(3)
    mha = te.MultiheadAttention(H * D, H, num_gqa_groups=G, params_dtype=BF16, bias=False,
                                input_layernorm=True, normalization="RMSNorm",
                                attention_dropout=0.0, fuse_qkv_params=True,
                                qkv_weight_interleaved=False)
    x = torch.randn(S, B, H * D, device="cuda", dtype=BF16)
    freqs = A.RotaryPositionEmbedding(D)(S).cuda()
    count, why = _breaks(mha, x, rotary_pos_emb=freqs)
    assert count == 0, why
    torch._dynamo.reset()
    fn = torch.compile(mha, fullgraph=True)
    for _ in range(3):
        x.normal_()
        got, want = fn(x, rotary_pos_emb=freqs), mha(x, rotary_pos_emb=freqs)
        torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_ops_on_the_kernel(dtype):
    from tritium.kernels import flash_attention as K
    from tritium.ops import attention as ops
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, w = (torch.randn(1, 512, n, 128, device="cuda", generator=gen).to(dtype)
                  for n in (8, 2, 2, 8))
    assert ops._impl(q) is K
    torch.library.opcheck(torch.ops.tritium.flash_attn_fwd.default, (q, k, v, True, 0.1, True))

    def loss(q, k, v):
        out, lse = torch.ops.tritium.flash_attn_fwd(q, k, v, True, 0.1)
        return (out * w.float()).sum(), out, lse

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch._dynamo.reset()
    total, out, lse = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    total.backward()
    want_out, want_lse = K.flash_attention_fwd(q, k, v, True, 0.1)
    assert torch.equal(out.detach(), want_out) and torch.equal(lse.detach(), want_lse)
    grads = K.flash_attention_bwd(w.float(), q, k, v, want_out, want_lse, True, 0.1)
    for leaf, g in zip(leaves, grads):
        assert torch.equal(leaf.grad, g.to(dtype))
