"""Low-overhead launches of @triton.jit kernels on CUDA.

Triton's own `kernel[grid](...)` binds arguments, computes a specialization key and builds
launch metadata on every call: tens of microseconds of host time, which an eager FP8 Linear
would pay at each of its four launches per step. `Launcher` keys the compiled kernel on what
Triton specializes on (tensor dtypes and 16-byte alignment, integer divisibility by 16 /
equality to 1 / 64-bit range, the constexpr values, num_warps, the device) and, on a hit, calls
the compiled kernel's launcher directly. A miss (or a CPU tensor under TRITON_INTERPRET) goes
through Triton's normal path. (Triton's `cdiv` / `next_power_of_2` are constexpr-function
objects whose calls cost host time too: launchers here do that arithmetic in plain Python,
`-(-n // d)` and `next_pow2`.)
Assumes every constexpr parameter comes after the runtime parameters (checked).
"""
from __future__ import annotations

import torch


_Tensor = torch.Tensor
# CPU builds of torch have neither; launches on CUDA only happen where they exist.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), without triton.next_power_of_2's cost."""
    return 1 << max(n - 1, 0).bit_length()


def _spec(a):
    """What Triton specializes a runtime argument other than a tensor or int on (the values of
    floats are not: they would make every new learning rate a cache miss)."""
    cls = a.__class__
    return cls if cls is float else (cls, a)


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

    @staticmethod
    def key(device, args, num_warps, constexprs) -> tuple:
        """What Triton specializes the compiled kernel on, computed inline (every launch)."""
        key = [device, num_warps, *constexprs.values()]
        for a in args:
            if a.__class__ is int:
                key.append(a if -16 < a < 16 else (not a & 15, -0x80000000 <= a < 0x80000000))
            elif isinstance(a, _Tensor):
                key.append(a.dtype)
                key.append(a.data_ptr() & 15)
            else:
                key.append(_spec(a))
        return tuple(key)

    def __call__(self, grid, *args, num_warps: int = 4, **constexprs):
        cache = self._cache
        if cache is None or not args[0].is_cuda:
            return self.kernel[grid](*args, num_warps=num_warps, **constexprs)
        device = _current_device()
        key = self.key(device, args, num_warps, constexprs)
        hit = cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            # what a direct launch passes: the launcher, the CUfunction, the packed metadata
            # and the constexprs in parameter order (fixed for this key); `compiled` rides
            # along so that the module holding the CUfunction lives as long as the entry
            cache[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                          tuple(constexprs[n] for n in self.constexpr_names), compiled)
            return
        run, function, metadata, constexpr_values, _ = hit
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], _raw_stream(device), function, metadata, None, None, None,
            *args, *constexpr_values)
