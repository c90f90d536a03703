"""The FP8 GEMM's device choice, and the custom ops behind `tritium.functional.gemm.fp8_gemm_tn`.

Which GEMM runs where FP8 tensor cores are (TRITIUM_FP8_GEMM, default "auto"): fast accumulation
(the forward GEMM) runs the Triton kernel `tritium.kernels.gemm`, as fast as cuBLASLt on Hopper
and lighter on the host of an eager step; precise accumulation (dgrad, wgrad) runs cuBLASLt
through `torch._scaled_mm`, ~20% faster there than Triton's split accumulation (measurements:
docs/performance.md); a GEMM of at most HOST_BOUND_MACS multiply-adds runs the Triton kernel in
either mode, where the host costs more than the GPU. Layouts TMA cannot take go to cuBLASLt.
`tensor_core_gemm` is that choice;
eager `fp8_gemm_tn` calls it directly, the ops call it (or the emulated GEMM of
`tritium.ref.gemm` where there are no FP8 tensor cores) under torch.compile.

Ops (tritium::...): fp8_gemm_tn (a new [M, N] result, nothing written in place) and
fp8_gemm_tn_out (writes `out`, e.g. a row block of a larger result, or adds to it with
`accumulate`; no bias, as eager). The operand rules are checked by the caller
(`functional.gemm.check_fp8_gemm_operands`).

`accumulate` (out += the product) runs the Triton kernel, whose epilogue adds out's old tile in
fp32 before its one rounding; cuBLASLt's FP8 GEMM (`torch._scaled_mm`) cannot add to its output,
so where the kernel cannot run (no Triton, a layout TMA cannot take) the product is made in
fp32 and added to out then: the same single rounding, with an fp32 temporary.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import _device, _env
from ..ref import gemm as ref_gemm
from ._common import fresh, tritium_op

# _scaled_mm fuses a bias only for 16-bit outputs of the bias's own dtype.
_BIAS_FUSABLE = (torch.bfloat16, torch.float16)


def _tma_ok(t: Tensor) -> bool:
    """A 2D layout TMA takes: last dim contiguous, base and row stride 16-byte aligned."""
    stride = t.stride()  # one call: stride(i) parses its argument, host time on every GEMM
    return stride[-1] == 1 and not t.data_ptr() & 15 and not (stride[0] * t.element_size()) & 15


# At most 2^29 multiply-adds (e.g. 256 tokens x 512 x 2048) a GEMM takes ~1-2 us of an H100's
# FP8 tensor cores in either accumulation mode, while `torch._scaled_mm` costs 17-28 us of host
# per call in a tight loop and ~60 us inside a small model's eager step (torch.profiler, H100,
# 2026-11-27): such a step is bound by its host, and the Triton kernel's direct launch is the
# cheaper call (docs/performance.md, "Which FP8 GEMM runs").
HOST_BOUND_MACS = 2**29


def triton_by_rule(fast_accum: bool, macs: Optional[int] = None) -> bool:
    """TRITIUM_FP8_GEMM's choice for a GEMM of this accumulation mode and, where given, this
    many multiply-adds (Linear's and GroupedLinear's): "auto" takes Triton for fast
    accumulation and for GEMMs of at most HOST_BOUND_MACS, cuBLASLt for the other precise ones."""
    choice = _env.fp8_gemm()
    if choice != "auto":
        return choice == "triton"
    return fast_accum or (macs is not None and macs <= HOST_BOUND_MACS)


def _use_triton_gemm(a, b, out, fast_accum: bool, accumulate: bool = False) -> bool:
    """The rule, and the Triton kernel for accumulating into out (cuBLASLt cannot). Layouts
    TMA cannot take go to cuBLASLt."""
    if not _device.use_triton(a):  # TRITIUM_FORCE_REF, or no triton
        return False
    if not (accumulate or triton_by_rule(fast_accum, a.shape[0] * b.shape[0] * a.shape[1])):
        return False
    return _tma_ok(a) and _tma_ok(b) and (out is None or _tma_ok(out))


@functools.lru_cache(maxsize=None)
def _kernels():
    """tritium.kernels.gemm, imported on first use (it imports triton)."""
    from ..kernels import gemm as kernel_gemm
    return kernel_gemm


@functools.lru_cache(maxsize=None)
def _small_kernels():
    """tritium.kernels.small_gemm, imported on first use."""
    from ..kernels import small_gemm
    return small_gemm


def tensor_core_gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor,
                     out_dtype: torch.dtype, bias: Optional[Tensor], fast_accum: bool,
                     out: Optional[Tensor], accumulate: bool = False) -> Tensor:
    """The FP8 GEMM on FP8 tensor cores: the Triton kernel or cuBLASLt (module docstring)."""
    if _use_triton_gemm(a, b, out, fast_accum, accumulate):
        return _kernels().fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                       fast_accum, out, accumulate)
    if accumulate:  # cuBLASLt cannot add to its output: an fp32 product, one rounding
        res = cublas_gemm(a, b, a_scale_inv, b_scale_inv, torch.float32, bias, fast_accum, None)
        return out.copy_(res.add_(out))
    return cublas_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, out)


def _small_on_triton(macs: tuple, tma_operands: tuple) -> bool:
    """GEMMs of at most HOST_BOUND_MACS multiply-adds each (none empty), whose TMA operands'
    layouts TMA takes, where TRITIUM_FP8_GEMM lets Triton run: what the one-launch forms below
    take (their tiles are sized for small GEMMs)."""
    return (_env.fp8_gemm() != "cublas" and 0 < min(macs) and max(macs) <= HOST_BOUND_MACS
            and all(_tma_ok(t) for t in tma_operands))


def tensor_core_gemm_pair(first: tuple, second: tuple, fast_accum: bool) -> Optional[tuple]:
    """Two independent small GEMMs, each (a, b, a_scale_inv, b_scale_inv, out_dtype), in one
    launch of the Triton kernel (one launch's host time saved); None where Triton does not
    run or either GEMM is not small, for the caller to run them one by one in its own order."""
    (a0, b0), (a1, b1) = first[:2], second[:2]
    macs = (a0.shape[0] * b0.shape[0] * a0.shape[1], a1.shape[0] * b1.shape[0] * a1.shape[1])
    if not (_device.use_triton(a0) and _small_on_triton(macs, (a0, b0, a1, b1))):
        return None
    return _small_kernels().fp8_gemm_tn_pair(first, second, fast_accum)


def tensor_core_dgrad_wgrad(dy: Tensor, dy_scale: Optional[Tensor], dy_amax: Optional[Tensor],
                            fp8_dtype: torch.dtype, w_t: Tensor, w_scale_inv: Tensor,
                            x_t: Tensor, x_scale_inv: Tensor, dx_dtype: torch.dtype,
                            dw_dtype: torch.dtype, dbias_dtype: Optional[torch.dtype] = None,
                            current: Optional[tuple] = None) -> Optional[tuple]:
    """`tritium.ref.gemm.fp8_dgrad_wgrad` as one Triton launch (dy cast in the GEMMs' loads)
    where both GEMMs are small; None otherwise."""
    (t, n), (k_in, t_padded) = dy.shape, x_t.shape
    if not (_device.use_triton(dy) and dy.stride(-1) == 1
            and _small_on_triton((t * n * k_in, n * k_in * t_padded), (w_t, x_t))):
        return None
    return _small_kernels().fp8_dgrad_wgrad(dy, dy_scale, dy_amax, fp8_dtype, w_t, w_scale_inv,
                                            x_t, x_scale_inv, dx_dtype, dw_dtype, dbias_dtype,
                                            current)


def casts_b_in_gemm(m: int, b: Tensor) -> bool:
    """Whether `tensor_core_gemm_cast_b` / `_cast_ab` take a GEMM of m rows against the
    high-precision b [N, K] by the rule (small, Triton allowed; a's layout aside)."""
    n, k = b.shape
    return _device.use_triton(b) and b.stride(-1) == 1 and _small_on_triton((m * n * k,), ())


def tensor_core_gemm_cast_b(a: Tensor, a_scale_inv: Tensor, b: Tensor,
                            b_scale: Optional[Tensor], b_amax: Optional[Tensor],
                            fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                            bias: Optional[Tensor], write_b_t: bool,
                            current: Optional[tuple] = None) -> Optional[tuple]:
    """`tritium.ref.gemm.fp8_gemm_tn_cast_b` as one Triton launch (b cast in the GEMM's loads)
    where the GEMM is small; None otherwise."""
    if not (a.stride(-1) == 1 and casts_b_in_gemm(a.shape[0], b)):
        return None
    return _small_kernels().fp8_gemm_tn_cast_b(a, a_scale_inv, b, b_scale, b_amax, fp8_dtype,
                                               out_dtype, bias, write_b_t, current)


def tensor_core_gemm_cast_ab(a: Tensor, a_scale: Optional[Tensor], a_amax: Optional[Tensor],
                             b: Tensor, b_scale: Optional[Tensor], b_amax: Optional[Tensor],
                             fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                             bias: Optional[Tensor], write_a_t: bool, write_b_t: bool,
                             current: Optional[tuple] = None) -> Optional[tuple]:
    """`tritium.ref.gemm.fp8_gemm_tn_cast_ab` as one Triton launch where the GEMM is small;
    None otherwise."""
    if not (a.stride(-1) == 1 and casts_b_in_gemm(-(-a.shape[0] // 16) * 16, b)):
        return None
    return _small_kernels().fp8_gemm_tn_cast_ab(a, a_scale, a_amax, b, b_scale, b_amax,
                                                fp8_dtype, out_dtype, bias, write_a_t,
                                                write_b_t, current)


def cublas_gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor,
                out_dtype: torch.dtype, bias: Optional[Tensor], fast_accum: bool,
                out: Optional[Tensor]) -> Tensor:
    """a @ b.T on cuBLASLt (`torch._scaled_mm`, tensorwise scales), into `out` when given; the
    bias fused where cuBLASLt can (a 16-bit output of the bias's own dtype), else added to the
    rounded result."""
    fuse_bias = bias is not None and out_dtype in _BIAS_FUSABLE and bias.dtype == out_dtype
    res = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                           bias=bias if fuse_bias else None, out_dtype=out_dtype,
                           use_fast_accum=fast_accum, out=out)
    if bias is not None and not fuse_bias:
        res = res.add_(bias.to(out_dtype))
    return res


def _gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, out, accumulate=False):
    if not _device.fp8_tensor_cores(a):
        return ref_gemm.fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum,
                                    out, accumulate)
    return tensor_core_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, out,
                            accumulate)


@tritium_op("tritium::fp8_gemm_tn", mutates_args=())
def _op(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
        bias: Optional[Tensor], fast_accum: bool) -> Tensor:
    res = _gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, None)
    return fresh((res,), (a, b, a_scale_inv, b_scale_inv, bias))[0]


@_op.register_fake
def _(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@tritium_op("tritium::fp8_gemm_tn_out", mutates_args=("out",))
def _op_out(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out: Tensor,
            fast_accum: bool, accumulate: bool = False) -> None:
    _gemm(a, b, a_scale_inv, b_scale_inv, out.dtype, None, fast_accum, out, accumulate)


@_op_out.register_fake
def _(a, b, a_scale_inv, b_scale_inv, out, fast_accum, accumulate=False):
    return None


def fp8_gemm_tn(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor,
                out_dtype: torch.dtype, bias: Optional[Tensor] = None, fast_accum: bool = False,
                out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """`tritium.ref.gemm.fp8_gemm_tn`'s signature, through the ops."""
    if out is None:
        return torch.ops.tritium.fp8_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                             fast_accum)
    torch.ops.tritium.fp8_gemm_tn_out(a, b, a_scale_inv, b_scale_inv, out, fast_accum,
                                      accumulate)
    return out


__all__ = ["cublas_gemm", "fp8_gemm_tn", "tensor_core_gemm", "triton_by_rule"]
