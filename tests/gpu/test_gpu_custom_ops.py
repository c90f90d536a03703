"""gpu tier: tritium's custom ops (tritium/ops) with the CUDA kernels behind them.

The table of custom_op_cases.py on CUDA tensors: each op namespace gives what the eager call
(the Triton launcher, or for the GEMM the Triton kernel / cuBLASLt choice) gives, bit for bit,
writes the same state, and passes `torch.library.opcheck`. Then compiled steps with inductor:
an RMSNorm forward + backward, and a delayed-scaling FP8 cast + GEMM + scaling update, equal
eager bit for bit (the ops are opaque calls in inductor's code, so nothing around them may
change a bit either).
"""
from __future__ import annotations

import pytest
import torch

from custom_op_cases import CASES, IDS, check_case, check_compiled_rmsnorm
from tritium import _device
from tritium.fp8 import cast as fcast
from tritium.fp8.scaling import ScalingState
from tritium.functional import norm as fnorm
from tritium.functional.gemm import fp8_gemm_tn
from tritium.recipe import DelayedScaling

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _fp8_gemm_cases_need_tensor_cores(case):
    if "gemm" in case.name and not _device.fp8_tensor_cores(torch.empty(1, device="cuda")):
        pytest.skip("FP8 tensor cores needed (compute capability >= 8.9)")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_matches_eager_kernel_and_passes_opcheck(case, randn):
    _fp8_gemm_cases_need_tensor_cores(case)
    check_case(case, randn, "tritium.kernels", device="cuda")


def test_compiled_rmsnorm_runs_the_kernel_ops(randn):
    check_compiled_rmsnorm(randn, device="cuda")


def test_inductor_rmsnorm_forward_backward_equals_eager(randn):
    x = randn(64, 256, dtype=torch.bfloat16).cuda().requires_grad_(True)
    w = (randn(256) + 1.0).cuda().requires_grad_(True)
    dy = randn(64, 256, dtype=torch.bfloat16).cuda()

    def step(x, w):
        return fnorm.rms_norm(x, w, 1e-5)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x, w)
    got = (got, *torch.autograd.grad(got, (x, w), dy))
    want = step(x, w)
    want = (want, *torch.autograd.grad(want, (x, w), dy))
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_inductor_fp8_cast_gemm_and_scaling_update_equal_eager(randn):
    if not _device.fp8_tensor_cores(torch.empty(1, device="cuda")):
        pytest.skip("FP8 tensor cores needed (compute capability >= 8.9)")
    recipe = DelayedScaling(amax_history_len=4)
    x, w = randn(128, 256).cuda().bfloat16(), randn(64, 256).cuda().bfloat16()
    states = [ScalingState(2, torch.float8_e4m3fn, recipe, torch.device("cuda")) for _ in "ab"]

    def step(x, w, state):
        xq, _, x_si = fcast.quantize_2d(x, torch.float8_e4m3fn, scale=state.scale_slot(0),
                                        amax=state.amax_slot(0), current=None)
        wq, _, w_si = fcast.quantize_2d(w, torch.float8_e4m3fn, scale=state.scale_slot(1),
                                        amax=state.amax_slot(1), current=None)
        out = fp8_gemm_tn(xq, wq, x_si, w_si, torch.bfloat16, fast_accum=True)
        state.update()
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for i in range(3):  # scales change between steps: the update feeds the next cast
        got, want = compiled(x * (i + 1), w, states[0]), step(x * (i + 1), w, states[1])
        assert torch.equal(got, want)
        assert torch.equal(states[0].scale, states[1].scale)
        assert torch.equal(states[0].amax_history, states[1].amax_history)
    assert not torch.equal(states[0].scale, torch.ones(2, device="cuda"))
