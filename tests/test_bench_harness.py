"""cpu tier: benchmarks/harness.py's profile arithmetic (kernel_summary's interval helpers).

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
