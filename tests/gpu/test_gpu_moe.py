"""gpu tier: the grouped FP8 kernels, GroupedLinear and te.MoE on a Hopper GPU.

The grouped GEMMs in precise accumulation on integer-valued operands give their twins' bits
(every partial sum exact), the cuBLASLt per-group loops (the default for dgrad and wgrad) the
same values up to one rounding of the scales' product; with a bias and an fp32 output the
compiled epilogue is one FMA, so there the oracle is the fp64 value rounded once (as
tests/gpu/test_gpu_gemm.py explains); fast accumulation agrees with fp64 to the tensor cores' accumulator precision. The grouped cast gives
its twin's bits. GroupedLinear under FP8 (kernels) agrees with the same module on the twins
(TRITIUM_FORCE_REF=1) to bf16 rounding, including an empty expert and odd row counts; the MoE
layer on the kernels is as close to the unquantized layer as on the twins (see its test on why
not element by element).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.kernels import grouped_gemm as kg
from tritium.ref import grouped_gemm as rg

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [[300, 0, 1024, 17, 129], [4096] * 4, [0, 0, 77]]


def _int_fp8(shape, dtype, g):
    return torch.randint(-8, 9, shape, device="cuda", generator=g).float().to(dtype)


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", kg.VARIANTS)
def test_grouped_gemm_precise_equals_twin(splits, out_dtype, variant):
    cfg = (*kg.CONFIGS["precise"][:6], variant)
    g = torch.Generator(device="cuda").manual_seed(sum(splits))
    n, k = 784, 528
    offsets = rg.make_offsets(splits, "cuda")
    a = _int_fp8((sum(splits), k), E5M2, g)
    b = _int_fp8((len(splits), n, k), E4M3, g)
    sa = torch.rand(len(splits), device="cuda", generator=g) + 0.1
    sb = torch.rand(len(splits), device="cuda", generator=g) * 3 + 0.01
    got = kg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype, m_splits=splits, config=cfg)
    want = rg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype)
    assert torch.equal(_bits(got), _bits(want))
    # a bias in fp32: one FMA, the fp64 value rounded once
    bias = torch.randn(len(splits), n, device="cuda", generator=g)
    got = kg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, torch.float32, bias, m_splits=splits,
                                 config=cfg)
    r0 = 0
    for e, rows in enumerate(splits):
        prod = a[r0:r0 + rows].double() @ b[e].double().t()
        oracle = (prod * (sa[e] * sb[e]).double() + bias[e].double()).float()
        assert torch.equal(_bits(got[r0:r0 + rows]), _bits(oracle))
        r0 += rows


@pytest.mark.parametrize("splits", [[4096] * 4, [1024, 0, 2048]])
@pytest.mark.parametrize("variant", kg.VARIANTS)
def test_grouped_gemm_fast_accum_as_accurate_as_cublas(splits, variant):
    """Fast accumulation keeps K in the tensor cores' narrow accumulator: per expert, the error
    against fp64 is compared with cuBLASLt's fast mode (torch._scaled_mm) on the same operands."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n, k = 1024, 4096
    offsets = rg.make_offsets(splits, "cuda")
    a = torch.randn(sum(splits), k, device="cuda", generator=g).to(E4M3)
    b = (torch.randn(len(splits), n, k, device="cuda", generator=g) * 0.05).to(E4M3)
    one = torch.ones(len(splits), device="cuda")
    got = kg.grouped_fp8_gemm_tn(a, b, one, one, offsets, torch.float32, fast_accum=True,
                                 m_splits=splits, config=(*kg.CONFIGS["fast"][:6], variant))
    r0 = 0
    for e, rows in enumerate(splits):
        if rows:
            exact = a[r0:r0 + rows].double() @ b[e].double().t()
            cublas = torch._scaled_mm(a[r0:r0 + rows], b[e].t(), scale_a=one[:1],
                                      scale_b=one[:1], out_dtype=torch.float32,
                                      use_fast_accum=True)
            ours_err = (got[r0:r0 + rows].double() - exact).abs().max()
            cublas_err = (cublas.double() - exact).abs().max()
            assert ours_err <= 2 * cublas_err + 1e-6 * exact.abs().max()
        r0 += rows


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("variant", kg.VARIANTS)
def test_grouped_wgrad_equals_twin(splits, variant):
    g = torch.Generator(device="cuda").manual_seed(5)
    n, k = 528, 784
    offsets = rg.make_offsets(splits, "cuda")
    padded = sum(-(-r // 16) * 16 for r in splits)
    a_t = _int_fp8((n * padded,), E5M2, g)
    b_t = _int_fp8((k * padded,), E4M3, g)
    sa = torch.rand(len(splits), device="cuda", generator=g) + 0.1
    sb = torch.rand(len(splits), device="cuda", generator=g) + 0.1
    for dtype in (torch.float32, torch.bfloat16):
        got = kg.grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, dtype,
                                        config=(*kg.CONFIGS["wgrad"][:6], variant))
        want = rg.grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, dtype)
        assert torch.equal(_bits(got), _bits(want))


def _zero_padding(flat, rows_per_group, splits):
    """The grouped cast's contract: the 16-padded columns of each transposed block are 0."""
    o = rg.make_offsets(splits, "cpu").tolist()
    for e, rows in enumerate(splits):
        p0, p1 = o[1][e], o[1][e + 1]
        flat[rows_per_group * p0:rows_per_group * p1].view(rows_per_group, p1 - p0)[:, rows:] = 0
    return flat


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cublas_per_group_gemms_equal_twin(splits, out_dtype):
    """The cuBLASLt loops (precise dgrad and wgrad by default) on exact integer products: the
    twin's values up to the order of the two scale multiplications (one rounding: 1 ulp)."""
    from tritium.ops import grouped_gemm as og
    g = torch.Generator(device="cuda").manual_seed(len(splits))
    n, k = 784, 528
    offsets = rg.make_offsets(splits, "cuda")
    sa = torch.rand(len(splits), device="cuda", generator=g) + 0.1
    sb = torch.rand(len(splits), device="cuda", generator=g) * 3 + 0.01
    tol = dict(rtol=2 ** -22 if out_dtype == torch.float32 else 2 ** -7, atol=0)
    a = _int_fp8((sum(splits), k), E5M2, g)
    b = _int_fp8((len(splits), n, k), E4M3, g)
    got = og.cublas_grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype, m_splits=splits)
    torch.testing.assert_close(got, rg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype),
                               **tol)
    padded = sum(-(-r // 16) * 16 for r in splits)
    a_t = _zero_padding(_int_fp8((n * padded,), E5M2, g).view(torch.uint8), n, splits)
    b_t = _zero_padding(_int_fp8((k * padded,), E4M3, g).view(torch.uint8), k, splits)
    a_t, b_t = a_t.view(E5M2), b_t.view(E4M3)
    got = og.cublas_grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, out_dtype,
                                           m_splits=splits)
    want = rg.grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, out_dtype)
    torch.testing.assert_close(got, want, **tol)
    assert got.abs().amax() > 100  # real products, not zeros


@pytest.mark.parametrize("current", [False, True])
def test_grouped_cast_equals_twin(current):
    g = torch.Generator(device="cuda").manual_seed(9)
    splits = [300, 0, 1024, 17]
    offsets = rg.make_offsets(splits, "cuda")
    x = torch.randn(sum(splits), 4096, device="cuda", generator=g).to(torch.bfloat16) * 3
    scale = torch.rand(8, device="cuda", generator=g) * 40 + 1
    outs = []
    for impl in (kg, rg):
        if current:
            amax = torch.zeros(4, device="cuda")
            impl.grouped_amax_into(x, offsets, amax)
            res = impl.grouped_cast_transpose(x, offsets, None, amax, E5M2, write_transpose=True,
                                              current=(0.0, False), m_splits=splits)
        else:
            amax = torch.zeros(2, 8, device="cuda")[0, 0::2]
            res = impl.grouped_cast_transpose(x, offsets, scale[0::2], amax, E4M3,
                                              write_transpose=True, m_splits=splits)
        outs.append((res, amax))
    (gk, ak), (gr, ar) = outs
    assert torch.equal(ak, ar)
    assert torch.equal(_bits(gk[0]), _bits(gr[0])) and torch.equal(gk[2], gr[2])
    o = offsets.tolist()
    for e, rows in enumerate(splits):  # each group's written transposed block
        p0, p1 = o[1][e], o[1][e + 1]
        blk_k = gk[1][4096 * p0:4096 * p1].view(4096, p1 - p0)[:, :rows]
        blk_r = gr[1][4096 * p0:4096 * p1].view(4096, p1 - p0)[:, :rows]
        assert torch.equal(_bits(blk_k), _bits(blk_r))
        # the kernel's 16-byte stores run to the padded end, writing zeros past m_g
        assert torch.all(gk[1][4096 * p0:4096 * p1].view(4096, p1 - p0)[:, rows:].float() == 0)


def _steps(module, xs, dys, rcp, **kw):
    outs = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_()
        with te.fp8_autocast(enabled=rcp is not None, fp8_recipe=rcp):
            y = module(x, **kw)
        y.backward(dy)
        outs.append([y.detach().float(), x.grad.float()])
    return outs[-1] + [p.grad.float() for p in module.parameters()]


@pytest.mark.parametrize("rcp", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_grouped_linear_fp8_kernels_match_twins(rcp, setenv):
    torch.manual_seed(0)
    splits = [300, 0, 1024, 17, 129]
    layer = te.GroupedLinear(5, 512, 768, params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(layer)
    xs = [torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dys = [torch.randn(sum(splits), 768, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    got = _steps(layer, xs, dys, rcp, m_splits=splits)
    setenv("TRITIUM_FORCE_REF", "1")
    want = _steps(twin, xs, dys, rcp, m_splits=splits)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_moe_fp8_kernels_match_twins(setenv):
    """The MoE's FP8 kernels against the twins, judged against the unquantized layer.

    Not element by element: the kernels' fprop accumulates fast (the tensor cores' narrow
    accumulator, ~1e-4 relative), the twin's exactly, so h and the activation differ in their
    last bits; an element of the next FP8 operand that sits near a rounding boundary then
    rounds the other way (one e5m2 step is 25%), and with current scaling a shifted amax moves
    that group's whole grid. One such flip on a large element moves a row of the next GEMM's
    output by a few percent: on the GPU 4 of 1M elements of y/dx were 1.4x past a 3%-of-max
    tolerance. Emulated on the CPU (the twins with 1e-5..1e-3 relative noise on the fast-accum
    outputs) the same flips give such outliers, and the kernel-twin difference stays at
    0.4-1.4% in norm while FP8 itself is 7-9% away from the fp32 layer. So: per tensor, the
    kernels' result is as close to the fp32 layer as the twins' (a wrong row, group or scale
    would be tens of percent off), and kernels and twins agree to 3% in norm."""
    torch.manual_seed(1)
    # fp32 router logits: no ties, so the kernel and torch.topk pick the same experts
    moe = te.MoE(1024, 512, te.MoEConfig(num_experts=8, topk=2), normalization="RMSNorm",
                 device="cuda")
    twin, plain = copy.deepcopy(moe), copy.deepcopy(moe)
    x = [torch.randn(1000, 1024, device="cuda")]
    dy = [torch.randn(1000, 1024, device="cuda")]
    exact = _steps(plain, x, dy, None)
    got = _steps(moe, x, dy, recipe.Float8CurrentScaling())
    setenv("TRITIUM_FORCE_REF", "1")
    want = _steps(twin, x, dy, recipe.Float8CurrentScaling())
    for a, b, r in zip(got, want, exact):
        assert _rel(b, r) > 0.01  # FP8 really ran on both sides
        assert _rel(a, r) <= 1.1 * _rel(b, r) + 2e-3
        assert _rel(a, b) <= 3e-2
