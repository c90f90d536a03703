"""Host cost of the parts of one cast launch: allocation, key, Triton's launcher call."""
import time

import torch
import triton

from tritium.kernels import _launch
from tritium.kernels import cast as kc

x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
scale = torch.ones(1, device="cuda")
amax = torch.zeros(1, device="cuda")
e4 = torch.float8_e4m3fn
L = kc._launch_cast_transpose


def t(name, fn, n=500):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"{name:<40} {dt * 1e6:7.1f} us")


data = torch.empty(256, 512, device="cuda", dtype=e4)
data_t = torch.empty(512, 256, device="cuda", dtype=e4)
si = torch.empty(1, device="cuda")
args = (x, data, data_t, scale, amax, si, 256, 512, 256, 512)
cx = dict(FP8_MAX=448.0, OUT_DTYPE=kc._TL_FP8[e4], WRITE_DATA=True, WRITE_T=True, UPDATE_AMAX=True,
          CURRENT=False, EPS=0.0, POW2=False, BLOCK_M=64, BLOCK_N=128)
grid = (4, 4)
t("full cast_transpose", lambda: kc.cast_transpose(x, scale, amax, e4, pad_rows_to=16, write_transpose=True))
t("3x torch.empty", lambda: (torch.empty(256, 512, device="cuda", dtype=e4), torch.empty(512, 256, device="cuda", dtype=e4), torch.empty(1, device="cuda")))
t("Launcher call", lambda: L(grid, *args, num_warps=8, **cx))
t("key only", lambda: (_launch._current_device(), 8, *cx.values(), *map(_launch._spec, args)))
key = (_launch._current_device(), 8, *cx.values(), *map(_launch._spec, args))
compiled = L._cache[key]
stream = _launch._raw_stream(0)
t("compiled.run only", lambda: compiled.run(4, 4, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *cx.values()))
t("triton kernel[grid] (normal)", lambda: kc._cast_transpose_kernel[grid](*args, num_warps=8, **cx))
t("raw stream", lambda: _launch._raw_stream(0))
t("fp8_max + dict", lambda: (kc.fp8_max(e4), kc._TL_FP8[e4]))
t("triton.cdiv x2", lambda: (triton.cdiv(256, 64), triton.cdiv(512, 128)))
