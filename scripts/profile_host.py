"""Where the host time of an eager step goes (diagnostic, needs CUDA).

For each case: wall time per step with the GPU kept busy (perf_counter over N steps, one sync),
the kernels' own time (torch.profiler), and the profiler's table of host-side ops and CUDA
runtime calls by self CPU time (all threads: the autograd engine runs backward on its own),
which shows launches, allocations and any synchronization.

    python scripts/profile_host.py [linear4096 linear_tiny layernorm rmsnorm]
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tritium as te
from tritium import recipe


def fp8_linear_step(t, k, n, device="cuda"):
    """A step of a bf16 tritium.Linear under fp8_autocast (delayed scaling): fwd + bwd."""
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    rec = recipe.DelayedScaling(amax_history_len=16)

    def step():
        layer.weight.grad = x.grad = None
        with te.fp8_autocast(fp8_recipe=rec):
            out = layer(x)
        out.backward(dy)
    return step


def _norm(kind):
    mod = getattr(te, kind)(4096, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(mod.parameters()) + [x]

    def step():
        for p in params:
            p.grad = None
        mod(x).backward(dy)
    return step


CASES = {"linear4096": lambda: fp8_linear_step(8192, 4096, 4096),
         "linear_tiny": lambda: fp8_linear_step(256, 512, 512),
         "layernorm": lambda: _norm("LayerNorm"), "rmsnorm": lambda: _norm("RMSNorm")}


def main(names):
    for name in names:
        step = CASES[name]()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        t_host = time.perf_counter()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 20 / 1e3
        print(f"\n=== {name}: wall {1e3 * (t1 - t0) / n:.3f} ms/step, host enqueue "
              f"{1e3 * (t_host - t0) / n:.3f} ms/step, kernels {gpu:.3f} ms/step", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
