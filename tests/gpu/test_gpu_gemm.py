"""gpu tier: the Triton FP8 GEMM (`tritium.kernels.gemm`) on Hopper tensor cores, against its
twin (`tritium.ref.gemm`), torch._scaled_mm (cuBLASLt) and an fp64 oracle; and the Linear's
choice of GEMM (TRITIUM_FP8_GEMM).

Precise accumulation on integer-valued operands (every partial sum exact even in the tensor
cores' reduced-precision adder) must give the twin's bits; with a bias and an fp32 output the
compiled epilogue is one FMA (one rounding), so there the oracle is the fp64 value rounded once
and the twin (two roundings) is one unit in the last place away at most. On random operands
each accumulation mode must be about as accurate as cuBLASLt's same mode, measured against
fp64: the tensor cores add fp8 products in reduced precision inside each K slice in both modes
(~1e-4 relative here), precise mode only keeps the sum across slices in fp32.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from testlib import fp8_linear_steps
from tritium import recipe
from tritium.kernels import gemm as kgemm
from tritium.kernels import small_gemm as ksmall
from tritium.ref import gemm as rgemm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("m,n,k", [(128, 256, 128), (1040, 784, 528), (16, 48, 4096)])
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_precise_gemm_equals_twin_on_exact_sums(m, n, k, a_dtype, b_dtype, out_dtype, bias):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randint(-8, 9, (m, k), device="cuda", generator=g).float().to(a_dtype)
    b = torch.randint(-8, 9, (n, k), device="cuda", generator=g).float().to(b_dtype)
    sa = torch.rand(1, device="cuda", generator=g) + 0.1
    sb = torch.rand(1, device="cuda", generator=g) * 3 + 0.01
    bias_t = torch.randn(n, device="cuda", generator=g).to(out_dtype) if bias else None
    got = kgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, bias_t, fast_accum=False)
    want = rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, bias_t)
    assert got.abs().max() > 0
    if bias and out_dtype == torch.float32:  # fma(acc, scale, bias): one rounding
        product = (a.double() @ b.double().t()) * (sa * sb).double()
        assert torch.equal(_bits(got), _bits((product + bias_t.double()).float()))
        # the twin rounds the product first: off by an ulp of the product (large under
        # cancellation with the bias) plus one of the result
        eps = torch.finfo(torch.float32).eps
        assert ((got.double() - want.double()).abs() <= eps * (product.abs() + want.abs())).all()
    else:
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("m,n,k", [(8192, 4096, 4096), (2000, 1024, 8192), (256, 512, 1040)])
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_as_accurate_as_cublas(m, n, k, a_dtype, b_dtype, fast_accum):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda", generator=g) * 4).to(a_dtype)
    b = (torch.randn(n, k, device="cuda", generator=g) * 4).to(b_dtype)
    sa, sb = torch.full((1,), 0.37, device="cuda"), torch.full((1,), 1.9, device="cuda")
    exact = (a.double() @ b.double().t()) * (0.37 * 1.9)
    ours = kgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32, fast_accum=fast_accum)
    cublas = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                              use_fast_accum=fast_accum)
    twin = rgemm.fp8_gemm_tn(a, b, sa, sb, torch.float32)

    def err(x):
        return ((x.double() - exact).norm() / exact.norm()).item()
    assert err(ours) <= 2 * err(cublas) + 1e-7, (err(ours), err(cublas))
    assert err(ours) < (1e-2 if fast_accum else 1e-3) and err(twin) < 1e-6


@pytest.mark.parametrize("m,n,k", [(1040, 784, 528), (256, 2048, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_pad", [16, 3])
def test_accumulating_gemm_equals_twin_on_exact_sums(m, n, k, out_dtype, row_pad):
    """out += a @ b.T (the FP8 lm_head's wgrad over chunks, an fp32 main_grad): on the Triton
    kernel where out's rows are 16-byte aligned (row_pad 16), else (row_pad 3) the fp32 product
    added by PyTorch. Each element is the twin's (the scaled product rounded to fp32, then the
    sum) or, where the compiler fuses scale and add into one FMA, that single rounding; then the
    output dtype's. Rows and columns outside out untouched."""
    from tritium.functional import gemm as fgemm
    g = torch.Generator(device="cuda").manual_seed(m + n + k + row_pad)
    a = torch.randint(-8, 9, (m, k), device="cuda", generator=g).float().to(E4M3)
    b = torch.randint(-8, 9, (n, k), device="cuda", generator=g).float().to(E5M2)
    sa = torch.rand(1, device="cuda", generator=g) + 0.1
    sb = torch.rand(1, device="cuda", generator=g) * 3 + 0.01
    full = torch.randn(m + 32, n + row_pad, device="cuda", generator=g).to(out_dtype)
    want = full.clone()
    old = full[16:16 + m, :n].double()
    fgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, out=full[16:16 + m, :n], accumulate=True)
    rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype, out=want[16:16 + m, :n], accumulate=True)
    assert not torch.equal(want[16:16 + m, :n], rgemm.fp8_gemm_tn(a, b, sa, sb, out_dtype))
    fused = want.clone()
    fused[16:16 + m, :n] = ((a.double() @ b.double().t()) * (sa * sb).double() + old).float()
    same = (_bits(full) == _bits(want)) | (_bits(full) == _bits(fused))
    assert same.all(), f"{(~same).sum().item()} elements differ"


def _linear_gemm_choice(setenv, monkeypatch, tokens, in_features, out_features, rec=None):
    """Two FP8 steps of a Linear (delayed scaling unless `rec`) under TRITIUM_FP8_GEMM=auto
    and then =cublas: (the Triton kernel's GEMMs under auto, as their fast_accum flags, a
    one-launch form's two GEMMs each; auto's results, with the bwd amax history last; cublas's
    results, where the Triton kernels must not run; the one-launch forms' launches under auto
    by name). The results agree to the accumulators' precision; the cast of dy records the
    same amaxes fused into the GEMMs' launch as alone."""
    calls, launches = [], []
    # the one-launch forms: their GEMMs' fast_accum flags (the backward's two are precise)
    flags = {"fp8_gemm_tn_pair": [False, False], "fp8_dgrad_wgrad": [False, False],
             "fp8_gemm_tn_cast_ab": [True], "fp8_gemm_tn_cast_b": [True]}
    real = {name: getattr(ksmall, name) for name in flags}
    real_gemm = kgemm.fp8_gemm_tn
    monkeypatch.setattr(kgemm, "fp8_gemm_tn",
                        lambda *a, **k: calls.append(a[6] if len(a) > 6 else k["fast_accum"])
                        or real_gemm(*a, **k))
    for name in real:
        def one_launch(*a, _name=name, **k):
            calls.extend(flags[_name])
            launches.append(_name)
            return real[_name](*a, **k)
        monkeypatch.setattr(ksmall, name, one_launch)
    torch.manual_seed(0)
    layer = te.Linear(in_features, out_features, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    rec = rec or recipe.DelayedScaling(amax_history_len=4)

    def run():
        layer.fp8_meta = type(layer.fp8_meta)(2, 1)
        res = fp8_linear_steps(layer, x, dy, rec, steps=2)
        bwd = layer.fp8_meta.bwd
        return (*res, None if bwd is None else bwd.amax_history.clone())
    auto = run()
    auto_calls, auto_launches = list(calls), list(launches)
    setenv("TRITIUM_FP8_GEMM", "cublas")
    calls.clear()
    cublas = run()
    assert calls == []
    for got, want in zip(auto[:4], cublas[:4]):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    if auto[4] is not None:
        assert auto[4].abs().max() > 0 and torch.equal(auto[4], cublas[4])
    return auto_calls, auto, cublas, auto_launches


def test_linear_runs_fprop_on_the_triton_gemm_by_default(setenv, monkeypatch):
    """auto: fprop (fast accumulation) on the Triton kernel, dgrad/wgrad on cuBLASLt (GEMMs
    above HOST_BOUND_MACS); the results agree with TRITIUM_FP8_GEMM=cublas to the fast
    accumulator's precision."""
    calls, auto, cublas, launches = _linear_gemm_choice(setenv, monkeypatch, 1000, 1024, 768)
    assert calls == [True, True], "expected the Triton kernel for the two forward GEMMs only"
    assert launches == []
    assert torch.equal(auto[1], cublas[1]), "dgrad is the same cuBLASLt call on the same bits"


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_small_linear_runs_every_gemm_on_triton(setenv, monkeypatch, scaling):
    """auto: a Linear whose GEMMs are at most HOST_BOUND_MACS multiply-adds (256 tokens,
    512 -> 640) runs fprop, dgrad and wgrad on the Triton kernels (host-bound: a launch is the
    cheaper call), dgrad and wgrad in one launch; the forward casts x and the weight in its
    GEMM's launch and the backward casts dy in its (delayed scaling: the same amaxes recorded;
    current scaling: after the launch that measures the amaxes); the results agree with
    TRITIUM_FP8_GEMM=cublas."""
    from tritium.ops import gemm as ops_gemm
    assert 256 * 640 * 512 <= ops_gemm.HOST_BOUND_MACS < 1000 * 1024 * 768
    rec = recipe.Float8CurrentScaling() if scaling == "current" else None
    calls, _, _, launches = _linear_gemm_choice(setenv, monkeypatch, 256, 512, 640, rec)
    assert sorted(calls) == [False] * 4 + [True] * 2  # per step: fprop fast, dgrad and wgrad
    assert launches == ["fp8_gemm_tn_cast_ab", "fp8_dgrad_wgrad"] * 2, \
        "one launch for the forward's casts and GEMM, one for the backward's"


def test_small_layernorm_linear_casts_its_weight_in_the_gemm(setenv, monkeypatch):
    """Delayed scaling, 256 tokens, 512 -> 640, the input in fp8 from the norm's fused cast:
    the forward GEMM casts the weight in its own launch (`fp8_gemm_tn_cast_b`, no weight cast
    launch); outputs and grads agree with TRITIUM_FP8_GEMM=cublas (the weight cast alone,
    cuBLASLt's GEMMs) to the accumulators' precision, and both FP8 states (the weight's amax
    among them) bit for bit."""
    import copy
    launches, real = [], ksmall.fp8_gemm_tn_cast_b
    monkeypatch.setattr(ksmall, "fp8_gemm_tn_cast_b",
                        lambda *a, **k: launches.append(a[2].shape) or real(*a, **k))
    torch.manual_seed(0)
    layers = [te.LayerNormLinear(512, 640, params_dtype=torch.bfloat16, device="cuda")]
    layers.append(copy.deepcopy(layers[0]))
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 640, device="cuda", dtype=torch.bfloat16)
    rec = recipe.DelayedScaling(amax_history_len=4)
    auto = fp8_linear_steps(layers[0], x, dy, rec, steps=2)
    assert launches == [(640, 512)] * 2
    setenv("TRITIUM_FP8_GEMM", "cublas")
    launches.clear()
    cublas = fp8_linear_steps(layers[1], x, dy, rec, steps=2)
    assert launches == []
    for got, want in zip(auto, cublas):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    for name in ("fwd", "bwd"):
        a, b = (getattr(layer.fp8_meta, name) for layer in layers)
        assert a.amax_history.abs().max() > 0
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
