"""gpu tier: the Hopper Gluon forward (`tritium.kernels.flash_attention_sm90`) against its twin
(`tritium.ref.flash_attention`, fp32 math on the same 16-bit values) and against fp64 next to
cuDNN: out within 2x cuDNN's max error, lse within fp32 reduction tolerance; the speed-mode
dispatch takes it where `applies()` holds, and the Triton backward on its (out, lse) gives
grads as close to fp64 as cuDNN's; fp32 outputs (CP's partials) are the 16-bit ones unrounded.
Skipped without an sm90 GPU.
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
    "ragged-causal-gqa": (2, 1000, 1000, 8, 2, True, torch.bfloat16),   # tails everywhere
    "ragged-cross-nomask": (1, 300, 700, 4, 4, False, torch.float16),
    "short-kv-causal": (1, 384, 100, 4, 2, True, torch.bfloat16),       # one key tile, masked
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
    assert sm90.applies(q[:, :200], k[:, :200], v[:, :200], q.dtype)     # any lengths
    assert sm90.applies(q, k, v, torch.float32)                          # fp32 out (CP)
    assert not sm90.applies(q, k, v, torch.float16)                      # another 16-bit out
    assert not sm90.applies(q[..., :64], k[..., :64], v[..., :64], q.dtype)   # d = 64
    wide = torch.zeros(1, 256, 4, 2 * D, device="cuda", dtype=q.dtype)
    assert not sm90.applies(wide[..., ::2], k, v, q.dtype)               # d not unit-stride
    assert not sm90.applies(q[:0], k[:0], v[:0], q.dtype)                # empty batch
    assert not sm90.applies(q, k[:, :, :0], v[:, :, :0], q.dtype)        # no kv heads


def _fwd_bwd_equal_twin(q, k, v, do):
    """Speed-mode forward and backward through the dispatch vs the twin, causal and no mask
    (the fused backward): out within 2^-6 relative, lse to 1e-5, grads within 2^-6 of their
    max."""
    from tritium.kernels import flash_attention as FA
    from tritium.ref import flash_attention as twin
    scale = 1 / math.sqrt(D)
    for causal in (True, False):
        out, lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=False,
                                          out_dtype=q.dtype)
        ref_out, ref_lse = twin.flash_attention_fwd(q, k, v, causal, scale)
        rel = (out.float() - ref_out).abs() / ref_out.abs().clamp_min(1)
        assert rel.max().item() < 2 ** -6
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        got = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=False,
                                     grad_dtype=q.dtype)
        want = twin.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
        for tname, x, r in zip(("dq", "dk", "dv"), got, want):
            assert ((x.float() - r).abs() / r.abs().max()).max().item() < 2 ** -6, tname


def test_sbhd_memory(_seed):
    """q / k / v / dout in [s, b, h, d] memory (TE's sbhd), seen as bshd: the kernels read
    them in place (3D TMA views), forward and backward equal the twin's."""
    from tritium.kernels import flash_attention_sm90 as sm90
    b, s, h, h_kv = 2, 640, 8, 2
    g = torch.Generator(device="cuda").manual_seed(_seed)
    mk = lambda n: torch.randn(s, b, n, D, device="cuda", generator=g,  # noqa: E731
                               dtype=torch.bfloat16).transpose(0, 1)
    q, k, v, do = mk(h), mk(h_kv), mk(h_kv), mk(h)
    assert sm90.applies(q, k, v, q.dtype)
    _fwd_bwd_equal_twin(q, k, v, do)


def test_forward_backward_close_to_fp64_as_cudnn():
    """The speed mode's fwd + bwd on the Gluon forward's (out, lse): every tensor within 2x
    cuDNN's max error vs fp64 (GQA, causal)."""
    from test_gpu_flash_attention import speed_mode_as_close_as_cudnn
    q, k, v, do = _inputs(1, 2048, 2048, 12, 4, torch.bfloat16, 5)
    speed_mode_as_close_as_cudnn("sm90 fwd", q, k, v, do, True)


@pytest.mark.parametrize("name", list(CASES))
def test_dkdv_equals_twin(name, _seed):
    """The Gluon backward (dQ with delta, then dK / dV) against the twin's (fp32 math on the
    same values), fed the twin's (out, lse)."""
    from tritium.kernels import flash_attention as FA
    from tritium.kernels import flash_attention_sm90_bwd as sm90_bwd
    from tritium.ref import flash_attention as twin
    b, s_q, s_kv, h, h_kv, causal, dtype = CASES[name]
    q, k, v, do = _inputs(b, s_q, s_kv, h, h_kv, dtype, _seed)
    scale = 1 / math.sqrt(D)
    out, lse = twin.flash_attention_fwd(q, k, v, causal, scale)
    out = out.to(dtype)
    want = twin.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)   # fp32
    got = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=False,
                                 grad_dtype=dtype)
    assert sm90_bwd.applies_bwd(q, k, v, out, do, lse, dtype)
    for tname, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.dtype == dtype and x.shape == r.shape, tname
        rel = (x.float() - r).abs() / r.abs().max()
        print(f"{name} {tname}: max {rel.max().item():.2e} mean {rel.mean().item():.2e}")
        assert rel.max().item() < 2 ** -6 and rel.mean().item() < 2 ** -10, tname


def test_views_of_a_fused_projection(_seed):
    """q / k / v split from one [b, s, (h + 2 h_kv) * d] projection (rows strided): the Gluon
    kernels read them in place, forward and backward equal the twin's as in the tests above."""
    from tritium.kernels import flash_attention_sm90 as sm90
    b, s, h, h_kv = 2, 512, 8, 2
    g = torch.Generator(device="cuda").manual_seed(_seed)
    qkv = torch.randn(b, s, (h + 2 * h_kv) * D, device="cuda", generator=g,
                      dtype=torch.bfloat16)
    q, k, v = (x.unflatten(-1, (-1, D)) for x in qkv.split([h * D, h_kv * D, h_kv * D], -1))
    do = torch.randn(b, s, h, D, device="cuda", generator=g, dtype=torch.bfloat16)
    assert not q.is_contiguous() and sm90.applies(q, k, v, q.dtype)
    _fwd_bwd_equal_twin(q, k, v, do)


def test_fused_backward_equals_two_kernel_backward(_seed):
    """The one-kernel backward (dQ by TMA reduce-add in fp32) against the two-kernel one on the
    same (out, lse), no mask and causal (GQA, ragged: partial blocks on the diagonal): within a
    bf16 ulp of their max (the products are the same but for the order of their sums: S vs
    S^T, dQ's fp32 adds); without a mask the dispatch takes it, but for deterministic
    algorithms."""
    from tritium.kernels import flash_attention as FA
    from tritium.kernels import flash_attention_sm90_bwd as two
    from tritium.kernels import flash_attention_sm90_bwd_fused as fused
    if not fused.AVAILABLE:
        pytest.skip("this Triton's Gluon has no TMA reduce")
    q, k, v, do = _inputs(2, 1000, 1000, 8, 2, torch.bfloat16, _seed)   # GQA, ragged
    scale = 1 / math.sqrt(D)
    for causal in (False, True):
        out, lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=False,
                                          out_dtype=q.dtype)
        got = fused.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
        want = two.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
        for tname, x, r in zip(("dq", "dk", "dv"), got, want):
            assert x.dtype == q.dtype and x.shape == r.shape, tname
            err = (x.float() - r.float()).abs().max() / r.float().abs().max()
            assert err.item() < 2 ** -7, (causal, tname)
    out, lse = FA.flash_attention_fwd(q, k, v, False, scale, split=False, out_dtype=q.dtype)
    got = fused.flash_attention_bwd(do, q, k, v, out, lse, False, scale)
    dispatched = FA.flash_attention_bwd(do, q, k, v, out, lse, False, scale, split=False,
                                        grad_dtype=q.dtype)
    for x, r in zip(dispatched[1:], got[1:]):
        assert torch.equal(x, r)         # dK, dV are bit-reproducible
    torch.use_deterministic_algorithms(True)
    try:   # deterministic: the two-kernel backward
        want = two.flash_attention_bwd(do, q, k, v, out, lse, False, scale)
        for x, r in zip(FA.flash_attention_bwd(do, q, k, v, out, lse, False, scale, split=False,
                                               grad_dtype=q.dtype), want):
            assert torch.equal(x, r)
    finally:
        torch.use_deterministic_algorithms(False)


def test_fused_causal_backward_with_shorter_queries(_seed):
    """Top-left causal with fewer queries than keys (key blocks past the last query row see
    nothing: zero dK, dV) through the fused kernel, against the twin."""
    from tritium.kernels import flash_attention_sm90_bwd_fused as fused
    from tritium.ref import flash_attention as twin
    if not fused.AVAILABLE:
        pytest.skip("this Triton's Gluon has no TMA reduce")
    q, k, v, do = _inputs(1, 512, 1536, 4, 2, torch.bfloat16, _seed)
    scale = 1 / math.sqrt(D)
    out, lse = twin.flash_attention_fwd(q, k, v, True, scale)
    out = out.to(q.dtype)
    want = twin.flash_attention_bwd(do, q, k, v, out, lse, True, scale)
    got = fused.flash_attention_bwd(do, q, k, v, out, lse, True, scale)
    for tname, x, r in zip(("dq", "dk", "dv"), got, want):
        rel = (x.float() - r).abs() / r.abs().max()
        assert rel.max().item() < 2 ** -6 and rel.mean().item() < 2 ** -10, tname
    assert got[1][:, 640:].abs().max() == 0 and got[2][:, 640:].abs().max() == 0


def test_backward_sums_dq_into_a_callers_buffer(_seed):
    """A CP rank's shared delta and fp32 dQ (`delta=`, `dq_acc=`: rows of a larger buffer
    holding earlier blocks' sums): the fused kernel (MHA) sums its dQ into those rows in place,
    the two-kernel backward (causal GQA) adds it, the other rows untouched; within fp32 add
    order of the plain call's dQ plus the buffer, dK / dV as the plain call's."""
    from tritium.kernels import flash_attention as FA
    scale = 1 / math.sqrt(D)
    for h_kv, causal in ((8, False), (8, True), (2, True)):
        q, k, v, do = _inputs(1, 1000, 1536, 8, h_kv, torch.bfloat16, _seed)
        out, lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=False,
                                          out_dtype=torch.float32)
        plain = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=False,
                                       grad_dtype=torch.float32)
        buf = torch.randn(1, 3000, 8, D, device="cuda")
        rows, before = buf[:, 1000:2000], buf.clone()
        got = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=False,
                                     grad_dtype=torch.float32,
                                     delta=FA.flash_attention_delta(out, do), dq_acc=rows)
        assert got[0].data_ptr() == rows.data_ptr()
        assert torch.equal(buf[:, :1000], before[:, :1000])
        assert torch.equal(buf[:, 2000:], before[:, 2000:])
        want = before[:, 1000:2000] + plain[0]
        for name, x, r in (("dq", rows, want), ("dk", got[1], plain[1]),
                           ("dv", got[2], plain[2])):
            err = (x - r).abs().max() / r.abs().max()
            assert err.item() < 1e-5, (h_kv, causal, name)


@pytest.mark.parametrize("name", ["ragged-causal-gqa", "ragged-cross-nomask", "mha-nomask",
                                  "q-shorter-causal"])
def test_fp32_outputs_are_the_16_bit_ones_unrounded(name, _seed):
    """out_dtype / grad_dtype fp32 (what CP's fp32_partials blocks ask for; stored from
    registers, not through shared memory and TMA): the same kernels' values before their
    rounding, so rounded they equal the 16-bit outputs bit for bit (lse equal), but the fused
    backward's dQ (no mask: its fp32 adds run in a varying order) within a 16-bit ulp."""
    from tritium.kernels import flash_attention as FA
    from tritium.kernels import flash_attention_sm90_bwd as sm90_bwd
    b, s_q, s_kv, h, h_kv, causal, dtype = CASES[name]
    q, k, v, do = _inputs(b, s_q, s_kv, h, h_kv, dtype, _seed)
    scale = 1 / math.sqrt(D)
    out16, lse16 = FA.flash_attention_fwd(q, k, v, causal, scale, split=False, out_dtype=dtype)
    out32, lse32 = FA.flash_attention_fwd(q, k, v, causal, scale, split=False,
                                          out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == q.shape
    assert torch.equal(out32.to(dtype), out16) and torch.equal(lse32, lse16)
    assert not torch.equal(out32, out16.float())       # not rounded
    assert sm90_bwd.applies_bwd(q, k, v, out32, do, lse32, torch.float32)
    g16 = FA.flash_attention_bwd(do, q, k, v, out32, lse32, causal, scale, split=False,
                                 grad_dtype=dtype)
    g32 = FA.flash_attention_bwd(do, q, k, v, out32, lse32, causal, scale, split=False,
                                 grad_dtype=torch.float32)
    for tname, x32, x16 in zip(("dq", "dk", "dv"), g32, g16):
        assert x32.dtype == torch.float32 and x32.shape == x16.shape, tname
        if tname == "dq" and not causal:
            err = (x32.to(dtype).float() - x16.float()).abs() / x16.float().abs().max()
            assert err.max().item() <= 2 ** -7, tname
        else:
            assert torch.equal(x32.to(dtype), x16), tname
        assert not torch.equal(x32, x16.float()), tname


@pytest.mark.parametrize("causal", [False, True])
def test_forward_merges_into_running_partials(causal, _seed):
    """`flash_attention_fwd_merge` (a CP rank's later steps): the block's fp32 partial merged
    into running (out, lse) buffers by the kernel's epilogue equals the kernel's own partial
    merged by the twin's torch math (`merge_partial`, to fp32 rounding) and the twin's merge
    (within the forward's twin bounds), at a row offset of larger buffers (other rows
    untouched); the 16-bit copy is the merged out rounded; without a mask, merging two key
    halves equals one forward over all keys. Bad buffers raise before anything is written."""
    from tritium.kernels import flash_attention as FA
    from tritium.ref import flash_attention as twin
    b, s, h, total, row0 = 2, 1000, 4, 1700, 600
    q, k, v, _ = _inputs(b, s, 2 * s, h, h, torch.bfloat16, _seed)
    scale = 1 / math.sqrt(D)
    k1, v1, k2, v2 = k[:, :s], v[:, :s], k[:, s:], v[:, s:]
    g = torch.Generator(device="cuda").manual_seed(_seed + 1)
    out = torch.randn(b, total, h, D, device="cuda", generator=g)
    lse = torch.randn(b, h, total, device="cuda", generator=g).abs() + 3
    rows = slice(row0, row0 + s)
    out[:, rows], lse[:, :, rows] = FA.flash_attention_fwd(q, k1, v1, False, scale, split=False,
                                                           out_dtype=torch.float32)
    want, want_lse, twin_out, twin_lse = out.clone(), lse.clone(), out.clone(), lse.clone()
    part, part_lse = FA.flash_attention_fwd(q, k2, v2, causal, scale, split=False,
                                            out_dtype=torch.float32)
    twin.merge_partial(want, want_lse, row0, part, part_lse)
    twin.flash_attention_fwd_merge(q, k2, v2, causal, scale, twin_out, twin_lse, row0)
    got16 = torch.zeros(b, total, h, D, device="cuda", dtype=torch.bfloat16)
    assert FA.flash_attention_fwd_merge(q, k2, v2, causal, scale, out, lse, row0, got16)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    rel = (out - twin_out).abs() / twin_out.abs().clamp_min(1)
    assert rel.max().item() < 2 ** -6 and rel.mean().item() < 2 ** -10
    torch.testing.assert_close(lse, twin_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(got16[:, rows], out[:, rows].to(torch.bfloat16))
    assert not got16[:, :row0].any() and not got16[:, row0 + s:].any()
    if not causal:
        whole, whole_lse = FA.flash_attention_fwd(q, k, v, False, scale, split=False,
                                                  out_dtype=torch.float32)
        torch.testing.assert_close(out[:, rows], whole, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(lse[:, :, rows], whole_lse, rtol=1e-5, atol=1e-5)
    before = out.clone()
    for bad in (dict(row0=total - s + 1), dict(out=out[:, :, :, :64]), dict(lse=lse.double()),
                dict(out16=got16.half())):
        args = dict(dict(out=out, lse=lse, row0=row0, out16=got16), **bad)
        with pytest.raises(ValueError, match="flash_attention_fwd_merge"):
            FA.flash_attention_fwd_merge(q, k2, v2, causal, scale, **args)
    assert torch.equal(out, before)
