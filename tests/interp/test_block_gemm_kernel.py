"""`tritium.kernels.block_gemm.block_gemm_tn` == `tritium.ref.block_gemm.block_gemm_tn`, bits.

Integer-valued fp8 operands (|v| <= 8) make every 128-slice sum an integer far below 2^24, and
power-of-2 scales make each scaled slice and the running fp32 sum exact: then the kernel and
its twin must agree in every bit whatever the order of the sums. Shapes cross the 128 K slices
(partial last slice) and the interpreter's 16x32 tiles; both weight-scale layouts (1x128 rows,
128x128 blocks) and a bias are covered.
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import block_gemm as kgemm
from tritium.ref import block_gemm as rgemm

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _integer_fp8(rows, cols, dtype, gen):
    return torch.randint(-8, 9, (rows, cols), generator=gen).to(torch.float32).to(dtype)


def _pow2(shape, gen):
    return torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())


@pytest.mark.parametrize("m,n,k", [(16, 32, 128), (48, 160, 272), (40, 136, 400)])
@pytest.mark.parametrize("b_block_2d", [False, True])
@pytest.mark.parametrize("a_dtype,out_dtype,bias", [(E4M3, torch.float32, False),
                                                    (E5M2, torch.bfloat16, True)])
def test_block_gemm_kernel_equals_ref_bits(m, n, k, b_block_2d, a_dtype, out_dtype, bias, gen):
    kb = -(-k // 128)
    a, b = _integer_fp8(m, k, a_dtype, gen), _integer_fp8(n, k, E4M3, gen)
    sa = _pow2((kb, m), gen)
    sb = _pow2((-(-n // 128), kb) if b_block_2d else (kb, n), gen)
    bias_t = torch.randn(n, generator=gen).to(out_dtype) if bias else None
    got = kgemm.block_gemm_tn(a, b, sa, sb, out_dtype, bias_t, b_block_2d=b_block_2d)
    want = rgemm.block_gemm_tn(a, b, sa, sb, out_dtype, bias_t, b_block_2d=b_block_2d)
    assert got.abs().max() > 0
    assert_same_bits(got, want, f"{m}x{n}x{k} 2d={b_block_2d}")


def test_block_gemm_ref_is_the_sum_of_scaled_slices(gen):
    """The twin against a plain formula: dequantize per block, then one fp64 matmul."""
    m, n, k = 24, 200, 300
    a, b = _integer_fp8(m, k, E4M3, gen), _integer_fp8(n, k, E4M3, gen)
    sa, sb = _pow2((3, m), gen), _pow2((2, 3), gen)
    a_deq = a.double() * sa.double().t().repeat_interleave(128, 1)[:, :k]
    b_deq = b.double() * sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    want = (a_deq @ b_deq.t()).float()
    assert torch.equal(rgemm.block_gemm_tn(a, b, sa, sb, torch.float32, b_block_2d=True), want)
