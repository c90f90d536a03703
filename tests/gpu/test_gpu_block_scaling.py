"""gpu tier: block-scaled FP8 (Float8BlockScaling) on Hopper: the quantize kernel and the
block-scaled GEMM against their twins, the GEMM against fp64, and a Linear on the GPU against
the same Linear run by the CPU twins; MXFP8 emulation on the GPU.

Integer-valued fp8 operands (|v| <= 8) keep every 128-slice sum exact even in the tensor cores'
reduced-precision adder, and power-of-2 scales keep each promotion exact: there the kernel must
give the twin's bits. On random operands its error against fp64 of the dequantized operands
must stay far below FP8's quantization error (each slice is summed by the tensor cores in
reduced precision, ~1e-4 relative). The same holds for cuBLASLt's block-scaled GEMM
(`tritium.fp8.block.cublas_block_gemm_tn`, the default where it takes the operands).
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.kernels import block_cast as kcast
from tritium.kernels import block_gemm as kgemm
from tritium.ref import block_cast as rcast
from tritium.ref import block_gemm as rgemm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (TMA, FP8 wgmma)")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


@pytest.mark.parametrize("m,k", [(256, 512), (1000, 1040), (8192, 4096)])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", [None, (32, 4), (64, 8)])
def test_block_cast_kernel_equals_twin_on_gpu(m, k, block_2d, dtype, config):
    x = (torch.randn(m, k, device="cuda") * 10 ** (torch.rand(m, 1, device="cuda") * 6 - 3))
    x = x.to(dtype)
    got = kcast.quantize_blocks(x, E4M3, block_2d=block_2d, rowwise=True, columnwise=True,
                                config=config)
    want = rcast.quantize_blocks(x, E4M3, block_2d=block_2d, rowwise=True, columnwise=True)
    for name in rcast.BlockQuantized._fields:
        assert torch.equal(_bits(getattr(got, name)), _bits(getattr(want, name))), name


@pytest.mark.parametrize("m,n,k", [(128, 256, 128), (1040, 784, 528), (512, 14336, 4096)])
@pytest.mark.parametrize("b_block_2d", [False, True])
@pytest.mark.parametrize("a_dtype,out_dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16)])
def test_block_gemm_kernel_equals_twin_on_exact_sums(m, n, k, b_block_2d, a_dtype, out_dtype):
    kb = -(-k // 128)
    a = torch.randint(-8, 9, (m, k), device="cuda").float().to(a_dtype)
    b = torch.randint(-8, 9, (n, k), device="cuda").float().to(E4M3)
    sa = torch.exp2(torch.randint(-6, 7, (kb, m), device="cuda").float())
    sb = torch.exp2(torch.randint(-6, 7, (-(-n // 128), kb) if b_block_2d else (kb, n),
                                  device="cuda").float())
    got = kgemm.block_gemm_tn(a, b, sa, sb, out_dtype, b_block_2d=b_block_2d)
    want = rgemm.block_gemm_tn(a, b, sa, sb, out_dtype, b_block_2d=b_block_2d)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("m,n,k", [(128, 256, 512), (1040, 784, 1024), (512, 14336, 4096),
                                   (300, 256, 512)])
@pytest.mark.parametrize("b_block_2d", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cublas_block_gemm_equals_twin_on_exact_sums(m, n, k, b_block_2d, out_dtype):
    """cuBLASLt's block-scaled GEMM (the default where it takes the operands) on our scale
    grids, as `block_gemm_tn` hands them over: the twin's values on exact slice sums."""
    from tritium.fp8 import block as block_ops
    kb = k // 128
    a = torch.randint(-8, 9, (m, k), device="cuda").float().to(E4M3)
    b = torch.randint(-8, 9, (n, k), device="cuda").float().to(E4M3)
    sa = torch.exp2(torch.randint(-6, 7, (kb, m), device="cuda").float())
    sb = torch.exp2(torch.randint(-6, 7, (-(-n // 128), kb) if b_block_2d else (kb, n),
                                  device="cuda").float())
    assert block_ops._cublas_block_ok(a, b, sa, sb, b_block_2d)
    got = block_ops.cublas_block_gemm_tn(a, b, sa, sb, out_dtype, b_block_2d=b_block_2d)
    want = rgemm.block_gemm_tn(a, b, sa, sb, out_dtype, b_block_2d=b_block_2d)
    assert torch.equal(_bits(got), _bits(want))
    assert got.abs().amax() > 1  # real products, not zeros


def test_block_gemm_against_fp64_on_random_blocks():
    m, n, k = 1024, 2048, 4096
    x = torch.randn(m, k, device="cuda") * 10 ** (torch.rand(m, 1, device="cuda") * 4 - 2)
    w = torch.randn(n, k, device="cuda") * 0.02
    xq = kcast.quantize_blocks(x, E4M3)
    wq = kcast.quantize_blocks(w, E4M3, block_2d=True)
    got = kgemm.block_gemm_tn(xq.data, wq.data, xq.scale_inv, wq.scale_inv, torch.float32,
                              b_block_2d=True)
    xd = rcast.dequantize_blocks(xq.data, xq.scale_inv).double()
    wd = rcast.dequantize_blocks(wq.data, wq.scale_inv, block_2d=True).double()
    exact = xd @ wd.t()
    rel = ((got.double() - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
    assert rel < 1e-3, rel   # a wrong scale or slice would be O(1); FP8 quantization ~4e-2


@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(),
                               recipe.Float8BlockScaling(w_block_scaling_dim=1,
                                                         fp8_format=recipe.Format.HYBRID),
                               recipe.MXFP8BlockScaling()])
def test_linear_on_gpu_matches_the_cpu_twins(r):
    torch.manual_seed(0)
    layer = te.Linear(1024, 768, params_dtype=torch.bfloat16, device="cuda")
    x = (torch.randn(520, 1024, device="cuda") * 10 ** (torch.rand(520, 1, device="cuda") * 4 - 2)
         ).bfloat16().requires_grad_()
    dy = torch.randn(520, 768, device="cuda").bfloat16()
    cpu_layer = te.Linear(1024, 768, params_dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        cpu_layer.weight.copy_(layer.weight.cpu())
        cpu_layer.bias.copy_(layer.bias.cpu())
    x_cpu = x.detach().cpu().requires_grad_()
    outs = []
    for lay, inp, g in ((layer, x, dy), (cpu_layer, x_cpu, dy.cpu())):
        with te.fp8_autocast(fp8_recipe=r):
            y = lay(inp)
        y.backward(g)
        outs.append([y.detach().float().cpu(), inp.grad.float().cpu(),
                     lay.weight.grad.float().cpu()])
    for got, want in zip(*outs):  # slice sums in reduced precision vs fp32: bf16 rounding
        assert ((got - want).norm() / want.norm()) < 5e-3
    bf16 = torch.nn.functional.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
    assert ((outs[0][0].cuda() - bf16.float()).norm() / bf16.float().norm()) < 0.06
