"""gpu tier: the Hopper Gluon forward (`tritium.kernels.flash_attention_sm90`) against its twin
(`tritium.ref.flash_attention`, fp32 math on the same 16-bit values) and against fp64 next to
cuDNN: out within 2x cuDNN's max error, lse within fp32 reduction tolerance; the speed-mode
dispatch takes it where `applies()` holds, and the Triton backward on its (out, lse) gives
grads as close to fp64 as cuDNN's. Skipped without an sm90 GPU.
"""
from __future__ import annotations

import math

import pytest
import torch


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU")]

D = 128
CASES = {  # b, s_q, s_kv, h, h_kv, causal, dtype
    "mha-causal": (2, 1024, 1024, 8, 8, True, torch.bfloat16),
    "mha-nomask": (2, 1024, 1024, 8, 8, False, torch.bfloat16),
    "gqa-causal": (1, 2048, 2048, 16, 4, True, torch.bfloat16),
    "q-shorter-causal": (1, 512, 1536, 4, 2, True, torch.bfloat16),
    "q-longer-nomask": (2, 1536, 512, 4, 1, False, torch.float16),
    "one-tile": (3, 128, 128, 2, 2, True, torch.float16),
}


def _inputs(b, s_q, s_kv, h, h_kv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, n: torch.randn(b, s, n, D, device="cuda", generator=g,  # noqa: E731
                                  dtype=dtype)
    return mk(s_q, h), mk(s_kv, h_kv), mk(s_kv, h_kv), mk(s_q, h)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_twin(name, _seed):
    from tritium.kernels import flash_attention as FA
    from tritium.kernels import flash_attention_sm90 as sm90
    from tritium.ref import flash_attention as twin
    b, s_q, s_kv, h, h_kv, causal, dtype = CASES[name]
    q, k, v, _ = _inputs(b, s_q, s_kv, h, h_kv, dtype, _seed)
    scale = 1 / math.sqrt(D)
    assert sm90.applies(q, k, v, dtype)
    out, lse = sm90.flash_attention_fwd(q, k, v, causal, scale)
    ref_out, ref_lse = twin.flash_attention_fwd(q, k, v, causal, scale)   # fp32
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (b, h, s_q)
    # out: P rounded once to 16 bits, out once (bf16's relative half-ulp is 2^-9)
    rel = (out.float() - ref_out).abs() / ref_out.abs().clamp_min(1)
    assert rel.max().item() < 2 ** -6 and rel.mean().item() < 2 ** -10
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    d_out, d_lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=False, out_dtype=dtype)
    assert torch.equal(d_out, out) and torch.equal(d_lse, lse)   # the dispatch takes it


def test_not_applied_outside_its_contract():
    from tritium.kernels import flash_attention_sm90 as sm90
    q, k, v, _ = _inputs(1, 256, 256, 4, 2, torch.bfloat16, 0)
    assert not sm90.applies(q, k, v, torch.float32)                      # fp32 out (split)
    assert not sm90.applies(q[:, :200], k[:, :200], v[:, :200], q.dtype)  # not 128-aligned
    assert not sm90.applies(q.transpose(0, 1), k, v, q.dtype)            # strided
    assert not sm90.applies(q[..., :64], k[..., :64], v[..., :64], q.dtype)   # d = 64


def test_forward_backward_close_to_fp64_as_cudnn():
    """The speed mode's fwd + bwd on the Gluon forward's (out, lse): every tensor within 2x
    cuDNN's max error vs fp64 (GQA, causal)."""
    from test_gpu_flash_attention import speed_mode_as_close_as_cudnn
    q, k, v, do = _inputs(1, 2048, 2048, 12, 4, torch.bfloat16, 5)
    speed_mode_as_close_as_cudnn("sm90 fwd", q, k, v, do, True)
