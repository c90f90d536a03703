"""Low-overhead launches of @triton.jit kernels on CUDA.

Triton's own `kernel[grid](...)` binds arguments, computes a specialization key and builds
launch metadata on every call: tens of microseconds of host time, which an eager FP8 Linear
pays five times per step. `Launcher` keys the compiled kernel on what Triton specializes on
(tensor dtypes and 16-byte alignment, integer divisibility by 16 / equality to 1 / 64-bit range,
the constexpr values, num_warps, the device) and, on a hit, calls the compiled kernel's launcher
directly. A miss (or a CPU tensor under TRITON_INTERPRET) goes through Triton's normal path.
Assumes every constexpr parameter comes after the runtime parameters (checked).
"""
from __future__ import annotations

import torch


_Tensor = torch.Tensor
# CPU builds of torch have neither; launches on CUDA only happen where they exist.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _spec(a):
    if isinstance(a, _Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if a.__class__ is int:
        return (a & 15) == 0, a == 1, a >= 0x80000000 or a < -0x80000000
    return a.__class__, a


class Launcher:
    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        if params is None:  # TRITON_INTERPRET=1: an InterpretedFunction, always the plain launch
            self.constexpr_names, self._cache = [], None
            return
        flags = [p.is_constexpr for p in params]
        if flags != sorted(flags):
            raise ValueError(f"{kernel.__name__}: constexpr parameters must come last")
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        self._cache = {}

    def __call__(self, grid, *args, num_warps: int = 4, **constexprs):
        first = args[0]
        if not first.is_cuda or self._cache is None:
            return self.kernel[grid](*args, num_warps=num_warps, **constexprs)
        device = _current_device()
        key = (device, num_warps, *constexprs.values(), *map(_spec, args))
        compiled = self._cache.get(key)
        if compiled is None:
            self._cache[key] = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        compiled.run(g0, g1, g2, _raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                     None, *args, *(constexprs[n] for n in self.constexpr_names))
