"""The `interp` tier: Triton kernels in Triton's CPU interpreter, bit for bit against `tritium.ref`.

Loading rule. `@triton.jit` picks interpreter or compiler when the kernel is *defined* (Triton
reads TRITON_INTERPRET at decoration time), so the variable must be set before triton/tritium are
imported, i.e. by the command line (`make test-interp`). This file never sets it: the cpu tier also
collects this directory (then deselects it by marker), and setting the variable here would make
tritium launch its kernels in the interpreter for every cpu test that runs after this import.
Without the variable the test modules here are not collected at all and nothing is patched.

The interpreter bug (Triton 3.6, `triton/runtime/interpreter.py`). Float conversions that are not
plain numpy `astype` go through the module function `_convert_float`: fp32 <-> bf16
(`InterpreterBuilder.cast_impl`, used by `create_fp_trunc/create_fp_ext`) and anything touching
fp8 or a non-default rounding mode (`InterpreterBuilder.create_fp_to_fp`). It rebuilds the bits
by hand and gets them wrong: "RTNE" adds the first cut-off bit (ties round away, not to even),
the carry out of the mantissa is OR-ed instead of added into the exponent (1.9375 -> e4m3 1.0),
the exponent is clamped instead of saturating the value (500 -> e4m3 256), NaN becomes a number
(fp32 NaN -> e4m3 384; e4m3 NaN -> fp32 480), results that land in the subnormal range are
truncated, and fp32 -> bf16 (rounding mode None) truncates. fp32 <-> fp16 uses numpy and is right.

The patch. `_convert_float` is looked up as a module global at call time, so replacing it in
`triton.runtime.interpreter` reroutes every such conversion through torch, whose conversions
are single roundings to nearest even (fp8 goes through an exact fp32 and then RTNE):
  * fp8 destinations saturate like the GPU's `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`, which Triton
    emits for these casts: finite values and +-inf are clamped to +-fp8_max first, NaN stays NaN
    (for in-range inputs this is exactly torch's `.to()`; tritium's kernels clamp anyway);
  * bf16/fp16 destinations are torch's `.to()` (= `cvt.rn.{bf16,f16}.f32`: RTNE, overflow -> inf);
  * "rtz" is RTNE stepped back by one unit where it rounded away from zero;
  * upcasts are exact; pairs torch cannot do in one rounding (fp64 -> narrower than fp32) or does
    not know (AMD's fnuz fp8, e4b15) keep Triton's own code.
NaN payloads and signs are whatever torch produces; compare NaN as NaN when checking a GPU.

A second bug, same file: comparisons (`InterpreterBuilder.create_icmp*/create_fcmp*`) go through
`binary_op`, which tags the boolean result with the *operand's* dtype. `create_splat` allocates
by that tag, so a scalar comparison broadcast into a block becomes a float32/int32 array, and
`block_mask & (scalar != 0)` raises a numpy TypeError (the delayed-scaling kernel does exactly
this). The patch re-tags comparison results as int1 with bool data.

`test_interpreter_patch.py` proves the patched interpreter right and shows the unpatched one wrong.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir as _ir
from triton.runtime import interpreter

INTERPRET = bool(triton.knobs.runtime.interpret)

if not INTERPRET:
    # cpu tier (or a plain `pytest tests/interp`): collect nothing here, patch nothing.
    collect_ignore_glob = ["test_*.py"]

_TORCH_FLOAT = {
    tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
}
_INT_OF_WIDTH = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16),
                 32: (np.int32, torch.int32), 64: (np.int64, torch.int64)}
_UINT_OF_WIDTH = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def _bits_to_torch(arr, tl_dtype) -> torch.Tensor:
    """numpy array holding values (fp16/32/64) or raw bits (bf16, fp8) -> flat torch tensor."""
    np_int, _ = _INT_OF_WIDTH[tl_dtype.primitive_bitwidth]
    flat = np.array(arr, copy=True).reshape(-1).view(np_int)
    return torch.from_numpy(flat).view(_TORCH_FLOAT[tl_dtype])


def torch_cast(x: torch.Tensor, dst: torch.dtype, rtz: bool = False) -> torch.Tensor:
    """The GPU's conversion of `x` to `dst`: RTNE (or RTZ), fp8 saturating with NaN kept."""
    if dst.is_floating_point and dst.itemsize == 1:
        limit = torch.finfo(dst).max
        x = torch.where(torch.isnan(x), x, x.clamp(-limit, limit))
    y = x.to(dst)
    if rtz:  # exact results (all upcasts) never step
        away = torch.isfinite(x) & (y.double().abs() > x.double().abs())
        _, t_int = _INT_OF_WIDTH[dst.itemsize * 8]
        bits = y.view(t_int)
        # bit patterns are monotonic in magnitude for either sign: one step down = toward zero
        y = torch.where(away, bits - 1, bits).view(dst)
    return y


def _convert_float_via_torch(input, input_dtype, output_dtype, rounding_mode):
    """Drop-in for `triton.runtime.interpreter._convert_float` (same arguments and result:
    an unsigned-int array of the output's bits, shaped like `input`)."""
    src, dst = _TORCH_FLOAT.get(input_dtype), _TORCH_FLOAT.get(output_dtype)
    narrowing_fp64 = src is torch.float64 and dst not in (torch.float64, torch.float32)
    if src is None or dst is None or narrowing_fp64:
        return _ORIGINAL[(interpreter, "_convert_float")](input, input_dtype, output_dtype,
                                                          rounding_mode)
    rtz = rounding_mode == _ir.ROUNDING_MODE.RTZ
    y = torch_cast(_bits_to_torch(input, input_dtype), dst, rtz=rtz)
    _, t_int = _INT_OF_WIDTH[output_dtype.primitive_bitwidth]
    out = y.view(t_int).numpy().view(_UINT_OF_WIDTH[output_dtype.primitive_bitwidth])
    return out.reshape(np.shape(input))


def _bool_comparison(create_cmp):
    def create_cmp_int1(self, lhs, rhs):
        out = create_cmp(self, lhs, rhs)
        return interpreter.TensorHandle(np.asarray(out.data).astype(bool), tl.int1)

    return create_cmp_int1


def _apply_patch() -> dict:
    """Patch once per process; return {(owner, name): original} for `unpatched_interpreter`."""
    originals = getattr(interpreter, "_tritium_originals", None)
    if originals is not None:
        return originals
    originals = {(interpreter, "_convert_float"): interpreter._convert_float}
    interpreter._convert_float = _convert_float_via_torch
    builder = interpreter.InterpreterBuilder
    for name in list(vars(builder)):
        if name.startswith(("create_icmp", "create_fcmp")):
            originals[(builder, name)] = getattr(builder, name)
            setattr(builder, name, _bool_comparison(getattr(builder, name)))
    interpreter._tritium_originals = originals
    return originals


def _check_kernels_interpreted() -> None:
    """TRITON_INTERPRET set after tritium was imported leaves compiled kernels behind."""
    from tritium.kernels import cast

    if not isinstance(cast._cast_transpose_kernel, interpreter.InterpretedFunction):
        raise pytest.UsageError("tritium.kernels was imported before TRITON_INTERPRET=1 was set; "
                                "set it on the command line (make test-interp)")


if INTERPRET:
    _ORIGINAL = _apply_patch()
    _check_kernels_interpreted()


@pytest.fixture
def unpatched_interpreter(monkeypatch):
    """Triton's own interpreter code for the duration of one test (to document its bugs)."""
    for (owner, name), original in _ORIGINAL.items():
        monkeypatch.setattr(owner, name, original)
    yield


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh data per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_report_header(config):
    if not INTERPRET:
        return ("tests/interp: TRITON_INTERPRET is not set, nothing there is collected "
                "(make test-interp)")
