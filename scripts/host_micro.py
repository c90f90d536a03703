"""Host cost of each building block of an FP8 Linear step (small tensors, no GPU waits)."""
import time

import torch

import tritium as te
from tritium import recipe
from tritium.fp8.autocast import FP8Region
from tritium.fp8.cast import quantize_2d
from tritium.functional.gemm import fp8_gemm_tn
from tritium.functional.linear import FP8Plan


def per_call(name, fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name:<44} {1e6 * (t1 - t0) / n:8.1f} us")


dev = "cuda"
x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
layer = te.Linear(512, 512, bias=False, params_dtype=torch.bfloat16, device=dev)
rec = recipe.DelayedScaling(amax_history_len=16)
with te.fp8_autocast(fp8_recipe=rec):
    layer(x)
meta = layer.fp8_meta
plan = FP8Plan(recipe=rec, fwd=meta.fwd, bwd=meta.bwd)
e4 = torch.float8_e4m3fn


class Nop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g


xr = x.clone().requires_grad_()
per_call("torch.empty(1)", lambda: torch.empty(1, device=dev))
per_call("torch.empty 256x512 fp8", lambda: torch.empty(256, 512, device=dev, dtype=e4))
per_call("x.add_(0)", lambda: x.add_(0))
per_call("FP8Plan(...)", lambda: FP8Plan(recipe=rec, fwd=meta.fwd, bwd=meta.bwd))
per_call("plan.quantize (x, with T)", lambda: plan.quantize(x, meta.fwd, 0, e4, write_transpose=True))
per_call("quantize_2d", lambda: quantize_2d(x, e4, scale=meta.fwd.scale_slot(0), amax=meta.fwd.amax_slot(0), current=None, write_transpose=True))
a8, _, si = quantize_2d(x, e4, scale=meta.fwd.scale_slot(0), amax=None, current=None)
w8, _, wsi = quantize_2d(layer.weight, e4, scale=meta.fwd.scale_slot(1), amax=None, current=None)
per_call("fp8_gemm_tn", lambda: fp8_gemm_tn(a8, w8, si, wsi, torch.bfloat16, fast_accum=True))
per_call("meta.fwd.update()", meta.fwd.update)
def empty_autocast():
    with te.fp8_autocast(fp8_recipe=rec):
        pass


per_call("fp8_autocast enter+exit (empty)", empty_autocast)
per_call("FP8Region().register", lambda: FP8Region().register(meta.fwd, meta.bwd, rec, None))
per_call("Nop.apply fwd+bwd", lambda: Nop.apply(xr).sum().backward())
per_call("bf16 layer fwd+bwd (no autocast)", lambda: layer(xr).sum().backward())
plain = torch.nn.Linear(512, 512, bias=False, device=dev, dtype=torch.bfloat16)
per_call("torch nn.Linear fwd+bwd", lambda: plain(xr).sum().backward())


def fp8_step():
    with te.fp8_autocast(fp8_recipe=rec):
        out = layer(xr)
    out.sum().backward()


def fp8_fwd():
    with te.fp8_autocast(fp8_recipe=rec):
        layer(xr)


per_call("fp8 layer fwd+bwd", fp8_step)
per_call("fp8 layer fwd only (grad on)", fp8_fwd)
with torch.no_grad():
    per_call("fp8 layer fwd only (no_grad)", fp8_fwd)

# --- the pieces under the step: raw torch calls, the launcher, autograd hand-off ---
from tritium.kernels import cast as kcast  # noqa: E402

b8 = torch.empty(512, 256, device=dev, dtype=e4)
per_call("torch._scaled_mm (raw, 256x256x512)",
         lambda: torch._scaled_mm(a8, w8.t(), scale_a=si, scale_b=wsi, out_dtype=torch.bfloat16,
                                  use_fast_accum=True))
per_call("torch.mm bf16 256x512x512", lambda: torch.mm(x, layer.weight.t()))
per_call("w8.t()", lambda: w8.t())
per_call("x.view(-1, 512)", lambda: x.view(-1, 512))
per_call("x[:128]", lambda: x[:128])
per_call("buf.view(e4) (uint8 -> fp8)", lambda: b8.view(torch.uint8))
per_call("kernels.cast.cast_transpose (data+T)",
         lambda: kcast.cast_transpose(x, meta.fwd.scale_slot(0), None, e4, pad_rows_to=16,
                                      write_transpose=True))
out3 = kcast.cast_transpose(x, meta.fwd.scale_slot(0), None, e4, pad_rows_to=16, write_transpose=True)
per_call("  same, into out= buffers",
         lambda: kcast.cast_transpose(x, meta.fwd.scale_slot(0), None, e4, pad_rows_to=16,
                                      write_transpose=True, out=out3))
per_call("(x*2).sum() (no autograd graph)", lambda: (x * 2).sum())
xg = x.clone().requires_grad_()
per_call("(xg*2).sum().backward() C++ nodes only", lambda: (xg * 2).sum().backward())
per_call("Nop.apply(xg).sum().backward()", lambda: Nop.apply(xg).sum().backward())
g = torch.ones_like(xg)
per_call("Nop.apply(xg).backward(g)", lambda: Nop.apply(xg).backward(g))
per_call("torch.autograd.grad(Nop.apply(xg), xg, g)",
         lambda: torch.autograd.grad(Nop.apply(xg), xg, g))


# --- how slow this host is at plain Python (compare with the same line on another machine) ---
def _python_work():
    d = {}
    for i in range(200):
        d[i & 31] = d.get(i & 31, 0) + i
    return d


per_call("pure Python: 200 dict updates", _python_work)

# --- the autograd engine's hand-off: the same calls with the backward on the calling thread ---
with torch.autograd.set_multithreading_enabled(False):
    per_call("[calling thread] Nop.apply(xg).backward(g)", lambda: Nop.apply(xg).backward(g))
    per_call("[calling thread] (xg*2).sum().backward()", lambda: (xg * 2).sum().backward())
    per_call("[calling thread] fp8 layer fwd+bwd", fp8_step)

# --- a Triton GEMM launch and its parts ---
from tritium.kernels import gemm as kgemm  # noqa: E402
from tritium.kernels._launch import TensorDesc  # noqa: E402

if torch.cuda.get_device_capability()[0] >= 9:
    per_call("kernels.gemm.fp8_gemm_tn (Triton, fast)",
             lambda: kgemm.fp8_gemm_tn(a8, w8, si, wsi, torch.bfloat16, fast_accum=True))
    per_call("TensorDesc(a8, (128, 128))", lambda: TensorDesc(a8, (128, 128)))
