"""cpu tier: `python -m tritium demo` end to end at a tiny size, its pieces, and `bench` off GPU.

The demo runs in-process through tritium.cli.main on a temporary corpus (a few KB of random
words, fresh per test): it must print the table (both runs, losses, tokens/s, the FP8/fp32
ratio row), write the curves (PNG when matplotlib is importable, CSV always), results.json and a
checkpoint that torch.load(weights_only=True) reads and that restores the model. Ctrl-C (a
KeyboardInterrupt raised inside the second run) must leave the checkpoint of the steps that ran,
the curves, and exit 130. Both runs start from the same weights on the same batches, so their
first losses agree to FP8 tolerance. The bench report is checked on made-up rows.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from tritium import bench, demo
from tritium.cli import main

pytestmark = pytest.mark.cpu

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-groups", "1", "--ffn", "64",
        "--seq-len", "32", "--batch", "2", "--steps", "6", "--eval-batches", "1",
        "--device", "cpu"]


@pytest.fixture
def corpus(tmp_path, _seed):
    rng = random.Random(_seed)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "=", "(", ")"]
    text = " ".join(rng.choice(words) for _ in range(3000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _run(capsys, corpus, out, *extra):
    code = main(["demo", *TINY, "--corpus", str(corpus), "--out", str(out), *extra])
    return code, capsys.readouterr()


def _table_rows(stdout: str) -> dict:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "run":
            rows[cells[0]] = cells[1:]
    return rows


def test_demo_end_to_end(tmp_path, capsys, corpus):
    out = tmp_path / "out"
    code, cap = _run(capsys, corpus, out)
    assert code == 0, cap.err
    rows = _table_rows(cap.out)
    assert set(rows) == {"fp32", "fp8 delayed", "fp8 delayed / fp32"}, cap.out
    for name in ("fp32", "fp8 delayed"):
        train, held, tok_s, mem = rows[name]
        assert 0 < float(train) < 6 and 0 < float(held) < 6  # bytes: ln 256 = 5.55 at start
        assert float(tok_s.replace(",", "")) > 0
        assert mem.endswith("MiB") or mem.endswith("GiB")
    assert all(r.endswith("x") for r in rows["fp8 delayed / fp32"][:3])
    assert "[fp32] step 6/6" in cap.err and "[fp8 delayed] step 6/6" in cap.err

    result = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert [len(r["losses"]) for r in runs.values()] == [6, 6]
    first = runs["fp32"]["losses"][0]  # same weights, same batch: FP8 only adds rounding
    assert abs(runs["fp8 delayed"]["losses"][0] - first) <= 0.125 * first
    assert runs["fp32"]["held_out_loss"] == pytest.approx(float(rows["fp32"][1]), abs=1e-4)

    csv_lines = (out / "loss_curves.csv").read_text().splitlines()
    assert csv_lines[0] == "run,step,train_loss,held_out_loss" and len(csv_lines) == 13
    try:
        import matplotlib  # noqa: F401
        assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    except ImportError:
        assert "curves written as CSV only" in cap.out

    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["run"] == "fp8 delayed" and ckpt["step"] == 6
    assert ckpt["config"]["hidden"] == 32 and ckpt["optimizer"]["state"]
    cfg = demo.Config(**ckpt["config"])
    model = demo.ByteLlama(cfg, torch.float32)
    model.load_state_dict(ckpt["model"])
    torch.testing.assert_close(model.embed.weight, ckpt["model"]["embed.weight"])


def test_demo_ctrl_c_leaves_checkpoint_and_curves(tmp_path, capsys, corpus, monkeypatch):
    calls = {"n": 0}
    lr_at = demo._lr_at

    def interrupt_in_second_run(step, cfg):
        calls["n"] += 1
        if calls["n"] == 6 + 4:  # step 4 of the second run
            raise KeyboardInterrupt
        return lr_at(step, cfg)

    monkeypatch.setattr(demo, "_lr_at", interrupt_in_second_run)
    out = tmp_path / "out"
    code, cap = _run(capsys, corpus, out)
    assert code == 130
    assert "interrupted" in cap.err
    rows = _table_rows(cap.out)
    assert "fp8 delayed (interrupted)" in rows
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["run"] == "fp8 delayed" and ckpt["step"] == 3
    result = json.loads((out / "results.json").read_text())
    assert [r["steps"] for r in result["runs"]] == [6, 3]
    assert result["runs"][1]["interrupted"] and result["runs"][1]["evals"][-1][0] == 3
    assert (out / "loss_curves.csv").read_text().count("fp8 delayed,") == 3


def test_same_batches_and_weights_each_run(corpus):
    data, desc = demo.load_corpus(str(corpus))
    assert "1 files" in desc
    cfg = demo.Config(layers=1, hidden=32, heads=2, kv_groups=1, ffn=64, seq_len=16, batch=3,
                      steps=4, lr=1e-3, eval_batches=2)
    train, val = demo.split_corpus(data, cfg.seq_len)
    assert train.numel() + val.numel() <= len(data) and 0.03 < val.numel() / len(data) < 0.07
    a, b = list(demo.train_batches(train, cfg)), list(demo.train_batches(train, cfg))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    x, y = a[0]
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(demo.eval_batches(val, cfg)) == 2


def test_folder_corpus_is_sorted_and_skips_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zzz")
    (tmp_path / "a.txt").write_text("aaa")
    (tmp_path / "b" / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_text("hidden")
    data, desc = demo.load_corpus(str(tmp_path))
    assert data == b"aaazzz" and "2 files" in desc
    assert demo.load_corpus(str(tmp_path), max_bytes=4)[0] == b"aaaz"


def test_default_corpus_is_the_stdlib():
    data, desc = demo.load_corpus(None, max_bytes=1 << 16)
    assert len(data) == 1 << 16 and "standard library" in desc
    assert b"def " in data


def test_errors(tmp_path, capsys, corpus):
    assert main(["demo", *TINY, "--corpus", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    assert main(["demo", *TINY, "--corpus", str(small)]) == 2
    assert "too small" in capsys.readouterr().err
    assert main(["demo", *TINY, "--corpus", str(corpus), "--hidden", "40"]) == 2
    assert "divisible by 16" in capsys.readouterr().err


def test_optimizer_choice():
    p = [torch.nn.Parameter(torch.randn(4))]
    opt, name = demo._make_optimizer(p, 1e-3, master_weights=False)
    try:
        from tritium.optimizers import FusedAdam
    except ImportError:
        assert isinstance(opt, torch.optim.AdamW) and name == "torch.optim.AdamW"
    else:
        assert isinstance(opt, FusedAdam) and "FusedAdam" in name


def test_bench_without_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 0
    assert "need a CUDA GPU" in capsys.readouterr().out


def test_bench_report(tmp_path):
    env = {"date": "2026-11-22", "gpu": "NVIDIA H200", "torch": "2.11.0"}
    key = "speedup_vs_bf16 eager"
    results = [
        {"bench": "mlp", "env": env, "rows": [
            {"case": "T8192", "variant": "bf16 eager", "ms": 14.2, key: 1.0},
            {"case": "T8192", "variant": "tritium fp8", "ms": 8.3, key: 1.711},
            {"case": "T4096", "variant": "bf16 eager", "ms": 7.0, key: 1.0},
            {"case": "T4096", "variant": "torchao", "error": "ImportError('torchao')"}]},
        {"bench": "norm", "env": env, "rows": [
            {"case": "8192x4096", "variant": "torch", "ms": 0.2, "speedup_vs_torch": 1.0},
            {"case": "8192x4096", "variant": "tritium", "ms": 0.1, "speedup_vs_torch": 2.0}]}]
    paths = bench.write_report(results, tmp_path, failed=["bench_x.py"])
    names = [p.name for p in paths]
    assert names[:2] == ["2026-11-22-NVIDIA_H200.json", "2026-11-22-NVIDIA_H200.md"]
    merged = json.loads(paths[0].read_text())
    assert merged["benches"] == ["mlp", "norm"] and len(merged["rows"]) == 6
    assert merged["rows"][1]["bench"] == "mlp" and merged["failed"] == ["bench_x.py"]
    md = paths[1].read_text()
    assert "## mlp (baseline: bf16 eager)" in md and "| T8192 | tritium fp8 | 8.300 | 1.71x |" in md
    assert "| T4096 | torchao | error |" in md and "## norm (baseline: torch)" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(paths) == 2
    else:
        assert names[2:] == ["2026-11-22-NVIDIA_H200-mlp.png", "2026-11-22-NVIDIA_H200-norm.png"]
        assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths[2:])


@pytest.mark.parametrize("name", ["block", "mxfp8"])
def test_demo_block_recipes(tmp_path, capsys, corpus, name):
    code, cap = _run(capsys, corpus, tmp_path / "out", "--recipe", name)
    assert code == 0, cap.err
    runs = {r["name"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())
            ["runs"]}
    first = runs["fp32"]["losses"][0]  # same weights, same batch: FP8 only adds rounding
    assert abs(runs[f"fp8 {name}"]["losses"][0] - first) <= 0.125 * first
    assert "E4M3" in cap.out and ("emulated" in cap.out if name == "mxfp8" else True)
