"""cpu tier: benchmarks/bench_model.py --tiny runs on the CPU and writes rows through the
harness (tokens/s, the loss curve, speedups against HF eager in the same run)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_run_writes_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location("bench_model",
                                                  ROOT / "benchmarks" / "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--tiny", "--steps", "3", "--only", "tritium_fp8_delayed"]) == 0
    out = json.loads(next(tmp_path.glob("*-model.json")).read_text())
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["hf_eager", "tritium_fp8_delayed"]  # the baseline is always run
    for r in rows.values():
        assert "error" not in r, r
        assert len(r["loss_curve"]) == 3 and r["loss_50"] == r["loss_curve"][-1]
        assert r["loss_last10"] == pytest.approx(sum(r["loss_curve"]) / 3, abs=1e-4)
        assert r["tokens_per_s"] > 0 and "speedup_vs_hf_eager" in r
    assert rows["hf_eager"]["loss_last10_vs_hf_eager"] == 1.0
    assert rows["tritium_fp8_delayed"]["loss_last10_vs_hf_eager"] == pytest.approx(
        rows["tritium_fp8_delayed"]["loss_last10"] / rows["hf_eager"]["loss_last10"], abs=1e-4)
    # same weights and batches: the first step's loss agrees (bf16 model, FP8 blocks)
    first = [r["loss_curve"][0] for r in rows.values()]
    assert abs(first[0] - first[1]) < 0.05 * first[0]
