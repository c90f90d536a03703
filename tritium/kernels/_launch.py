"""Low-overhead launches of @triton.jit kernels on CUDA.

Triton's own `kernel[grid](...)` binds arguments, computes a specialization key and builds
launch metadata on every call: tens of microseconds of host time, which an eager FP8 Linear
would pay at each of its launches per step. `Launcher` keys the compiled kernel on what Triton
specializes on (tensor dtypes and 16-byte alignment, integer divisibility by 16 / equality to 1
/ 64-bit range, the constexpr values, num_warps, the device) and, on a hit, calls the compiled
kernel's C entry point itself. A miss (or a CPU tensor under TRITON_INTERPRET) goes through
Triton's normal path. (Triton's `cdiv` / `next_power_of_2` are constexpr-function objects whose
calls cost host time too: launchers here do that arithmetic in plain Python, `-(-n // d)` and
`next_pow2`.)

The direct path (measured on an H100: an FP8 Linear step 110 us of host cheaper than through
`compiled.run`) passes tensors as their int device pointers, which the C entry point takes as
they are; given a tensor it calls `data_ptr()` and asks the driver about each pointer
(cuPointerGetAttribute). TMA descriptors travel as `TensorDesc`, Triton's host
`TensorDescriptor` built without its Python validation (the callers' layouts are checked where
they are made); the key holds the base's dtype and the block shape, what the compiled signature
("tensordesc<fp8[128, 128]>") depends on. Each descriptor is encoded into a CUtensorMap once per
(pointer, shape, strides, layout) and kept (steady-state steps reuse the allocator's addresses),
where Triton's wrapper encodes every descriptor at every launch. Where Triton's launcher does not
have the layout this relies on (another Triton version, scratch memory), the hit goes through
`compiled.run` with the original arguments.
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
        """What Triton specializes the compiled kernel on (the diagnostics' copy of the inline
        computation in __call__)."""
        return _key_and_flat(device, args, num_warps, constexprs)[0]

    def fixed(self, grid, *args, num_warps: int = 4, num_stages=None, **constexprs):
        """This launch as a call with no arguments, for arguments that never change (tensors
        whose storage stays put, e.g. a scaling state's): after its first call, each call is
        the C entry point with a prebuilt argument list."""
        return _FixedLaunch(self, grid, args, num_warps, num_stages, constexprs)

    def __call__(self, grid, *args, num_warps: int = 4, num_stages=None, **constexprs):
        cache = self._cache
        first = args[0].base if args[0].__class__ is TensorDesc else args[0]
        if cache is None or not first.is_cuda:
            return self._plain(grid, args, num_warps, num_stages, constexprs)
        device = _current_device()
        key, flat = _key_and_flat(
            device, args, num_warps if num_stages is None else (num_warps, num_stages), constexprs)
        hit = cache.get(key)
        if hit is None:
            compiled = self._plain(grid, args, num_warps, num_stages, constexprs)
            cache[key] = _entry(compiled, tuple(constexprs[n] for n in self.constexpr_names),
                                [i for i, a in enumerate(args) if a.__class__ is TensorDesc])
            return
        launch, function, metadata, constexpr_values, tma, base, _ = hit
        g = (*grid, 1, 1)
        if launch is None:  # Triton's compiled launcher with the original arguments
            base(g[0], g[1], g[2], _raw_stream(device), function, metadata, None, None, None,
                 *args, *constexpr_values)
            return
        if tma:
            flat = _expand_descriptors(flat, tma)
        launch(g[0], g[1], g[2], _raw_stream(device), function, *base, metadata, None, None,
               None, *flat, *constexpr_values)


class _FixedLaunch:
    """See Launcher.fixed."""

    def __init__(self, launcher, grid, args, num_warps, num_stages, constexprs):
        self._launcher, self._grid, self._args = launcher, tuple(grid), args
        self._options = dict(num_warps=num_warps, num_stages=num_stages, **constexprs)
        self._c_launch = self._tail = None

    def __call__(self):
        if self._c_launch is not None:
            self._c_launch(*self._grid, _raw_stream(self._device), *self._tail)
            return
        self._launcher(self._grid, *self._args, **self._options)
        self._bind()

    def _bind(self):
        """Prebuild the direct call once the launcher's cache holds this launch's entry."""
        launcher, args, options = self._launcher, self._args, dict(self._options)
        if launcher._cache is None or not args[0].is_cuda:
            return
        warps, stages = options.pop("num_warps"), options.pop("num_stages")
        device = _current_device()
        key, flat = _key_and_flat(device, args, warps if stages is None else (warps, stages),
                                  options)
        hit = launcher._cache.get(key)
        if hit is None or hit[0] is None or hit[4]:  # not compiled yet / no direct path / TMA
            return
        launch, function, metadata, constexpr_values, _, base, _ = hit
        self._device = device
        self._grid = (*self._grid, 1, 1)[:3]
        self._tail = (function, *base, metadata, None, None, None, *flat, *constexpr_values)
        self._c_launch = launch


def _key_and_flat(device, args, warps, constexprs):
    """(key, flat): the specialization key, and the arguments as the C launcher takes them
    (tensors as their int device pointers: it then neither calls data_ptr() nor asks the
    driver about the pointer)."""
    key = [device, warps, *constexprs.values()]
    flat = []
    for a in args:
        if a.__class__ is int:
            key.append(a if -16 < a < 16 else (not a & 15, -0x80000000 <= a < 0x80000000))
            flat.append(a)
        elif isinstance(a, _Tensor):
            ptr = a.data_ptr()
            key.append(a.dtype)
            key.append(ptr & 15)
            flat.append(ptr)
        elif a.__class__ is TensorDesc:
            key.append((a.base.dtype, a.block_shape))
            flat.append(a)
        else:
            key.append(_spec(a))
            flat.append(a)
    return tuple(key), flat


# --- the direct launch (Triton 3.6's compiled-launcher layout; anything else: `run`) ---------
# compiled.run is a CudaLauncher: __call__(gx, gy, gz, stream, function, *args) allocates
# scratch memory when the kernel needs some, then calls `launch`, the C entry point (or, for
# kernels taking TMA descriptors, a Python wrapper that encodes each descriptor with
# fill_tma_descriptor and then calls the C entry point). The direct path calls the C entry point
# itself, with the descriptors encoded once per (pointer, shape, strides, layout) and kept.

def _entry(compiled, constexpr_values: tuple, desc_positions: list) -> tuple:
    """(launch, function, metadata, constexpr_values, tma, base, compiled) for a cache hit:
    launch None means "call base (compiled.run) with the original arguments". `compiled` rides
    along so that the module holding the CUfunction lives as long as the entry."""
    run = compiled.run
    slow = (None, compiled.function, compiled.packed_metadata, constexpr_values, None, run,
            compiled)
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "global_scratch_size", 1) or \
            getattr(run, "profile_scratch_size", 1):
        return slow
    tma = None
    if desc_positions:
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        launch, encoder = _c_launch_under(launch), _tma_encoder()
        if launch is None or encoder is None or not metas or \
                len(metas) != len(desc_positions) or any(m.get("fp4_padded") for m in metas):
            return slow
        fill, dtypes = encoder
        tma = [(pos, (m["swizzle"], m["elem_size"], dtypes[m["elem_type"]],
                      tuple(m["block_size"])), fill)
               for pos, m in zip(desc_positions, metas)]
    elif not callable(launch) or hasattr(launch, "__code__"):  # a Python wrapper: not ours
        return slow
    base = (run.launch_cooperative_grid, run.launch_pdl, None, None)
    return (launch, compiled.function, compiled.packed_metadata, constexpr_values, tma, base,
            compiled)


def _c_launch_under(wrapper):
    """The C entry point that Triton's descriptor-expanding wrapper closes over, or None."""
    code = getattr(wrapper, "__code__", None)
    if code is None or "launcher" not in code.co_freevars:
        return None
    return wrapper.__closure__[code.co_freevars.index("launcher")].cell_contents


@functools.lru_cache(maxsize=None)
def _tma_encoder():
    """(fill_tma_descriptor, dtype map) of Triton's CUDA backend, or None (internal API:
    without it, kernels taking descriptors launch through Triton's own wrapper)."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        from triton.runtime import driver
        return driver.active.utils.fill_tma_descriptor, TMA_DTYPE_DEVICE_TO_HOST
    except Exception:  # pragma: no cover - other Triton versions / backends
        return None


_tensor_maps: dict = {}
_MAX_TENSOR_MAPS = 1024


def _expand_descriptors(flat: list, tma: list) -> list:
    """Each TensorDesc in flat becomes (encoded CUtensorMap, *shape, *strides), as the C entry
    point takes it. An encoded map holds only the pointer, shape, strides and layout, so one
    encoded for the same four values is the same map (kept in `_tensor_maps`). flat is the
    caller's fresh list: expanded in place."""
    out = flat
    for pos, layout, fill in reversed(tma):  # back to front: earlier positions stay valid
        d = out[pos]
        ptr = d.base.data_ptr()
        k = (ptr, d.shape, d.strides, layout)
        cu_map = _tensor_maps.get(k)
        if cu_map is None:
            if len(_tensor_maps) >= _MAX_TENSOR_MAPS:
                _tensor_maps.clear()
            swizzle, elem_size, elem_type, block = layout
            cu_map = fill(ptr, swizzle, elem_size, elem_type, block, d.shape, d.strides, 0)
            _tensor_maps[k] = cu_map
        out[pos:pos + 1] = (cu_map, *d.shape, *d.strides)
    return out


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator (torch's caching one) for kernels that build TMA descriptors on
    the device (`tl.make_tensor_descriptor` needs a little global scratch). Triton keeps the
    allocator in a ContextVar, so a thread that has none (autograd's backward thread) gets it
    set here, just before such a launch; an allocator set by the caller is kept."""
    import triton
    from triton.runtime import _allocation
    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
