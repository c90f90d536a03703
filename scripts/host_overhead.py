"""Where the host time of one FP8 Linear step goes: per-call enqueue cost of each piece on
small tensors (so the GPU never makes the host wait), then a cProfile of whole steps."""
import cProfile
import pstats
import time

import torch

import tritium as te
from tritium import recipe
from tritium.kernels import cast as kcast
from tritium.kernels import scaling as kscaling


def per_call(name, fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name:<40} {1e6 * (t1 - t0) / n:8.1f} us/call (host)")


x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
scale = torch.ones(1, device="cuda")
amax = torch.zeros(1, device="cuda")
e4 = torch.float8_e4m3fn
per_call("empty torch op (x.add_(0))", lambda: x.add_(0))
per_call("cast_transpose kernel", lambda: kcast.cast_transpose(x, scale, amax, e4, pad_rows_to=16,
                                                              write_transpose=True))
hist = torch.zeros(16, 2, device="cuda"); sc = torch.ones(2, device="cuda")
per_call("delayed update kernel", lambda: kscaling.delayed_scaling_update(hist, sc, 448.0, 0, "max"))
a8 = torch.randn(256, 512, device="cuda").to(e4)
b8 = torch.randn(512, 512, device="cuda").to(e4)
per_call("torch._scaled_mm", lambda: torch._scaled_mm(a8, b8.t(), scale_a=scale, scale_b=scale,
                                                      out_dtype=torch.bfloat16, use_fast_accum=True))
layer = te.Linear(512, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
xr = x.clone().requires_grad_()
rec = recipe.DelayedScaling(amax_history_len=16)
dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)


def step():
    xr.grad = layer.weight.grad = None
    with te.fp8_autocast(fp8_recipe=rec):
        out = layer(xr)
    out.backward(dy)


def step_bf16():
    xr.grad = layer.weight.grad = None
    layer(xr).backward(dy)


per_call("Linear fwd+bwd bf16 (no autocast)", step_bf16)
per_call("Linear fwd+bwd fp8 delayed", step)
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    step()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
