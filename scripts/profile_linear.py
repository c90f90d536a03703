"""Profile one FP8 Linear fwd+bwd on the GPU: per-kernel CUDA time and host enqueue time.

Usage: python scripts/profile_linear.py [T K N]. Prints the torch.profiler table (CUDA time per
kernel) and the host time to enqueue one step (if it exceeds the GPU time, the step is
launch-bound, not GPU-bound).
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tritium as te
from tritium import recipe

t, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 4096, 4096)
layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
rec = recipe.DelayedScaling(amax_history_len=16)


def step():
    x.grad = layer.weight.grad = None
    with te.fp8_autocast(fp8_recipe=rec):
        out = layer(x)
    out.backward(dy)


for _ in range(5):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    step()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"host enqueue {1e3 * (t1 - t0) / 20:.3f} ms/step, wall {1e3 * (t2 - t0) / 20:.3f} ms/step")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
