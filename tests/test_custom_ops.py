"""tritium's custom ops (tritium/ops) on the CPU path: the twins in tritium.ref behind each op.

For every call the functional layer makes through an op family (the table in
custom_op_cases.py: delayed and current scaling casts, the cast pair, fp8 norm / activation
outputs with and without transpose or high-precision copy, cross-entropy with the gradient in a
buffer or over the logits, the scaling update, the GEMM with bias or into a row block), the op
namespace gives what the eager call gives, bit for bit, writes the same state in place, and
`torch.library.opcheck` passes for each op it called. Then: each `_impl` site hands out the op
namespace under torch.compile, ScalingState.update takes the op there, the CUDA-graph cast
extras raise a clear error, and a compiled RMSNorm forward + backward has no graph break and
matches eager.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from custom_op_cases import CASES, IDS, check_case, check_compiled_rmsnorm
from tritium import ops
from tritium.fp8 import cast as fcast
from tritium.fp8.scaling import ScalingState
from tritium.functional import activation as fact
from tritium.functional import cross_entropy as fce
from tritium.functional import norm as fnorm
from tritium.functional import rope as frope
from tritium.recipe import DelayedScaling

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_matches_eager_and_passes_opcheck(case, randn):
    check_case(case, randn, "tritium.ref")


def _compiling():
    return mock.patch.object(torch.compiler, "is_compiling", return_value=True)


def test_sites_hand_out_the_ops_under_compile():
    x = torch.randn(4, 8)
    sites = [(fcast._impl, ops.cast), (fnorm._impl, ops.norm), (fnorm._impl_fp8, ops.norm),
             (fact._impl, ops.activation), (fact._impl_fp8, ops.activation),
             (frope._impl, ops.rope), (fce._impl, ops.cross_entropy)]
    for site, namespace in sites:
        assert site(x) is not namespace
        with _compiling():
            assert site(x) is namespace


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scaling_update_through_the_op(algo):
    recipe = DelayedScaling(margin=1, amax_history_len=4, amax_compute_algo=algo)
    states = [ScalingState(3, torch.float8_e4m3fn, recipe, torch.device("cpu")) for _ in "ab"]
    for step in range(3):
        row = torch.rand(3) * 10 ** step
        row[1] = 0.0 if step == 1 else row[1]  # a slot left alone for one step
        for s in states:
            s.amax_history[0].copy_(row)
        states[0].update()
        with _compiling(), mock.patch.object(ops.scaling, "delayed_scaling_update",
                                             wraps=ops.scaling.delayed_scaling_update) as spy:
            states[1].update()
        assert spy.call_count == 1
        assert torch.equal(states[1].amax_history, states[0].amax_history)
        assert torch.equal(states[1].scale, states[0].scale)
    assert not torch.equal(states[0].scale, torch.ones(3))


def test_cuda_graph_cast_extras_raise_under_compile():
    x, scale = torch.randn(16, 16), torch.ones(1)
    out = (torch.empty(16, 16, dtype=torch.float8_e4m3fn), None, torch.empty(1))
    with _compiling(), pytest.raises(NotImplementedError, match="skip=.*out=.*torch.compile"):
        fcast.cast_transpose(x, scale, None, torch.float8_e4m3fn, out=out)


def test_compiled_rmsnorm_forward_backward_has_no_graph_break(randn):
    check_compiled_rmsnorm(randn)
