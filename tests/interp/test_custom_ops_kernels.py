"""tritium's custom ops (tritium/ops) with the Triton kernels behind them, under the interpreter.

The table of custom_op_cases.py again (every call the functional layer makes through an op
family), now with TRITON_INTERPRET=1 so each op runs the kernel launcher the eager site runs:
the op namespace gives the eager call's results and in-place writes bit for bit, and
`torch.library.opcheck` passes for each op called (its fake outputs match the kernels' real
ones). Then a compiled RMSNorm forward + backward is one graph with the kernels' ops in it and
equals eager. (The FP8 GEMM's Triton kernel needs FP8 tensor cores, so on the CPU its op runs the
emulated GEMM, as eager does.)
"""
from __future__ import annotations

import pytest

from custom_op_cases import CASES, IDS, check_case, check_compiled_rmsnorm

pytestmark = [pytest.mark.interp,  # the interpreter's deprecated numpy paths and inf arithmetic
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_matches_eager_kernel_and_passes_opcheck(case, randn):
    check_case(case, randn, "tritium.kernels")


def test_compiled_rmsnorm_runs_the_kernel_ops(randn):
    check_compiled_rmsnorm(randn)
