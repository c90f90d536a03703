"""gpu tier: the cross-entropy kernel == its ref twin on CUDA at Llama-3's vocabulary (128256),
and linear_cross_entropy (kernel path) == the same function on the ref path, bf16 and FP8.

Kernel vs twin to fp32 rounding (online vs full-row sums, see tests/interp); 16-bit gradients
within one ulp-ish (bf16 tolerance). Shapes: 2048 tokens (bshd 2 x 1024) x 128256 classes in
bf16 and fp32; a vocab slice of 128256 / 8 (vocab-parallel halves); linear_cross_entropy with
hidden 2048 over the full vocabulary in chunks.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.kernels import cross_entropy as kce
from tritium.ref import cross_entropy as rce
from testlib import BF16_TOL

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

V = 128256
TOL32 = dict(rtol=1e-5, atol=1e-6)


def _data(t, v, dtype):
    x = (torch.randn(t, v, device="cuda") * 4).to(dtype)
    tgt = torch.randint(0, v, (t,), device="cuda")
    tgt[::7] = -100
    return x, tgt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_matches_twin(dtype):
    x, t = _data(2048, V, dtype)
    scale = torch.tensor([1 / 1700.0], device="cuda")
    gk, gr = torch.empty_like(x), torch.empty_like(x)
    lk, sk = kce.ce_fused(x, t, gk, scale, -100, 0.1, 1e-4)
    lr, sr = rce.ce_fused(x, t, gr, scale, -100, 0.1, 1e-4)
    torch.testing.assert_close(lk, lr, **TOL32)
    torch.testing.assert_close(sk, sr, **TOL32)
    tol = TOL32 if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(gk.float(), gr.float(), rtol=tol["rtol"], atol=1e-9)
    kce.ce_fused(x, t, x, scale, -100, 0.1, 1e-4)  # in place
    torch.testing.assert_close(x.float(), gr.float(), rtol=tol["rtol"], atol=1e-9)


def test_slice_kernels_match_twin():
    x, t = _data(1024, V // 8, torch.bfloat16)
    t = t * 8  # global ids: most targets fall outside this slice
    start = V // 8 * 3
    sk, sr = kce.ce_stats(x, t, start), rce.ce_stats(x, t, start)
    torch.testing.assert_close(sk[:3], sr[:3], **TOL32)  # max, sum of exp, target logit
    # The plain sum of 16032 logits (|x| up to ~20) cancels to near 0: compare it at the bound
    # of an fp32 sum taken in another order, n * 2^-24 * max|x|, which a lost or doubled block
    # (an error of a whole logit, ~4) still fails by far.
    bound = x.shape[1] * 2.0 ** -24 * x.float().abs().amax().item()
    torch.testing.assert_close(sk[3], sr[3], rtol=0, atol=bound)
    lse = torch.randn(1024, device="cuda") + 12
    gout = torch.rand(1024, device="cuda")
    gk, gr = torch.empty_like(x), torch.empty_like(x)
    kce.ce_grad(x, t, lse, gk, gout, -100, start, V, 0.0, 0.0)
    rce.ce_grad(x, t, lse, gr, gout, -100, start, V, 0.0, 0.0)
    torch.testing.assert_close(gk.float(), gr.float(), rtol=BF16_TOL["rtol"], atol=1e-9)


@pytest.mark.parametrize("fp8", [False, True])
def test_linear_cross_entropy_kernel_vs_ref(fp8, setenv):
    torch.manual_seed(0)
    hid = (torch.randn(2, 1024, 2048, device="cuda") * 0.5).bfloat16()
    w = (torch.randn(V, 2048, device="cuda") * 0.02).bfloat16()
    t = torch.randint(0, V, (2, 1024), device="cuda")
    t[:, -1] = -100
    outs = []
    for force_ref in ("0", "1"):
        setenv("TRITIUM_FORCE_REF", force_ref)
        h, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.Float8CurrentScaling()):
            loss = te.linear_cross_entropy(h, ww, t, fp8=fp8)
        loss.backward()
        outs.append((loss.detach(), h.grad, ww.grad))
    (lk, hk, wk), (lr, hr, wr) = outs
    # the same casts; the FP8 GEMMs may differ (Triton vs cuBLASLt fast accumulation)
    torch.testing.assert_close(lk, lr, rtol=1e-4 if fp8 else 1e-5, atol=0)
    for got, want in ((hk, hr), (wk, wr)):
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
    # against the materialized bf16 logits, as an HF lm_head + F.cross_entropy computes them
    if not fp8:
        want = torch.nn.functional.cross_entropy((hid @ w.t()).float().reshape(-1, V),
                                                 t.reshape(-1))
        torch.testing.assert_close(lk, want, rtol=1e-5, atol=0)
