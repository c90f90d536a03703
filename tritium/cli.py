"""`python -m tritium demo|numerics|bench`: the first things a newcomer runs.

demo  Trains a small MLP made of te.Linear layers on a synthetic regression task twice, from the
      same initial weights and on the same batches: once in high precision, once under
      te.fp8_autocast with a DelayedScaling (or Float8CurrentScaling) recipe, then prints the final
      loss of each run, steps/s, and the FP8/high-precision loss ratio. On a CPU the FP8 GEMMs are
      emulated (exact fp8 values multiplied in fp32), so the numbers match what a GPU would compute
      but the speed does not. High precision is fp32 on the CPU and bf16 torch.autocast over fp32
      weights on a GPU (the usual mixed-precision baseline FP8 is judged against). Feature sizes
      are multiples of 16 (the FP8 GEMM rule); the batch of 200 rows is not, on purpose: tritium
      pads token counts itself.
numerics  Measures every module's error against float64 PyTorch in fp32, bf16, fp16 and FP8 and
      writes docs/numerics.md (see tritium/numerics.py).
bench Runs every `benchmarks/bench_*.py` of the source tree with this Python when CUDA is present;
      without a GPU it says so and exits 0 (benchmarks time GPU kernels, nothing else).

Deliberately not here: model zoos, config files, plotting. The demo stays a single screen of code
that doubles as an example of the public API (`import tritium as te`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import tritium as te

IN, HIDDEN, OUT, BATCH = 32, 128, 16, 200


def _make_model(device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        te.Linear(IN, HIDDEN, device=device), torch.nn.GELU(approximate="tanh"),
        te.Linear(HIDDEN, HIDDEN, device=device), torch.nn.GELU(approximate="tanh"),
        te.Linear(HIDDEN, OUT, device=device))


def _make_data(device: torch.device, seed: int, n: int = 8192):
    """A fixed random teacher network plus a little noise: a task with a known loss floor."""
    g = torch.Generator().manual_seed(seed + 1)
    w1 = torch.randn(IN, 64, generator=g) / IN ** 0.5
    w2 = torch.randn(64, OUT, generator=g) / 64 ** 0.5
    x = torch.randn(n, IN, generator=g)
    y = torch.tanh(x @ w1) @ w2
    y = (y - y.mean(0)) / y.std(0) + 0.05 * torch.randn(n, OUT, generator=g)
    return x.to(device), y.to(device)


def _train(fp8_recipe, args, device, data, amp_dtype):
    """Train one model; fp8_recipe=None is the high-precision run. Returns (losses, steps/s, eval)."""
    model = _make_model(device, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    x_all, y_all = data
    n_train = x_all.shape[0] - 1024
    order = torch.Generator().manual_seed(args.seed + 2)

    def context():
        stack = contextlib.ExitStack()
        if amp_dtype is not None:
            stack.enter_context(torch.autocast(device.type, dtype=amp_dtype))
        if fp8_recipe is not None:
            stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe))
        return stack

    losses, warmup = [], min(5, max(args.steps // 10, 1))
    t0 = None
    for step in range(args.steps):
        if step == warmup:  # leave Triton JIT compiles and allocator warm-up out of steps/s
            _sync(device)
            t0 = time.perf_counter()
        idx = torch.randint(0, n_train, (BATCH,), generator=order).to(device)
        with context():
            out = model(x_all[idx])
        loss = torch.nn.functional.mse_loss(out.float(), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    _sync(device)
    timed = args.steps - warmup
    steps_per_s = timed / (time.perf_counter() - t0) if t0 is not None and timed > 0 else float("nan")
    with torch.no_grad(), context():  # held-out loss, in the precision the model was trained in
        out = model(x_all[n_train:])
    held_out = torch.nn.functional.mse_loss(out.float(), y_all[n_train:]).item()
    return losses, steps_per_s, held_out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def demo(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda given but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None
    hp_name = "bf16 autocast" if amp_dtype is not None else "fp32"
    if args.recipe == "delayed":
        recipe = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID,
                                          amax_history_len=16, amax_compute_algo="max")
    else:
        recipe = te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.HYBRID)
    from ._device import fp8_gemm_support
    fp8_ok, why = fp8_gemm_support(device)
    print(f"tritium {te.__version__} demo: MLP {IN}->{HIDDEN}->{HIDDEN}->{OUT} of te.Linear, "
          f"batch {BATCH}, {args.steps} steps, AdamW lr {args.lr}, seed {args.seed}")
    print(f"device {device}; high precision = {hp_name}; FP8 recipe = {type(recipe).__name__} "
          f"(HYBRID: E4M3 forward, E5M2 backward); FP8 GEMMs: "
          f"{'tensor cores' if fp8_ok else 'emulated'} ({why})")
    data = _make_data(device, args.seed)
    runs = {}
    for name, rec in ((hp_name, None), (f"fp8 {args.recipe}", recipe)):
        runs[name] = _train(rec, args, device, data, amp_dtype)

    (hp, (hp_loss, hp_sps, hp_eval)), (f8, (f8_loss, f8_sps, f8_eval)) = runs.items()
    marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    print(f"\n{'step':>6}  {hp + ' loss':>20}  {f8 + ' loss':>20}")
    for s in marks:
        print(f"{s:>6}  {hp_loss[s]:>20.5f}  {f8_loss[s]:>20.5f}")
    tail = max(1, min(10, args.steps))
    rows = [(hp, sum(hp_loss[-tail:]) / tail, hp_eval, hp_sps),
            (f8, sum(f8_loss[-tail:]) / tail, f8_eval, f8_sps)]
    print(f"\n{'run':<16} {'final train loss':>17} {'held-out loss':>14} {'steps/s':>9}")
    for name, train, held, sps in rows:
        print(f"{name:<16} {train:>17.5f} {held:>14.5f} {sps:>9.1f}")
    ratio = f8_eval / hp_eval if hp_eval > 0 else float("nan")
    print(f"\nheld-out loss ratio fp8 / {hp}: {ratio:.4f}  (1.0 = FP8 matches high precision; "
          f"final train loss = mean of the last {tail} steps)")
    if not fp8_ok:
        print("steps/s on this device measure the emulation, not FP8 speed: see benchmarks/.")
    if not all(v == v and abs(v) != float("inf") for v in (hp_eval, f8_eval)):
        print("a run ended with a non-finite loss: that is a bug, not FP8 noise; rerun with "
              "TRITIUM_FORCE_REF=1 to compare with the reference casts, and report it")
        return 1
    return 0


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def bench(args) -> int:
    if not torch.cuda.is_available():
        print("tritium bench: benchmarks time GPU kernels and need a CUDA GPU; torch sees none "
              "here, so nothing ran. Numbers from GPU runs: benchmarks/RESULTS.md.")
        return 0
    root = _repo_root()
    scripts = sorted(root.glob("benchmarks/bench_*.py"))
    if args.only:
        scripts = [p for p in scripts if any(k in p.stem for k in args.only)]
    if not scripts:
        print(f"tritium bench: no benchmarks/bench_*.py under {root} (benchmarks ship with the "
              "source tree, not the wheel)")
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    failed = []
    for path in scripts:
        print(f"== {path.relative_to(root)}", flush=True)
        if subprocess.run([sys.executable, str(path)], cwd=root, env=env).returncode != 0:
            failed.append(path.name)
    print(f"tritium bench: {len(scripts) - len(failed)}/{len(scripts)} benchmarks ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def numerics(args) -> int:
    from .numerics import main as run  # imported on demand: the demo does not need it
    return run(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritium", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small te.Linear MLP in high precision and in FP8")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if present)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and batches")
    p.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                   help="DelayedScaling (default) or Float8CurrentScaling")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="run benchmarks/bench_*.py (needs a CUDA GPU)")
    p.add_argument("only", nargs="*", help="run only benchmarks whose name contains one of these")
    p.set_defaults(func=bench)
    p = sub.add_parser("numerics", help="measure every module's error vs float64 PyTorch")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if present)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per module (default 3)")
    p.add_argument("--out", default="docs/numerics.md", help="markdown file to write")
    p.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    p.set_defaults(func=numerics)
    args = parser.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        parser.error("--steps must be >= 1")
    return args.func(args)
