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


def _bench_model():
    """benchmarks/bench_model.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_model",
                                                  ROOT / "benchmarks" / "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mod = _bench_model()
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


def test_rounds_give_medians_and_paired_ratios(tmp_path, monkeypatch):
    """--rounds 2: each variant runs twice (alternating order); ms is the median of its rounds
    and the tritium row carries paired_vs_hf_eager, the median of the rounds' own ratios."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mod = _bench_model()
    assert mod.main(["--tiny", "--steps", "3", "--rounds", "2", "--only", "tritium_bf16"]) == 0
    rows = {r["variant"]: r for r in json.loads(next(tmp_path.glob("*-model.json")).read_text())
            ["rows"]}
    base, ours = rows["hf_eager"], rows["tritium_bf16"]
    for r in (base, ours):
        assert "error" not in r, r
        assert len(r["ms_rounds"]) == 2 and r["ms"] == pytest.approx(
            sum(r["ms_rounds"]) / 2, abs=1e-3)
    want = sorted(b / t for b, t in zip(base["ms_rounds"], ours["ms_rounds"]))
    assert ours["paired_vs_hf_eager"] == pytest.approx(sum(want) / 2, rel=1e-3)
    assert "paired_vs_hf_eager" not in base


def test_merge_rounds_keeps_an_error_of_any_round():
    mod = _bench_model()
    seen = {"hf_eager": [{"variant": "hf_eager", "ms": 10.0, "tokens_per_s": 1.0}] * 2,
            "tritium_bf16": [{"variant": "tritium_bf16", "ms": 8.0, "tokens_per_s": 1.25},
                             {"variant": "tritium_bf16", "error": "OOM"}]}
    rows = mod.merge_rounds("c", ["hf_eager", "tritium_bf16"], seen)
    assert rows[1]["error"] == "OOM" and "paired_vs_hf_eager" not in rows[1]
    assert rows[0]["ms"] == 10.0 and rows[0]["ms_rounds"] == [10.0, 10.0]
