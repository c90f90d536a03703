"""The FP8 Linear step's host path, run on a CPU with the GPU calls stubbed (diagnostic).

The host cost of an eager FP8 step is Python and torch dispatch; its GPU calls are a fixed set
(Triton launches, torch._scaled_mm). Here they are stubbed: `use_triton` and `fp8_tensor_cores`
answer True, every Triton launch computes its cache key as the real Launcher does and then does
nothing, and `torch._scaled_mm` only allocates its output. What remains is exactly the Python and
the torch calls of the CUDA path, timed on whatever CPU this runs on (no GPU needed), so host-side
changes can be measured and profiled without the device.

    python scripts/host_model_cpu.py [--profile] [T K N]     (default 256 512 512)
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

_device = importlib.import_module("tritium._device")
_launch = importlib.import_module("tritium.kernels._launch")


def _stub_launch(self, grid, *args, num_warps=4, **constexprs):
    self._cache = self._cache if self._cache is not None else {}
    self._cache.get(self.key(0, args, num_warps, constexprs))


def _stub_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False,
                    out=None):
    return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)


def install_stubs():
    _device.use_triton = lambda t: True
    _device.fp8_tensor_cores = lambda t: True
    _launch.Launcher.__call__ = _stub_launch
    torch._scaled_mm = _stub_scaled_mm


def main(argv):
    profile = "--profile" in argv
    dims = [int(a) for a in argv if a != "--profile"] or [256, 512, 512]
    install_stubs()
    step = fp8_linear_step(*dims, device="cpu")
    for _ in range(50):
        step()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(500):
            step()
        best = min(best, (time.perf_counter() - t0) / 500)
    print(f"host model (CPU, GPU calls stubbed): {1e6 * best:.1f} us per fwd+bwd step")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main(sys.argv[1:])
