"""multigpu tier: tensor + sequence parallelism on 2 GPUs with NCCL (2 processes, spawned here).

The CPU tier's cases (tests/test_tensor_parallel.py, whose worker code this reuses) on CUDA in
bf16: the Triton kernels, cuBLASLt FP8 GEMMs and NCCL collectives (the FP8 all-gather of
sequence-parallel inputs among them). TP=2 vs the unsharded module built from the gathered
shards: high precision within TE's bf16 rtol with atol = 2^-7 * max|unsharded| (the partial
sums of row-parallel GEMMs are rounded to bf16 before the reduction, an ulp of the partial
sums, not of their possibly cancelling total); FP8 delayed scaling within 2% relative L2 error per
tensor (a bf16 rounding difference upstream of an fp8 cast can move a value by one fp8 step),
and the scales / amax histories bit-identical across ranks.

    pytest -q -m multigpu tests/gpu/test_gpu_tensor_parallel.py
"""
from __future__ import annotations

import os

import pytest
import torch

import test_tensor_parallel as cpu_tier
from testlib import BF16_TOL, spawn_results

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD = 2
CASES = ["linear-col/sp/fp8", "linear-row/tp/hp", "lnlinear/sp/fp8", "lnmlp-swiglu/sp/fp8",
         "lnmlp-gelu/tp/fp8", "mha/sp/hp", "layer-llama/sp/fp8", "layer-llama/sp/hp",
         "layer-te/tp/fp8"]


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        group = dist.group.WORLD
        res = {name: cpu_tier._module_case(name, group, WORLD, rank, f"cuda:{rank}",
                                           torch.bfloat16) for name in CASES}
        if rank == 0:
            torch.save({k: {kk: ([t.cpu() for t in vv] if isinstance(vv, list) else vv)
                            for kk, vv in v.items()} for k, v in res.items()},
                       os.path.join(out_dir, "results.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("tp_gpu"))


@pytest.mark.parametrize("name", CASES)
def test_tp2_nccl_matches_unsharded(results, name):
    res = results[name]
    assert res["roundtrip"]
    for i, (a, b) in enumerate(zip(res["got"], res["want"])):
        assert a.shape == b.shape and b.abs().max() > 0, (name, i)
        if name.endswith("hp"):
            tol = dict(rtol=BF16_TOL["rtol"], atol=2.0 ** -7 * float(b.float().abs().max()))
            torch.testing.assert_close(a.float(), b.float(), **tol,
                                       msg=lambda m: f"{name} tensor {i}: {m}")
        else:
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            assert rel < 0.02, (name, i, rel)
    if name.endswith("fp8"):
        assert res["same_across_ranks"] and res["scales_moved"]
