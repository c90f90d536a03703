"""multigpu tier: the FP8 all-gather of block-scaled operands under sequence parallelism
(functional/block_sp.py) on 2 GPUs with NCCL (2 processes, spawned here).

The CPU tier's module cases (tests/test_tensor_parallel_block_sp.py, whose worker code this
reuses) on CUDA: the Triton block casts (fused into the norm where the gather is FP8), the
Triton block GEMM and NCCL's all-gathers of uint8 / fp32 blocks. With the FP8 gather every
output, input gradient and parameter gradient equals the high-precision gather's bit for bit:
both paths give the block GEMMs the same blocks (each rank's rows quantized alone are the
gathered tensor's blocks when the local tokens are whole 128-token blocks). The bytes each
rank gathers are those the CPU tier states.

    pytest -q -m multigpu tests/gpu/test_gpu_block_sp.py
"""
from __future__ import annotations

import os

import pytest
import torch

import test_tensor_parallel_block_sp as cpu_tier
from testlib import assert_bits, spawn_results

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD = 2
CASES = ["linear-col/bf16", "linear-row/bf16", "lnmlp-gelu/bf16", "lnlinear/fp32",
         "lnmlp-swiglu/fp32", "layer/fp32", "linear-col/fallback"]


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    from test_tensor_parallel_block import _Spy
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        group, spy = dist.group.WORLD, _Spy()
        res = {name: cpu_tier._module_case(name, group, WORLD, rank, spy, f"cuda:{rank}")
               for name in CASES}
        if rank == 0:
            for r in res.values():
                r["same"] = [(label, a.cpu(), b.cpu()) for label, a, b in r["same"]]
            torch.save(res, os.path.join(out_dir, "results.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # no NVLink multicast
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("block_sp_gpu"))


@pytest.mark.parametrize("name", CASES)
def test_fp8_block_gather_equals_hp_gather_on_nccl(results, name):
    res = results[name]
    assert len(res["same"]) > 2
    for label, got, want in res["same"]:
        assert got is not None and want.abs().max() > 0, (name, label)
        assert_bits(got, want, f"{name} {label}")


@pytest.mark.parametrize("name", CASES)
def test_fp8_block_gather_bytes_on_nccl(results, name):
    kind, how = name.split("/")
    res = results[name]
    sent = {k: tuple(sum(s) for s in v) for k, v in res["bytes"].items()}
    want = cpu_tier._expected_bytes(kind, how, res["tokens"], res["elt"])
    assert sent["hp"] == want["hp"], (name, sent, want)
    assert sent["fp8"] == (want["hp"] if how == "fallback" else want["fp8"]), (name, sent, want)
