"""cpu tier: benchmarks/harness.py's arithmetic: kernel_summary's interval helpers, and the paired
ratios of interleaved rounds.

NCCL time "beside no compute" is the part of the NCCL kernels' union that no compute kernel
covers; checked against a brute-force count on a fine grid, on random intervals."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def _harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _spans(rng, n):
    out = []
    for _ in range(n):
        a = rng.randrange(0, 200)
        out.append((a, a + rng.randrange(1, 30)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_exposed_length_matches_a_grid_count(seed):
    h = _harness()
    rng = random.Random(seed)
    comm, compute = _spans(rng, rng.randrange(1, 12)), _spans(rng, rng.randrange(0, 12))
    merged_comm, merged_compute = h._merged(comm), h._merged(compute)
    in_comm = {t for a, b in comm for t in range(a, b)}
    in_compute = {t for a, b in compute for t in range(a, b)}
    assert sum(b - a for a, b in merged_comm) == len(in_comm)
    assert all(merged_comm[i][1] < merged_comm[i + 1][0] for i in range(len(merged_comm) - 1))
    assert h._length_outside(merged_comm, merged_compute) == len(in_comm - in_compute)


def test_nccl_kernel_kinds():
    h = _harness()
    assert h.nccl_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "AllGather"
    assert h.nccl_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "ReduceScatter"
    assert h.nccl_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "AllReduce"
    assert h.nccl_kind("ncclDevKernel_Reduce_Sum_f32_RING_LL") == "Reduce"
    assert h.nccl_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "SendRecv"
    assert h.nccl_kind("ncclKernel_Generic") == "other"


def test_kernel_summary_splits_exposed_nccl_time_by_collective():
    """A made-up profile: compute [0, 10) and [20, 30) us, an all-gather [5, 25) (10 us beside
    no compute), a reduce-scatter [28, 40) (10 us beside no compute), over 2 steps."""
    h = _harness()

    class Ev:
        device_type = h.torch.autograd.DeviceType.CUDA

        def __init__(self, name, a, b):
            self.name, self.device_time = name, b - a
            self.time_range = type("R", (), {"start": a, "end": b})

    class Prof:
        def events(self):
            return [Ev("gemm", 0, 10), Ev("gemm", 20, 30),
                    Ev("ncclDevKernel_AllGather_RING_LL", 5, 25),
                    Ev("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 28, 40)]
    ks = h.kernel_summary(Prof(), steps=2)
    assert ks.busy == pytest.approx(20 / 1e3 / 2)
    assert ks.nccl == pytest.approx(32 / 1e3 / 2)
    assert ks.nccl_exposed == pytest.approx(20 / 1e3 / 2)
    assert ks.exposed_by_kind == pytest.approx({"AllGather": 10 / 1e3 / 2,
                                                "ReduceScatter": 10 / 1e3 / 2})


def test_launch_env_is_recorded_and_shown(monkeypatch):
    """Result files say which launch settings were set (harness.env_info), and the report's run
    line shows them."""
    from tritium import bench_report as br
    h = _harness()
    for name in h.LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "launch_env" not in h.env_info()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("NOT_A_LAUNCH_SETTING", "x")
    env = h.env_info()
    assert env["launch_env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    line = br.describe({"kind": "2 x NVIDIA H200", "file": "f.json",
                        "env": {"date": "2026-11-27", "commit": "abc1234", **env}})
    assert "launched with `CUDA_DEVICE_MAX_CONNECTIONS=1`" in line


def test_paired_speedups_cancel_a_drift_between_rounds():
    """Steps 1.25x apart in four rounds of five (in round 3 the bf16 step caught a fast
    moment), timed while the host's speed moves between rounds (round 2 at half speed, round 4
    at two thirds): each round's ratio is read, so their median is 1.25; the ratio of the two
    medians (taken from different rounds) is 15.0 / 10.4 = 1.44."""
    harness = _harness()
    seen = {"fp8": [12.5, 25.0, 15.0, 18.75, 13.0], "bf16": [10.0, 20.0, 10.0, 15.0, 10.4]}
    assert harness.paired_speedups(seen, "fp8") == {"fp8": 1.0, "bf16": 1.25}
    medians = harness.median_ms(seen)
    assert medians == {"fp8": 15.0, "bf16": 10.4}


def test_device_syncs_counts_sync_warnings_by_line(monkeypatch):
    """device_syncs turns sync-debug mode on around fn, counts its sync warnings per line
    (other warnings ignored) and restores the previous mode even when fn raises."""
    import warnings

    import torch
    harness = _harness()
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    n = random.randrange(2, 6)

    def step():
        for _ in range(n):
            warnings.warn("called a synchronizing CUDA operation")  # one line, n times
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")

    sites = harness.device_syncs(step)
    assert modes == ["warn", 0]
    assert list(sites.values()) == [n, 1]  # in the order first seen
    assert all(s.startswith("tests/test_bench_harness.py:") for s in sites)

    def broken():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        harness.device_syncs(broken)
    assert modes[-2:] == ["warn", 0]
