"""How much of an eager FP8 Linear step's host time each kind of GPU call takes, in place
(diagnostic, CUDA). The step (T256 512->512, where the GPU waits on the host) runs back to back
as in a training loop, first as it is, then with more and more of its GPU calls replaced by
stand-ins that return at once: the differences are what those calls cost inside a real step
(warm or cold caches, the autograd device thread), which per-call micro-benchmarks miss.

    python scripts/host_parts.py

Rows: real; Triton launches stubbed (the C entry point not called); + torch._scaled_mm
stubbed (output allocated, no cuBLASLt); + torch.empty of fp8 outputs and Triton launches
stubbed entirely. Each under the default autograd threading and with the backward on the
calling thread. The numbers are host time; the results of stubbed steps are garbage.
"""
from __future__ import annotations

import importlib
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ab_linear import host_us  # noqa: E402
from profile_host import fp8_linear_step  # noqa: E402

_launch = importlib.import_module("tritium.kernels._launch")


def _no_launch(*args, **kwargs):
    return None


def main():
    step = fp8_linear_step(256, 512, 512)
    real_call = _launch.Launcher.__call__
    real_mm = torch._scaled_mm

    def stub_c_launch():
        # keep keys, pointer lists and descriptor encodes; drop only the C call
        for launcher in _iter_launchers():
            for key, entry in list(launcher._cache.items()):
                if entry[0] is not None:
                    launcher._cache[key] = (_no_launch, *entry[1:])
        for fixed in _instances(_launch._FixedLaunch):  # the prebuilt scale updates
            if fixed._c_launch is not None:
                fixed._c_launch = _no_launch

    def stub_mm():
        def fake(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False,
                 out=None):
            return out if out is not None else torch.empty(a.shape[0], b.shape[1],
                                                           dtype=out_dtype, device=a.device)
        torch._scaled_mm = fake

    def stub_launcher_call():
        _launch.Launcher.__call__ = lambda self, grid, *a, **k: None

    stages = [("real", lambda: None), ("Triton C launch stubbed", stub_c_launch),
              ("+ torch._scaled_mm stubbed", stub_mm),
              ("+ Launcher.__call__ stubbed", stub_launcher_call)]
    try:
        for name, apply in stages:
            apply()
            for mode in ("default", "calling thread"):
                torch.autograd.set_multithreading_enabled(mode == "default")
                print(f"{name:<32} {mode:<15} {host_us(step):8.1f} us/step", flush=True)
            torch.autograd.set_multithreading_enabled(True)
    finally:
        _launch.Launcher.__call__ = real_call
        torch._scaled_mm = real_mm


def _instances(cls):
    import gc
    return [o for o in gc.get_objects() if isinstance(o, cls)]


def _iter_launchers():
    return [o for o in _instances(_launch.Launcher) if o._cache]


if __name__ == "__main__":
    main()
