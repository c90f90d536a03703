"""cpu tier: the scale-out benchmark's gloo dry run (benchmarks/bench_fsdp.py --tiny --device
cpu) on 4 processes through torchrun, on the 2D mesh dp 2 x tp 2 (FSDP2 over dp, TP with
sequence parallelism over tp, HF-converted Llama): both variants train and write their rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testlib import free_port

pytest.importorskip("transformers")
pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_on_a_2d_mesh(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           f"--master-port={free_port()}", str(ROOT / "benchmarks" / "bench_fsdp.py"),
           "--tiny", "--device", "cpu", "--tp", "2", "--steps", "3",
           "--variants", "bf16,tritium-fp8-delayed-ag"]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("*-fsdp.json")).read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["bf16", "tritium-fp8-delayed-ag"]
    for r in rows.values():
        assert "error" not in r, r
        assert (r["world"], r["tp"]) == (4, 2)
        assert r["tokens_per_s"] > 0 and len(r["losses"]) == 3
    # same weights and batches: FP8's first loss is bf16's up to FP8 rounding
    first = [r["losses"][0] for r in rows.values()]
    assert abs(first[0] - first[1]) < 0.01 * first[0], first
