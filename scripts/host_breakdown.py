"""Host time of each phase of an FP8 Linear step on small tensors, and a cumulative cProfile."""
import cProfile
import pstats
import time

import torch

import tritium as te
from tritium import recipe

layer = te.Linear(512, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
rec = recipe.DelayedScaling(amax_history_len=16)
acc = {"enter": 0.0, "forward": 0.0, "exit": 0.0, "backward": 0.0}


def step(timed):
    x.grad = layer.weight.grad = None
    t0 = time.perf_counter()
    ctx = te.fp8_autocast(fp8_recipe=rec)
    ctx.__enter__()
    t1 = time.perf_counter()
    out = layer(x)
    t2 = time.perf_counter()
    ctx.__exit__(None, None, None)
    t3 = time.perf_counter()
    out.backward(dy)
    t4 = time.perf_counter()
    if timed:
        for k, a, b in (("enter", t0, t1), ("forward", t1, t2), ("exit", t2, t3), ("backward", t3, t4)):
            acc[k] += b - a


for i in range(220):
    step(i >= 20)
torch.cuda.synchronize()
print({k: f"{v / 200 * 1e6:.1f} us" for k, v in acc.items()})
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    step(False)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
