"""Host timeline of one eager FP8 Linear step, function by function (diagnostic, CUDA).

Wraps the step's functions (module forward, plan, casts, launches, GEMMs, scale updates,
Tensor.backward) with perf_counter_ns stamps at entry and exit, on whatever thread runs them,
and prints the median step's stamps relative to its start. Each wrapper costs well under a
microsecond, far less than torch.profiler's per-op cost, so the offsets are close to an
unwrapped step's.

    python scripts/host_trace.py [--loop] [--calling] [T K N]      (default 8192 4096 4096)

--loop runs the steps back to back as triton's do_bench does (an L2 flush and CUDA events
around each step, no sync in between): then the host may run slower than in isolated steps
(the GPU's queue is busy), and the events give each step's measured time next to its stamps. --calling runs the backward on
the calling thread (`torch.autograd.set_multithreading_enabled(False)`).
"""
from __future__ import annotations

import importlib
import sys
import threading
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_host import fp8_linear_step  # noqa: E402

STAMPS: list = []
_now = time.perf_counter_ns


def _wrap(owner, attr, label=None, static=False):
    fn = getattr(owner, attr)
    label = label or f"{getattr(owner, '__name__', owner)}.{attr}"

    def wrapper(*args, **kwargs):
        t0 = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((label, t0, _now(), threading.get_ident()))
    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)


def instrument():
    fl = importlib.import_module("tritium.functional.linear")
    ml = importlib.import_module("tritium.modules.linear")
    base = importlib.import_module("tritium.modules.base")
    ac = importlib.import_module("tritium.fp8.autocast")
    launch = importlib.import_module("tritium.kernels._launch")
    gemm = importlib.import_module("tritium.functional.gemm")
    _wrap(ml.Linear, "forward")
    _wrap(base.FP8Module, "_fp8_plan")
    _wrap(ml, "linear", "functional.linear")
    _wrap(fl._LinearFunction, "forward", "Function.forward", static=True)
    _wrap(fl._LinearFunction, "backward", "Function.backward", static=True)
    _wrap(fl.FP8Plan, "quantize")
    _wrap(fl.FP8Plan, "weight_operands")
    _wrap(fl, "fp8_gemm_tn")
    _wrap(gemm.torch, "_scaled_mm", "torch._scaled_mm")
    _wrap(launch.Launcher, "__call__", "Launcher.__call__")
    _wrap(ac.FP8Region, "forward_done")
    _wrap(ac.FP8Region, "backward_done")
    _wrap(torch.Tensor, "backward", "Tensor.backward")


def main(t=8192, k=4096, n=4096, steps=60, loop=False):
    step = fp8_linear_step(t, k, n)
    for _ in range(10):
        step()
    instrument()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    runs = []
    torch.cuda.synchronize()
    for i in range(steps):
        if loop:
            flush.zero_()
            events[i][0].record()
        else:
            torch.cuda.synchronize()
        STAMPS.clear()
        t0 = _now()
        step()
        t1 = _now()
        if loop:
            events[i][1].record()
        runs.append([t1 - t0, t0, list(STAMPS), 0.0])
    torch.cuda.synchronize()
    if loop:
        for run, (a, b) in zip(runs, events):
            run[3] = a.elapsed_time(b) * 1e3
    runs.sort(key=lambda r: r[0])
    total, t0, stamps, measured = runs[len(runs) // 2]
    main_thread = threading.get_ident()
    extra = ""
    if loop:
        timed = sorted(r[3] for r in runs)
        extra = f"; measured (events) median {timed[len(timed) // 2]:.0f} us"
    print(f"T{t} {k}->{n}{' (loop)' if loop else ''}: median step host {total / 1e3:.0f} us "
          f"(min {runs[0][0] / 1e3:.0f}, max {runs[-1][0] / 1e3:.0f}){extra}; stamps: start, "
          "end, duration in us; * = autograd thread")
    for label, a, b, tid in sorted(stamps, key=lambda s: s[1]):
        mark = " " if tid == main_thread else "*"
        print(f"{mark} {label:<34} {(a - t0) / 1e3:8.1f} {(b - t0) / 1e3:8.1f} {(b - a) / 1e3:7.1f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--calling" in sys.argv:
        torch.autograd.set_multithreading_enabled(False)
    main(*map(int, args[:3]), loop="--loop" in sys.argv)
