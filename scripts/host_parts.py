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
import time

import torch

import tritium as te
from tritium import recipe

_launch = importlib.import_module("tritium.kernels._launch")


def fp8_step(t=256, k=512, n=512):
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    rec = recipe.DelayedScaling(amax_history_len=16)

    def step():
        layer.weight.grad = x.grad = None
        with te.fp8_autocast(fp8_recipe=rec):
            out = layer(x)
        out.backward(dy)
    return step


def host_us(step, n=400):
    for _ in range(40):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return 1e6 * best


def _no_launch(*args, **kwargs):
    return None


def main():
    step = fp8_step()
    real_call = _launch.Launcher.__call__
    real_mm = torch._scaled_mm

    def stub_c_launch():
        # keep keys, pointer lists and descriptor encodes; drop only the C call
        for launcher in _iter_launchers():
            for key, entry in list(launcher._cache.items()):
                if entry[0] is not None:
                    launcher._cache[key] = (_no_launch, *entry[1:])

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


def _iter_launchers():
    import gc
    return [o for o in gc.get_objects() if isinstance(o, _launch.Launcher) and o._cache]


if __name__ == "__main__":
    main()
