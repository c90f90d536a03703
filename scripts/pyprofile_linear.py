"""cProfile of the Python inside an FP8 Linear step's forward and backward (diagnostic, CUDA).

The backward runs on the autograd engine's device thread, where a profiler enabled on the main
thread sees nothing; here each of the Function's forward and backward enables its own profiler
around its body (on whatever thread runs it), so both show up, function by function.

    python scripts/pyprofile_linear.py [T K N]     (default 256 512 512: host time only)
"""
from __future__ import annotations

import cProfile
import importlib
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_host import fp8_linear_step  # noqa: E402

fl = importlib.import_module("tritium.functional.linear")
PROFILES = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}


def _profiled(name, fn):
    prof = PROFILES[name]

    def wrapper(*args):
        prof.enable()
        try:
            return fn(*args)
        finally:
            prof.disable()
    return staticmethod(wrapper)


def main(t=256, k=512, n=512, steps=200):
    step = fp8_linear_step(t, k, n)
    for _ in range(20):
        step()
    fl._LinearFunction.forward = _profiled("forward", fl._LinearFunction.forward)
    fl._LinearFunction.backward = _profiled("backward", fl._LinearFunction.backward)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(f"T{t} {k}->{n}: {1e6 * (time.perf_counter() - t0) / steps:.1f} us/step with the "
          "two profilers on")
    for name, prof in PROFILES.items():
        print(f"\n===== {name} (per {steps} steps) =====")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
