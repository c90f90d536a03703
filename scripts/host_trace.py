"""Host timeline of one eager FP8 Linear step, function by function (diagnostic, CUDA).

Wraps the step's functions (module forward, plan, casts, launches, GEMMs, scale updates,
Tensor.backward) with perf_counter_ns stamps at entry and exit, on whatever thread runs them,
and prints the median step's stamps relative to its start. Each wrapper costs well under a
microsecond, far less than torch.profiler's per-op cost, so the offsets are close to an
unwrapped step's.

    python scripts/host_trace.py [T K N]      (default 8192 4096 4096)
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


def main(t=8192, k=4096, n=4096, steps=60):
    step = fp8_linear_step(t, k, n)
    for _ in range(10):
        step()
    instrument()
    runs = []
    for _ in range(steps):
        torch.cuda.synchronize()
        STAMPS.clear()
        t0 = _now()
        step()
        t1 = _now()
        runs.append((t1 - t0, t0, list(STAMPS)))
    torch.cuda.synchronize()
    runs.sort(key=lambda r: r[0])
    total, t0, stamps = runs[len(runs) // 2]
    main_thread = threading.get_ident()
    print(f"T{t} {k}->{n}: median step host {total / 1e3:.0f} us (min {runs[0][0] / 1e3:.0f}, "
          f"max {runs[-1][0] / 1e3:.0f}); stamps: start, end, duration in us; * = autograd thread")
    for label, a, b, tid in sorted(stamps, key=lambda s: s[1]):
        mark = " " if tid == main_thread else "*"
        print(f"{mark} {label:<34} {(a - t0) / 1e3:8.1f} {(b - t0) / 1e3:8.1f} {(b - a) / 1e3:7.1f}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
