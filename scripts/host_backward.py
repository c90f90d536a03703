"""Time the pieces of the FP8 Linear backward on the host (wrappers around each piece)."""
import collections
import time

import torch

import importlib

import tritium as te
from tritium import recipe

# The packages re-export functions named like these submodules: import the modules themselves.
fl = importlib.import_module("tritium.functional.linear")
ac = importlib.import_module("tritium.fp8.autocast")

acc = collections.defaultdict(float)
cnt = collections.defaultdict(int)


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t0
            cnt[name] += 1
    return wrapper


fl.fp8_gemm_tn = timed("fp8_gemm_tn", fl.fp8_gemm_tn)
fl.FP8Plan.quantize = timed("plan.quantize", fl.FP8Plan.quantize)
ac.FP8Region.backward_done = timed("backward_done", ac.FP8Region.backward_done)
fl._LinearFunction.backward = staticmethod(timed("Function.backward", fl._LinearFunction.backward))
fl._LinearFunction.forward = staticmethod(timed("Function.forward", fl._LinearFunction.forward))

layer = te.Linear(512, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
rec = recipe.DelayedScaling(amax_history_len=16)
for i in range(320):
    if i == 20:
        acc.clear(); cnt.clear()
        torch.cuda.synchronize()
        t_start = time.perf_counter()
    t0 = time.perf_counter()
    with te.fp8_autocast(fp8_recipe=rec):
        out = layer(x)
    t1 = time.perf_counter()
    out.backward(dy)
    t2 = time.perf_counter()
    acc["step fwd (incl exit)"] += t1 - t0
    acc["step out.backward"] += t2 - t1
torch.cuda.synchronize()
for k in acc:
    n = 300
    print(f"{k:<28} {1e6 * acc[k] / n:8.1f} us/step  ({cnt[k] / n if cnt[k] else 1:.0f} calls/step)")
