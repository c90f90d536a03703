"""cpu tier: `tritium.ref.flash_attention` (the kernel's twin) against an fp64 oracle and against
`tritium.ref.attention`: fp32 results that are never rounded to the input dtype, top-left
causal for s_q != s_kv, GQA, and a backward that accepts a merged (out, lse) pair."""
from __future__ import annotations

import math

import pytest
import torch

from tritium.ref import attention as A
from tritium.ref import flash_attention as R

from testlib import fp64_attention


def _inputs(s_q, s_kv, h, h_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(2, s_q, h, d), mk(2, s_kv, h_kv, d), mk(2, s_kv, h_kv, d), mk(2, s_q, h, d)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
@pytest.mark.parametrize("shape", [(24, 24, 4, 2, 16), (16, 40, 2, 1, 32), (40, 16, 2, 2, 8)])
def test_twin_is_fp32_math_vs_fp64(shape, causal):
    s_q, s_kv, h, h_kv, d = shape
    q, k, v, do = _inputs(s_q, s_kv, h, h_kv, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    out, lse = R.flash_attention_fwd(q, k, v, causal, scale)
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (2, h, s_q)
    dq, dk, dv = R.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
    want = fp64_attention(q, k, v, do, causal, scale)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        tol = 2e-5 * ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= tol, name
        # far closer than a bf16 rounding of the same result
        if name != "lse":
            bf = (ref.to(torch.bfloat16).double() - ref).abs().max().item()
            assert (got.double() - ref).abs().max().item() < bf / 20, name


def test_twin_equals_ref_attention_before_rounding():
    q, k, v, do = _inputs(32, 32, 4, 2, 16, torch.float16)
    mask = torch.ones(32, 32, dtype=torch.bool).triu(1)
    out, lse = R.flash_attention_fwd(q, k, v, True, 0.25)
    r_out, r_lse, _ = A.attention_fwd(q, k, v, mask, 0.25, out_dtype=None)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    # the rounded reference is the twin's result rounded once
    assert torch.equal(A.attention_fwd(q, k, v, mask, 0.25)[0], out.to(torch.float16))
    got = R.flash_attention_bwd(do, q, k, v, out, lse, True, 0.25)
    for g, w in zip(got, A.attention_bwd(do.float(), q.float(), k.float(), v.float(), out, lse,
                                         mask, 0.25)):
        assert torch.equal(g, w)


def test_backward_with_merged_out_lse_sums_to_full():
    """Two no-mask KV halves, each backward fed the full (merged) out/lse: grads add up."""
    q, k, v, do = _inputs(16, 32, 2, 2, 16, torch.bfloat16)
    out, lse = R.flash_attention_fwd(q, k, v, False, 0.25)
    full = R.flash_attention_bwd(do, q, k, v, out, lse, False, 0.25)
    dq = torch.zeros_like(full[0])
    for part in (slice(0, 16), slice(16, 32)):
        g = R.flash_attention_bwd(do, q, k[:, part], v[:, part], out, lse, False, 0.25)
        dq += g[0]
        torch.testing.assert_close(g[1], full[1][:, part], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g[2], full[2][:, part], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dq, full[0], rtol=1e-5, atol=1e-6)


def test_forward_merge_of_two_key_halves_is_the_whole_forward():
    """`flash_attention_fwd_merge` (the twin of the Hopper kernel's merging epilogue): a
    causal first block merged with a no-mask second one, at a row offset of larger running
    buffers, equals one forward whose rows see the first keys causally and all the others
    (fp64 oracle); other rows untouched; the 16-bit copy is the merged out rounded."""
    q, k, v, _ = _inputs(24, 48, 2, 2, 16, torch.bfloat16, seed=3)
    total, row0, scale = 40, 9, 0.25
    g = torch.Generator().manual_seed(4)
    out, lse = torch.randn(2, total, 2, 16, generator=g), torch.randn(2, 2, total, generator=g)
    rows = slice(row0, row0 + 24)
    out[:, rows], lse[:, :, rows] = R.flash_attention_fwd(q, k[:, :24], v[:, :24], True, scale)
    before, out16 = out.clone(), torch.zeros(2, total, 2, 16, dtype=torch.bfloat16)
    R.flash_attention_fwd_merge(q, k[:, 24:], v[:, 24:], False, scale, out, lse, row0, out16)
    mask = torch.zeros(24, 48, dtype=torch.bool)
    mask[:, :24] = torch.ones(24, 24, dtype=torch.bool).triu(1)     # True: hidden
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    s = s.masked_fill(mask, float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())
    assert (out[:, rows].double() - want).abs().max().item() < 2e-5 * want.abs().max().item()
    assert (lse[:, :, rows].double() - s.logsumexp(-1)).abs().max().item() < 1e-5
    assert torch.equal(out[:, :row0], before[:, :row0])
    assert torch.equal(out[:, row0 + 24:], before[:, row0 + 24:])
    assert torch.equal(out16[:, rows], out[:, rows].to(torch.bfloat16))
    assert not out16[:, :row0].any() and not out16[:, row0 + 24:].any()
