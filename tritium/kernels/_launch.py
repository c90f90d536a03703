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
TMA descriptors travel as `TensorDesc`, Triton's host `TensorDescriptor` built without its
Python validation (the callers' layouts are checked where they are made); the key holds the
base's dtype and the block shape, what the compiled signature ("tensordesc<fp8[128, 128]>")
depends on. Its shape and strides are runtime values, encoded at each launch.
Assumes every constexpr parameter comes after the runtime parameters (checked).
"""
from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


_Tensor = torch.Tensor
# CPU builds of torch have neither; launches on CUDA only happen where they exist.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), without triton.next_power_of_2's cost."""
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    """The SM count of CUDA device `index` (persistent grids)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


class TensorDesc(TensorDescriptor):
    """A TMA descriptor of a 2D tensor with a contiguous last dim and a 16-byte-aligned base,
    made without TensorDescriptor's per-call validation (host time on every GEMM)."""

    def __init__(self, t: torch.Tensor, block_shape: tuple):
        self.base, self.shape, self.strides = t, t.shape, t.stride()
        self.block_shape, self.padding = block_shape, "zero"


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

    def _plain(self, grid, args, num_warps, num_stages, constexprs):
        """Triton's own launch (compiles on a miss); returns the compiled kernel."""
        if num_stages is not None:
            constexprs = {**constexprs, "num_stages": num_stages}
        return self.kernel[grid](*args, num_warps=num_warps, **constexprs)

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
            elif a.__class__ is TensorDesc:
                key.append((a.base.dtype, a.block_shape))
            else:
                key.append(_spec(a))
        return tuple(key)

    def __call__(self, grid, *args, num_warps: int = 4, num_stages=None, **constexprs):
        cache = self._cache
        first = args[0].base if args[0].__class__ is TensorDesc else args[0]
        if cache is None or not first.is_cuda:
            return self._plain(grid, args, num_warps, num_stages, constexprs)
        device = _current_device()
        key = self.key(device, args, num_warps if num_stages is None else (num_warps, num_stages),
                       constexprs)
        hit = cache.get(key)
        if hit is None:
            compiled = self._plain(grid, args, num_warps, num_stages, constexprs)
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
