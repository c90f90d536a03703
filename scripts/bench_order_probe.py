"""Does an earlier torch.compile in the process slow the eager FP8 step's host? (diagnostic)"""
import sys
import torch
sys.path.insert(0, "benchmarks")
from harness import measure_fwd_bwd  # noqa: E402
import tritium as te
from tritium import recipe

t, k, n = 8192, 4096, 4096
x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
rec = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
tl = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
ctx = lambda: te.fp8_autocast(fp8_recipe=rec)
base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
print("bf16 eager", measure_fwd_bwd(base, x, dy)["ms"])
print("fp8 before compile", measure_fwd_bwd(tl, x, dy, ctx)["ms"])
print("fp8 before compile", measure_fwd_bwd(tl, x, dy, ctx)["ms"])
print("bf16 compiled", measure_fwd_bwd(torch.compile(base), x, dy)["ms"])
print("fp8 after compile", measure_fwd_bwd(tl, x, dy, ctx)["ms"])
import gc
gc.collect(); gc.freeze()
print("fp8 after compile, gc.freeze", measure_fwd_bwd(tl, x, dy, ctx)["ms"])
