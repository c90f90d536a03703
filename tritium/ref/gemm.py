"""Pure-PyTorch twin of `tritium.kernels.gemm`: the emulated FP8 GEMM (the CPU path, GPUs
without FP8 tensor cores, TRITIUM_EMULATE_FP8=1) and the test oracle.

out = (a @ b.T) * (a_scale_inv * b_scale_inv) + bias, with a [M, K] and b [N, K] fp8. The fp8
values are exact in fp32 and so are their products; they are summed in fp32, scaled, biased
(with `accumulate`, out's old values added in fp32) and rounded once to out_dtype. `fast_accum` is accepted for the signature: the twin always
accumulates in fp32 (the GPU's fast mode accumulates in the tensor cores' narrower format;
docs/numerics.md gives the difference).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cast as ref_cast


def fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None, fast_accum: bool = False,
                out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`out`: a [M, N] tensor of out_dtype with a contiguous last dim to write into (e.g. a row
    block); `accumulate`: add to it instead."""
    res = (a.float() @ b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        res = res + bias.float()
    if accumulate:
        res = res + out.float()
    if out is not None:
        return out.copy_(res)
    return res.to(out_dtype)


def fp8_gemm_tn_pair(first: tuple, second: tuple, fast_accum: bool = False) -> tuple:
    """Two independent GEMMs, each given as (a, b, a_scale_inv, b_scale_inv, out_dtype):
    (fp8_gemm_tn of the first, fp8_gemm_tn of the second), fresh [M, N] results (the kernel
    runs both in one launch)."""
    return tuple(fp8_gemm_tn(*job, fast_accum=fast_accum) for job in (first, second))


def _measured(x: torch.Tensor) -> torch.Tensor:
    """Current scaling: max|x| measured now, a [1] fp32 tensor (`ref.cast.amax_into`)."""
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    ref_cast.amax_into(x, amax)
    return amax


def fp8_dgrad_wgrad(dy: torch.Tensor, dy_scale: Optional[torch.Tensor],
                    dy_amax: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                    w_t: torch.Tensor, w_scale_inv: torch.Tensor, x_t: torch.Tensor,
                    x_scale_inv: torch.Tensor, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                    dbias_dtype: Optional[torch.dtype] = None,
                    current: Optional[tuple] = None) -> tuple:
    """A Linear's backward GEMMs from its high-precision grad under delayed scaling: dy [T, N]
    cast to fp8_dtype with dy_scale (`tritium.ref.cast.cast_transpose`, its amax max-recorded
    into dy_amax), then dx = dy8 @ w (w_t: w8^T [K_in, N]) of dx_dtype and dw = dy8^T @ x
    (x_t: x8^T [K_in, T_padded], zero columns past T) of dw_dtype, precise accumulation; with
    dbias_dtype also dbias = dy.sum(0) (of the unquantized dy, summed in fp32, rounded once):
    (dx [T, K_in], dw [N, K_in], dbias [N] or None). The kernel casts dy's tiles in registers
    as it loads them, and sums dbias from the same tiles. Under current scaling
    (`current=(amax_epsilon, power_2_scale)`, dy_scale and dy_amax None): dy's scale comes
    from max|dy|, measured here first, as `ref.cast.cast_transpose` derives it."""
    t_padded = x_t.shape[1]
    if current is not None:
        dy_amax = _measured(dy)
    dy8, dy8_t, dy_scale_inv = ref_cast.cast_transpose(
        dy, dy_scale, dy_amax, fp8_dtype, pad_rows_to=max(t_padded, 1), write_transpose=True,
        current=current)
    db = None if dbias_dtype is None else dy.float().sum(0).to(dbias_dtype)
    return (fp8_gemm_tn(dy8[:dy.shape[0]], w_t, dy_scale_inv, w_scale_inv, dx_dtype),
            fp8_gemm_tn(dy8_t, x_t, dy_scale_inv, x_scale_inv, dw_dtype), db)


def fp8_gemm_tn_cast_b(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                       b_scale: Optional[torch.Tensor], b_amax: Optional[torch.Tensor],
                       fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None, write_b_t: bool = True,
                       current: Optional[tuple] = None) -> tuple:
    """A small Linear's forward GEMM under delayed scaling with its weight b [N, K] in high
    precision: b cast to fp8_dtype with b_scale (`tritium.ref.cast.cast_transpose`, its amax
    max-recorded into b_amax, its transpose [K, N] with write_b_t), then out = a @ b8.T
    (`fp8_gemm_tn`, fast accumulation, + bias): (out, b8^T or None, b's scale_inv). The kernel
    casts b's tiles in registers as it loads them. Under current scaling (b_scale and b_amax
    None): b's scale from max|b|, measured here first, as in `fp8_dgrad_wgrad`."""
    if current is not None:
        b_amax = _measured(b)
    b8, b8_t, b_scale_inv = ref_cast.cast_transpose(b, b_scale, b_amax, fp8_dtype,
                                                    write_transpose=write_b_t, current=current)
    out = fp8_gemm_tn(a, b8, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum=True)
    return out, b8_t, b_scale_inv


def fp8_gemm_tn_cast_ab(a: torch.Tensor, a_scale: Optional[torch.Tensor],
                        a_amax: Optional[torch.Tensor], b: torch.Tensor,
                        b_scale: Optional[torch.Tensor], b_amax: Optional[torch.Tensor],
                        fp8_dtype: torch.dtype, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None, write_a_t: bool = True,
                        write_b_t: bool = True, current: Optional[tuple] = None) -> tuple:
    """`fp8_gemm_tn_cast_b` with a [M, K] in high precision too: a cast with a_scale (rows
    padded to 16, its amax into a_amax, its transpose [K, M padded] with write_a_t), then the
    GEMM: (out [M, N], a8^T or None, a's scale_inv, b8^T or None, b's scale_inv). Under
    current scaling (scales and amaxes None) both amaxes are measured first (the kernel's
    form: one launch for both, `ref.cast.amax_pair_into`)."""
    if current is not None:
        amaxes = torch.zeros(2, dtype=torch.float32, device=a.device)
        ref_cast.amax_pair_into(a, b, amaxes)
        a_amax, b_amax = amaxes[0:1], amaxes[1:2]
    a8, a8_t, a_scale_inv = ref_cast.cast_transpose(a, a_scale, a_amax, fp8_dtype,
                                                    pad_rows_to=16, write_transpose=write_a_t,
                                                    current=current)
    out, b8_t, b_scale_inv = fp8_gemm_tn_cast_b(a8, a_scale_inv, b, b_scale, b_amax, fp8_dtype,
                                                out_dtype, bias, write_b_t, current)
    return out[:a.shape[0]], a8_t, a_scale_inv, b8_t, b_scale_inv


__all__ = ["fp8_gemm_tn", "fp8_gemm_tn_pair", "fp8_dgrad_wgrad", "fp8_gemm_tn_cast_b",
           "fp8_gemm_tn_cast_ab"]
