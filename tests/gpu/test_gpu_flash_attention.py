"""gpu tier: tritium's Triton flash attention (16-bit q/k/v in, fp32 out/lse/dq/dk/dv out) at real
sizes against an fp64 reference on the same bf16 values, next to cuDNN (SDPA) bf16.

The point of the kernel (context-parallel exact mode): its fp32 partials must be much closer to
fp64 than cuDNN's bf16 results (max abs error < 0.1x cuDNN's, per tensor), and within fp32
reduction-order tolerance of fp64 (1e-4 x the tensor's max). B1 H12 D128 bf16, S 1024-4096,
causal and no_mask, GQA, s_q != s_kv (CP's half-q / half-kv blocks), and a backward fed a
merged (out, lse). Also: CP exact mode picks the kernel for these inputs. Skipped without CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch

from testlib import fp64_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 128
CASES = {  # s_q, s_kv, h, h_kv, causal
    "s1024-causal": (1024, 1024, 12, 12, True),
    "s4096-causal": (4096, 4096, 12, 12, True),
    "s2048-nomask": (2048, 2048, 12, 12, False),
    "s2048-causal-gqa": (2048, 2048, 12, 4, True),
    "q1024-kv2048-nomask": (1024, 2048, 12, 12, False),
    "q2048-kv1024-nomask-gqa": (2048, 1024, 12, 3, False),
    "s1000-causal-gqa": (1000, 1000, 12, 4, True),  # row tails in every kernel
}


def _cudnn(q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = q.shape[2] // k.shape[2]
    leaves = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(g, 2),
                                                      v.repeat_interleave(g, 2))]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in leaves), is_causal=causal).transpose(1, 2)
    o.backward(do)
    dq, dk, dv = (x.grad for x in leaves)
    b, s, h, d = dk.shape   # GQA: sum the group's bf16 grads in fp32, round once
    dk, dv = (x.float().view(b, s, h // g, g, d).sum(3).to(x.dtype) for x in (dk, dv))
    return [o.detach(), dq, dk, dv]


def _inputs(s_q, s_kv, h, h_kv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, n: torch.randn(1, s, n, D, device="cuda", generator=g,  # noqa: E731
                                  dtype=torch.bfloat16)
    return mk(s_q, h), mk(s_kv, h_kv), mk(s_kv, h_kv), mk(s_q, h)


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


def assert_as_close_as_cudnn(tag, got, ref, theirs):
    """got / theirs: (out, dq, dk, dv); ref: fp64_attention's (out, lse, dq, dk, dv). Each of
    got within 2x cuDNN's max abs error vs fp64."""
    for tname, x, r, c in zip(("out", "dq", "dk", "dv"), got, (ref[0], *ref[2:]), theirs):
        assert x.shape == r.shape, tname
        e, ec = _err(x, r), _err(c, r)
        print(f"{tag} {tname}: {e:.2e} vs cudnn {ec:.2e}")
        assert e < 2 * ec, tname


def speed_mode_as_close_as_cudnn(tag, q, k, v, do, causal):
    """The speed mode's fwd + bwd with q's dtype out / grads, each within 2x cuDNN's max abs
    error vs fp64 -> (out, dq, dk, dv)."""
    from tritium.kernels import flash_attention as FA
    scale, dt = 1 / math.sqrt(D), q.dtype
    out, lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=False, out_dtype=dt)
    grads = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=False,
                                   grad_dtype=dt)
    assert_as_close_as_cudnn(tag, (out, *grads), fp64_attention(q, k, v, do, causal, scale),
                             _cudnn(q, k, v, do, causal))
    return (out, *grads)


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_partials_beat_cudnn_vs_fp64(name):
    from tritium.kernels import flash_attention as FA
    s_q, s_kv, h, h_kv, causal = CASES[name]
    q, k, v, do = _inputs(s_q, s_kv, h, h_kv)
    scale = 1 / math.sqrt(D)
    out, lse = FA.flash_attention_fwd(q, k, v, causal, scale)
    dq, dk, dv = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
    ref = fp64_attention(q, k, v, do, causal, scale)
    ours = [out, lse, dq, dk, dv]
    for x, r in zip(ours, ref):
        assert x.dtype == torch.float32 and x.shape == r.shape
    theirs = _cudnn(q, k, v, do, causal) if s_q == s_kv or not causal else None
    report = []
    for i, tname in enumerate(("out", "lse", "dq", "dk", "dv")):
        e = _err(ours[i], ref[i])
        scale_t = ref[i].abs().max().item()
        assert e <= 1e-4 * scale_t, f"{tname}: {e:.3e} vs fp64 (max {scale_t:.3e})"
        if tname != "lse" and theirs is not None:
            ec = _err(theirs[i - (i > 1)], ref[i])
            report.append(f"{tname} {e:.2e} vs cudnn {ec:.2e}")
            assert e < 0.1 * ec, f"{tname}: ours {e:.3e} not << cuDNN bf16 {ec:.3e}"
    print(name, "; ".join(report))


def test_nosplit_is_a_16bit_kernel_without_the_final_rounding():
    from tritium.kernels import flash_attention as FA
    q, k, v, do = _inputs(2048, 2048, 12, 12, seed=1)
    scale = 1 / math.sqrt(D)
    ref = fp64_attention(q, k, v, do, True, scale)
    theirs = _cudnn(q, k, v, do, True)
    out, lse = FA.flash_attention_fwd(q, k, v, True, scale, split=False)
    grads = FA.flash_attention_bwd(do, q, k, v, out, lse, True, scale, split=False)
    assert_as_close_as_cudnn("nosplit", (out, *grads), ref, theirs)


def test_backward_with_merged_out_lse():
    """Two no-mask KV halves (a CP ring at cp=2 without the causal step): each half's backward
    fed the merged (out, lse) of both; the summed fp32 grads match the fp64 full-sequence ones."""
    from tritium.kernels import flash_attention as FA
    q, k, v, do = _inputs(2048, 4096, 12, 4, seed=2)
    scale = 1 / math.sqrt(D)
    parts = (slice(0, 2048), slice(2048, 4096))
    outs = [FA.flash_attention_fwd(q, k[:, p], v[:, p], False, scale) for p in parts]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    out = sum(o * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l in outs)
    dq = torch.zeros(q.shape, device="cuda")
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")
    for p in parts:
        g = FA.flash_attention_bwd(do, q, k[:, p], v[:, p], out, lse, False, scale)
        dq += g[0]
        dk[:, p] += g[1]
        dv[:, p] += g[2]
    ref = fp64_attention(q, k, v, do, False, scale)
    for tname, x, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert _err(x, r) <= 1e-4 * r.abs().max().item(), tname


def test_cp_exact_mode_uses_the_kernel():
    from tritium.attention.cp import _use_kernel
    q, k, v, _ = _inputs(256, 256, 4, 2)
    assert _use_kernel(q, k, v, 0.0, "auto")
    assert not _use_kernel(q, k, v, 0.1, "auto")            # dropout: old path
    assert not _use_kernel(q, k, v, 0.0, "efficient")       # forced backend: old path
    assert not _use_kernel(q.float(), k.float(), v.float(), 0.0, "auto")


# the speed mode's launch options (what benchmarks/bench_flash_attention.py --sweep chooses
# among), each on the D=128 path of the GPU: 16-bit out / grads like SDPA's
_SPEED_OPTIONS = {
    "default": {},
    "tma-ws": {"fwd": (128, 64, 8, 3, True, True), "dkdv": (64, 128, 8, 2, True),
               "dq": (128, 32, 8, 3, True)},
    "pointers": {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 8, 2), "dq": (128, 32, 8, 3)},
    "atomic-dq": {"dkdv": (32, 128, 8, 2, True, False, True)},
    "narrow-atomic-dq": {"fwd": (64, 64, 4, 3, True), "dkdv": (32, 64, 4, 3, True, False, True)},
}


@pytest.mark.parametrize("option", list(_SPEED_OPTIONS))
@pytest.mark.parametrize("name", ["s2048-causal-gqa", "q2048-kv1024-nomask-gqa",
                                  "s1000-causal-gqa"])
def test_speed_mode_options_16bit_outputs(name, option, monkeypatch):
    """split=False with bf16 out / grads, each launch option: as close to fp64 as cuDNN (max
    abs error < 2x cuDNN's per tensor; cuDNN on K/V repeated where GQA)."""
    from tritium.kernels import flash_attention as FA
    if "fwd" in _SPEED_OPTIONS[option]:   # the Triton forward's option: not the sm90 kernel
        monkeypatch.setattr(FA.sm90, "ENABLED", False)
    for kind, cfg in _SPEED_OPTIONS[option].items():
        monkeypatch.setitem(FA.GPU_CFG[kind], (D, False), FA.Cfg(*cfg))
    s_q, s_kv, h, h_kv, causal = CASES[name]
    q, k, v, do = _inputs(s_q, s_kv, h, h_kv, seed=3)
    got = speed_mode_as_close_as_cudnn(f"{option} {name}", q, k, v, do, causal)
    assert all(x.dtype == torch.bfloat16 for x in got)


def _packed(lens, h, h_kv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    mk = lambda n: torch.randn(t, n, D, device="cuda", generator=g,  # noqa: E731
                               dtype=torch.bfloat16)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    return (mk(h), mk(h_kv), mk(h_kv), mk(h)), (cu, cu, max(lens), max(lens))


@pytest.mark.parametrize("case", ["window-causal", "window-both", "bottom-right-q1024-kv2048",
                                  "varlen-causal", "varlen-window"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_band_and_varlen_match_twin(case, split):
    """Sliding windows, bottom-right causal and packed sequences (thd) on the GPU kernels
    (TMA loads for the bands, pointer loads for varlen) against the fp32 twin: fp32 partials
    (split) to 1e-4 of each tensor's max, the speed mode's bf16 results to 1e-2."""
    from tritium.kernels import flash_attention as FA
    from tritium.ref import flash_attention as R
    kw, causal = {}, True
    if case.startswith("varlen"):
        (q, k, v, do), kw["varlen"] = _packed([300, 1000, 17, 731, 1536], 8, 2, seed=4)
        if case == "varlen-window":
            kw["band"] = (-200, 0)
    else:
        s_q = 1024 if case.startswith("bottom") else 2048
        q, k, v, do = _inputs(s_q, 2048, 8, 2, seed=5)
        kw["band"] = {"window-causal": (-500, None), "window-both": (-300, 77),
                      "bottom-right-q1024-kv2048": (None, 1024)}[case]
        causal = case == "window-causal"
    scale = 1 / math.sqrt(D)
    dt = None if split else torch.bfloat16
    out, lse = FA.flash_attention_fwd(q, k, v, causal, scale, split=split, out_dtype=dt, **kw)
    grads = FA.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, split=split,
                                   grad_dtype=dt, **kw)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, scale, **kw)
    r_grads = R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, scale, **kw)
    tol = 1e-4 if split else 1e-2
    assert torch.equal(lse.isinf(), r_lse.isinf())
    for tname, x, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                           (r_out, r_lse, *r_grads)):
        x, r = x.float().nan_to_num(neginf=0.0), r.nan_to_num(neginf=0.0)
        assert x.shape == r.shape and r.abs().max() > 0
        e = (x - r).abs().max().item()
        assert e <= tol * r.abs().max().item(), f"{case} {tname}: {e:.3e}"
