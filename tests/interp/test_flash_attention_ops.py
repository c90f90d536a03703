"""The `tritium::flash_attn_fwd/_bwd` custom ops (tritium/ops/attention.py) on the Triton kernel,
under the interpreter: compiled (torch.compile fullgraph, aot_eager) == the eager launchers.

The attention backend choice never picks this kernel on CPU (context parallelism's exact mode
takes it on CUDA only), so the ops are driven directly: through their autograd formula (the
forward op, a loss, backward -> the backward op) and through a CP block `Runner` on its kernel
path, which calls the ops when traced. Same kernel, same inputs, a deterministic interpreter:
bit for bit. fp16 inputs (the interpreter's bf16 tl.dot is wrong, see conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import flash_attention as K

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,  # the interpreter's own numpy warning on tensor loop bounds
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]


def _data(gen, s_q=24, s_kv=24, h=2, h_kv=1, d=16):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.float16)
    return rnd(1, s_q, h, d), rnd(1, s_kv, h_kv, d), rnd(1, s_kv, h_kv, d), rnd(1, s_q, h, d)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_compiled_ops_with_autograd_equal_the_launchers(causal, gen):
    from tritium.ops import attention  # registers the ops
    q, k, v, w = _data(gen, s_kv=40 if not causal else 24)
    assert attention._impl(q) is K, "the ops must run the kernel here, not the twin"

    def loss(q, k, v):
        out, lse = torch.ops.tritium.flash_attn_fwd(q, k, v, causal, 0.25)
        return (out * w.float()).sum(), out, lse

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch._dynamo.reset()
    total, out, lse = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    total.backward()
    want_out, want_lse = K.flash_attention_fwd(q, k, v, causal, 0.25)
    assert_same_bits(out.detach(), want_out, "out")
    assert_same_bits(lse.detach(), want_lse, "lse")
    grads = K.flash_attention_bwd(w.float(), q, k, v, want_out, want_lse, causal, 0.25)
    for name, leaf, g in zip(("dq", "dk", "dv"), leaves, grads):
        assert_same_bits(leaf.grad, g.to(torch.float16), name)


def test_compiled_cp_block_runner_equals_eager(gen):
    from tritium.attention.cp.merge import ALL, Block, Precision, Runner
    runner = Runner(0.3, 0.0, "auto", Precision(exact=True, kernel=True))
    blk = Block(ALL, ALL, True)

    def block(q, k, v, dout):
        out, lse, state = runner.fwd(q, k, v, blk)
        return (out, lse) + tuple(runner.bwd(dout, q, k, v, out, lse, blk, state))

    q, k, v, dout = _data(gen, s_q=33, s_kv=33)
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v, dout)
    want = block(q, k, v, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_same_bits(a, b, name)
