"""Usage: python scripts/ab_linear.py {base REV [REV ...] | run [T K N ...]}

A/B of the eager FP8 Linear step: this tree's tritium against earlier commits', in one process
(diagnostic; `run` needs CUDA). Host-side changes are measured within one process because a
host's speed moves from call to call by more than such a change does.

  base REV [REV ...]  writes ab_base/tritium_<rev>: the tritium package as of each git revision,
                      importable next to this tree's (ab_base/ is ignored by git; copy it along
                      to the GPU machine). No REV: clears ab_base/.
  run [T K N ...]     for each shape (default 8192 4096 4096): bf16 nn.Linear, tritium FP8
                      delayed and each ab_base/tritium_* FP8 delayed, timed as bench_linear.py
                      times them (do_bench, GPU settled, variants in turn, ROUNDS rounds,
                      median), under the default autograd threading and with the backward on
                      the calling thread; then the host cost per step of each at T256 512->512,
                      where the GPU waits on the host. Rows go to $OUT/ab_linear.json when $OUT
                      is set.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

ROOT = __file__.rsplit("/", 2)[0]
sys.path.insert(0, ROOT + "/benchmarks")
sys.path.insert(0, ROOT + "/ab_base")
from harness import settle_gpu, time_ms  # noqa: E402

import importlib  # noqa: E402

import tritium  # noqa: E402

BASES = sorted(p for p in (os.listdir(ROOT + "/ab_base") if os.path.isdir(ROOT + "/ab_base")
                           else ()) if p.startswith("tritium_"))

ROUNDS = 9


def fp8_step(te, t, k, n):
    torch.manual_seed(0)
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    rec = te.recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    return _step(layer, t, k, n, lambda: te.fp8_autocast(fp8_recipe=rec))


def bf16_step(t, k, n):
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    return _step(layer, t, k, n, None)


def _step(layer, t, k, n, ctx):
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    params = list(layer.parameters()) + [x]

    def step():
        for p in params:
            p.grad = None
        if ctx is None:
            out = layer(x)
        else:
            with ctx():
                out = layer(x)
        out.backward(dy)
    return step


def calling_thread(step):
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


def host_us(step, n=300):
    """Host time per step where the GPU has almost nothing to do (best of 5 loops)."""
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return round(1e6 * best, 1)


def variants(t, k, n):
    out = [("bf16 nn.Linear", bf16_step(t, k, n)), ("tritium", fp8_step(tritium, t, k, n))]
    for name in BASES:
        out.append((name, fp8_step(importlib.import_module(name), t, k, n)))
    return out


def run(dims):
    dims = dims or [8192, 4096, 4096]
    gpu = torch.cuda.get_device_name()
    rows = []
    for i in range(0, len(dims), 3):
        t, k, n = dims[i:i + 3]
        runs = []
        for name, step in variants(t, k, n):
            for mode, fn in (("default", step), ("calling thread", calling_thread(step))):
                fn(), fn()
                runs.append({"gpu": gpu, "case": f"T{t} {k}->{n}", "variant": name,
                             "threading": mode, "fn": fn, "ms_rounds": []})
        settle_gpu()
        for _ in range(ROUNDS):
            for r in runs:
                r["ms_rounds"].append(round(time_ms(r["fn"]), 4))
        for r in runs:
            del r["fn"]
            r["ms"] = statistics.median(r["ms_rounds"])
            base = next(b for b in runs if b["variant"] == "bf16 nn.Linear"
                        and b["threading"] == r["threading"])
            r["speedup_vs_bf16"] = round(base["ms"] / r["ms"], 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
    for name, step in variants(256, 512, 512):
        for mode, fn in (("default", step), ("calling thread", calling_thread(step))):
            row = {"gpu": gpu, "case": "T256 512->512 host", "variant": name, "threading": mode,
                   "host_us_per_step": host_us(fn)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ab_linear.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        val = (f"{r['ms']:.3f} ms ({r['speedup_vs_bf16']:.2f}x)" if "ms" in r
               else f"{r['host_us_per_step']} us host")
        print(f"{r['case']:<22} {r['variant']:<16} {r['threading']:<15} {val}")


def base(revs):
    """ab_base/tritium_<rev> for each rev: `git archive REV tritium`, renamed."""
    dest = os.path.join(ROOT, "ab_base")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for rev in revs:
        short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
        archive = subprocess.run(["git", "archive", rev, "tritium"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        os.rename(os.path.join(dest, "tritium"), os.path.join(dest, f"tritium_{short}"))
        print(os.path.join("ab_base", f"tritium_{short}"))


def main(argv=None):
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="scripts/ab_linear.py", description=doc[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(doc[2:]))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("base", help="write ab_base/tritium_<rev> for each git revision")
    p.add_argument("revs", nargs="*", metavar="REV")
    p = sub.add_parser("run", help="time bf16, this tree and every ab_base/tritium_* (CUDA)")
    p.add_argument("dims", nargs="*", type=int, metavar="T K N")
    args = parser.parse_args(argv)
    if args.command == "base":
        return base(args.revs)
    if len(args.dims) % 3:
        parser.error(f"run: shapes are T K N triples, got {args.dims}")
    if not torch.cuda.is_available():
        parser.error("run needs a CUDA GPU; torch sees none")
    run(args.dims)


if __name__ == "__main__":
    main()
