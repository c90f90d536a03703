"""`python -m tritium bench`: run every benchmarks/bench_*.py and write one merged report.

Each bench script times its variants on the GPU and calls `benchmarks/harness.py:finish()`,
which writes `{bench, env, rows}` JSON into $OUT. This command gives each script a fresh
temporary $OUT, then merges every JSON it finds into
    <out>/<date>-<gpu>.json   {"date", "gpu", "env", "benches", "failed", "rows": [{"bench", ...}]}
    <out>/<date>-<gpu>.md     one markdown table per bench: case, variant, ms, speedup
    <out>/<date>-<gpu>-<bench>.png   tritium and peers vs the bench's baseline (matplotlib)
with <out> = benchmarks/results by default. A row's speedup is its `speedup_vs_<baseline>`
field (baseline ms / row ms, from the same run). Without CUDA nothing runs: benchmarks time GPU
kernels, and the command says so and exits 0.

Benchmarks ship with the source tree, not the wheel: the scripts are found next to the package.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _speedup_key(row: dict) -> Optional[str]:
    return next((k for k in row if k.startswith("speedup_vs_")), None)


def merge(results: list) -> dict:
    """Merge finish() outputs (each {bench, baseline, env, rows}) into one record; rows get a
    bench field; each bench's baseline and GPU count are kept by bench name."""
    env = results[0]["env"] if results else {}
    rows, benches, baselines, gpus = [], [], {}, {}
    for res in results:
        if res["bench"] not in benches:
            benches.append(res["bench"])
        if res.get("baseline"):
            baselines[res["bench"]] = res["baseline"]
        gpus[res["bench"]] = res["env"].get("gpus", 1)
        rows.extend({"bench": res["bench"], **r} for r in res["rows"])
    return {"date": env.get("date"), "gpu": env.get("gpu", "cpu"), "env": env,
            "benches": benches, "baselines": baselines, "gpus": gpus, "rows": rows}


def markdown(merged: dict) -> str:
    env = merged["env"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "torchao", "liger_kernel")
                         if env.get(k))
    out = [f"# tritium benchmarks: {merged['gpu']}, {merged['date']}", "",
           f"{versions}. Medians of triton.testing.do_bench; speedup = baseline ms / ms, "
           "same run.", ""]
    for bench in merged["benches"]:
        rows = [r for r in merged["rows"] if r["bench"] == bench]
        key = next((k for k in map(_speedup_key, rows) if k), None)
        baseline = key[len("speedup_vs_"):] if key else "?"
        out += [f"## {bench} (baseline: {baseline})", "", "| case | variant | ms | speedup |",
                "|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                out.append(f"| {r['case']} | {r['variant']} | error | {r['error'][:60]} |")
                continue
            sp = r.get(key) if key else None
            ms = f"{r['ms']:.3f}" if isinstance(r.get("ms"), (int, float)) else "n/a"
            out.append(f"| {r['case']} | {r['variant']} | {ms} | "
                       f"{f'{sp:.2f}x' if sp is not None else 'n/a'} |")
        out.append("")
    if merged.get("failed"):
        out.append("Failed scripts: " + ", ".join(merged["failed"]))
    return "\n".join(out) + "\n"


def charts(merged: dict, out: Path, stem: str) -> list:
    """One PNG per bench (variants other than the baseline, per case); [] without matplotlib."""
    from ._plot import speedup_bars
    paths = []
    for bench in merged["benches"]:
        rows = [r for r in merged["rows"] if r["bench"] == bench and _speedup_key(r)]
        if not rows:
            continue
        key = _speedup_key(rows[0])
        baseline = key[len("speedup_vs_"):]
        bars = [(r["case"], r["variant"], r[key]) for r in rows if r["variant"] != baseline]
        path = speedup_bars(out / f"{stem}-{bench}.png",
                            f"{bench}: speedup vs {baseline} ({merged['gpu']})", bars)
        if path is None:
            return []
        paths.append(path)
    return paths


def write_report(results: list, out: Path, failed=()) -> list:
    merged = merge(results)
    merged["failed"] = list(failed)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{merged['date']}-{str(merged['gpu']).replace(' ', '_')}"
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(merged, indent=1))
    paths[1].write_text(markdown(merged))
    return paths + charts(merged, out, stem)


def run(only=(), out: Optional[str] = None) -> int:
    if not torch.cuda.is_available():
        print("tritium bench: the benchmarks time GPU kernels and need a CUDA GPU (Hopper for "
              "FP8); torch sees none here, so nothing ran. Numbers measured on GPUs: "
              "benchmarks/RESULTS.md.")
        return 0
    root = repo_root()
    scripts = sorted(root.glob("benchmarks/bench_*.py"))
    if only:
        scripts = [p for p in scripts if any(k in p.stem for k in only)]
    if not scripts:
        print(f"tritium bench: no benchmarks/bench_*.py under {root} (benchmarks ship with the "
              "source tree, not the wheel)")
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for path in scripts:
            print(f"== {path.relative_to(root)}", flush=True)
            env["OUT"] = str(Path(tmp) / path.stem)
            if subprocess.run([sys.executable, str(path)], cwd=root, env=env).returncode != 0:
                failed.append(path.name)
            for f in sorted(Path(env["OUT"]).glob("*.json")):
                results.append(json.loads(f.read_text()))
    print(f"tritium bench: {len(scripts) - len(failed)}/{len(scripts)} benchmarks ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    if results:
        paths = write_report(results, Path(out) if out else root / "benchmarks" / "results",
                             failed)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if failed else 0
