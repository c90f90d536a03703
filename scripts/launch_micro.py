"""Where a Triton launch's host time goes (diagnostic, CUDA): the Launcher's key, Triton's
compiled `run` with tensors or with int pointers, the C `launch` under it, and the driver calls
the launcher makes per pointer argument. Kernels: the delayed-scaling update (4 arguments), the
pair cast (20) and the GEMM (TMA descriptors).

    python scripts/launch_micro.py
"""
from __future__ import annotations

import ctypes
import time

import torch

from tritium.kernels import gemm as kgemm
from tritium.kernels import scaling as kscaling
from tritium.kernels._launch import TensorDesc, _current_device, _raw_stream


def per_call(name, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    print(f"{name:<58} {1e6 * best:8.2f} us", flush=True)


def main():
    dev = torch.device("cuda")
    hist = torch.zeros(16, 3, device=dev)
    scale = torch.ones(3, device=dev)
    update = kscaling.prepared_update(hist, scale, 448.0, 0, "max")
    update()
    launcher = kscaling._launch_update
    per_call("scale update: Launcher call (prepared partial)", update)
    args = (hist, scale, 16, 3)
    const = dict(FP8_MAX=448.0, MARGIN_DIV=1.0, MOST_RECENT=False, BLOCK_L=16)
    per_call("  Launcher.key", lambda: launcher.key(0, args, 4, const))
    _, function, metadata, cvals, _, _, compiled = next(iter(launcher._cache.values()))
    run = compiled.run
    stream = _raw_stream(0)
    per_call("  _raw_stream + _current_device", lambda: (_raw_stream(_current_device())))
    per_call("  compiled.run, tensor args",
             lambda: run(3, 1, 1, stream, function, metadata, None, None, None, *args, *cvals))
    iargs = (hist.data_ptr(), scale.data_ptr(), 16, 3)
    per_call("  compiled.run, int pointers",
             lambda: run(3, 1, 1, stream, function, metadata, None, None, None, *iargs, *cvals))
    launch = run.launch
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    per_call("  C launch, int pointers",
             lambda: launch(3, 1, 1, stream, function, coop, pdl, None, None, metadata, None,
                            None, None, *iargs, *cvals))
    per_call("  C launch, tensor args",
             lambda: launch(3, 1, 1, stream, function, coop, pdl, None, None, metadata, None,
                            None, None, *args, *cvals))
    per_call("  tensor.data_ptr()", hist.data_ptr)
    cuda = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    ptr = ctypes.c_uint64(hist.data_ptr())
    per_call("  ctypes cuPointerGetAttribute (incl. ctypes cost)",
             lambda: cuda.cuPointerGetAttribute(ctypes.byref(out), 3, ptr))
    per_call("  ctypes cuCtxGetCurrent (ctypes cost reference)",
             lambda: cuda.cuCtxGetCurrent(ctypes.byref(out)))

    # GEMM: three TMA descriptors
    if torch.cuda.get_device_capability()[0] >= 9:
        a = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
        si = torch.ones(1, device=dev)
        per_call("GEMM 256x256x512 fast: kernels.gemm.fp8_gemm_tn",
                 lambda: kgemm.fp8_gemm_tn(a, b, si, si, torch.bfloat16, fast_accum=True))
        o = torch.empty(256, 256, device=dev, dtype=torch.bfloat16)
        per_call("  same, out= given",
                 lambda: kgemm.fp8_gemm_tn(a, b, si, si, torch.bfloat16, fast_accum=True, out=o))
        per_call("  3x TensorDesc(...)",
                 lambda: (TensorDesc(a, (128, 128)), TensorDesc(b, (256, 128)),
                          TensorDesc(o, (128, 256))))
        try:
            fill = compiled_fill()
            per_call("  fill_tma_descriptor (one)",
                     lambda: fill(a.data_ptr(), 128, 1, 0, [128, 128], [256, 512], [512, 1], 0))
        except Exception as exc:  # an internal API: report, go on
            print("fill_tma_descriptor:", repr(exc))
        per_call("torch._scaled_mm 256x256x512 (precise)",
                 lambda: torch._scaled_mm(a, b.t(), scale_a=si, scale_b=si,
                                          out_dtype=torch.bfloat16))
        per_call("torch.empty(256, 256) bf16",
                 lambda: torch.empty(256, 256, device=dev, dtype=torch.bfloat16))


def compiled_fill():
    import triton
    return triton.runtime.driver.active.utils.fill_tma_descriptor


if __name__ == "__main__":
    main()
