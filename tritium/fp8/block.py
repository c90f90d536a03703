"""Per-call choice between the block-scaled Triton kernels and their pure-PyTorch twins.

`quantize_blocks` (Float8BlockScaling's 1x128 / 128x128 casts) runs `tritium.kernels.block_cast`
where `_device.use_triton` says so, else `tritium.ref.block_cast`. `block_gemm_tn` runs the
Triton GEMM on CUDA devices of compute capability >= 9.0 (TMA, FP8 wgmma) when the operands'
rows are 16-byte aligned (K % 16 == 0), and under the interpreter on CPU tensors; elsewhere
(the CPU tier, older GPUs, TRITIUM_EMULATE_FP8=1) the twin, which is exact fp8 products summed
in fp32. `activation_fwd_blocks` / `activation_bwd_blocks` (LayerNormMLP's activation fused
with fc2's 1x128 input casts, its backward with fc1's grad casts) run
`tritium.kernels.act_block_cast` where `quantize_blocks` would run its kernel, else the twins in
`tritium.ref.activation`. `norm_fwd_blocks` (LayerNorm / RMSNorm fused with the next GEMM's
1x128 input casts) runs `tritium.kernels.norm_block_cast` there (hidden <= the norm kernels'
MAX_HIDDEN), else the twins in `tritium.ref.norm`. Where cuBLASLt has a block-scaled GEMM for
the operands (PyTorch >= 2.10 on CUDA >= 12.9, e4m3, K a multiple of 128, of 512 with 128x128
weight blocks: `_cublas_block_ok`) `block_gemm_tn` runs it through `torch._scaled_mm`, unless
TRITIUM_FP8_GEMM=triton; the Triton kernel otherwise (measurements: docs/block_scaling.md).
MXFP8 has no kernel: `quantize_mx` /
`mx_gemm_tn` are the emulation on every device.
"""
from __future__ import annotations

import functools

import torch

from .. import _device, _env
from ..ref import activation as ref_activation
from ..ref import block_cast as ref_cast
from ..ref import block_gemm as ref_gemm
from ..ref import norm as ref_norm

_NORM_MAX_HIDDEN = 65536  # == kernels.norm.MAX_HIDDEN (not imported: it would import triton)


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..kernels import block_cast, block_gemm  # imports triton: on first use only
    return block_cast, block_gemm


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, **kwargs) -> ref_cast.BlockQuantized:
    if kwargs.get("out") is not None or kwargs.get("skip") is not None:
        _check_out(x, fp8_dtype, **kwargs)
    impl = _kernels()[0] if _device.use_triton(x) else ref_cast
    return impl.quantize_blocks(x, fp8_dtype, **kwargs)


def _check_out(x, fp8_dtype, *, block_2d=False, rowwise=True, columnwise=False, skip=None,
               out=None, **_):
    """The buffers of quantize_blocks(out=..., skip=...): checked before any write."""
    if skip is not None and (out is None or skip.dtype != torch.int32 or skip.numel() != 1
                             or skip.device != x.device):
        raise ValueError("quantize_blocks(skip=...) needs out= (the buffers an earlier call "
                         f"wrote) and an int32 [1] flag on {x.device}")
    m, k = x.shape
    mb, kb = -(-m // ref_cast.BLOCK), -(-k // ref_cast.BLOCK)
    s_shape, st_shape = ((mb, kb), (kb, mb)) if block_2d else ((kb, m), (mb, k))
    want = {"data": ((m, k), fp8_dtype, rowwise), "scale_inv": (s_shape, torch.float32, rowwise),
            "data_t": ((k, m), fp8_dtype, columnwise),
            "scale_inv_t": (st_shape, torch.float32, columnwise)}
    if not isinstance(out, ref_cast.BlockQuantized):
        raise ValueError("quantize_blocks: out must be a BlockQuantized of buffers")
    for (name, (shape, dtype, used)), t in zip(want.items(), out):
        if used and (t is None or tuple(t.shape) != shape or t.dtype != dtype
                     or t.device != x.device or not t.is_contiguous()):
            got = None if t is None else f"{t.dtype}{tuple(t.shape)} on {t.device}"
            raise ValueError(f"quantize_blocks: out.{name} must be a contiguous {dtype}{shape} "
                             f"tensor on {x.device}, got {got}")


def activation_fwd_blocks(x: torch.Tensor, kind: str, fp8_dtype: torch.dtype,
                          **kwargs) -> ref_cast.BlockQuantized:
    if _device.use_triton(x):
        from ..kernels import act_block_cast  # imports triton: on first use only
        return act_block_cast.activation_fwd_blocks(x, kind, fp8_dtype, **kwargs)
    return ref_activation.activation_fwd_blocks(x, kind, fp8_dtype, **kwargs)


def activation_bwd_blocks(dy: torch.Tensor, x: torch.Tensor, kind: str, fp8_dtype: torch.dtype,
                          **kwargs):
    if _device.use_triton(x):
        from ..kernels import act_block_cast  # imports triton: on first use only
        return act_block_cast.activation_bwd_blocks(dy, x, kind, fp8_dtype, **kwargs)
    return ref_activation.activation_bwd_blocks(dy, x, kind, fp8_dtype, **kwargs)


def norm_fwd_blocks(x: torch.Tensor, weight: torch.Tensor, bias, eps: float,
                    zero_centered_gamma: bool, is_rms: bool, fp8_dtype: torch.dtype, **kwargs):
    """(y or None, BlockQuantized, mean (empty for RMSNorm), rstd) of the fused norm."""
    if x.shape[-1] <= _NORM_MAX_HIDDEN and _device.use_triton(x):
        from ..kernels import norm_block_cast as impl  # imports triton: on first use only
    else:
        impl = ref_norm
    if is_rms:
        y, bq, rstd = impl.rmsnorm_fwd_blocks(x, weight, eps, zero_centered_gamma, fp8_dtype,
                                              **kwargs)
        return y, bq, rstd.new_empty(0), rstd
    return impl.layernorm_fwd_blocks(x, weight, bias, eps, zero_centered_gamma, fp8_dtype,
                                     **kwargs)


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _gemm_on_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not _device.use_triton(a) or not a.numel() or not b.numel():
        return False   # (empty operands, e.g. an expert with no tokens: the twin, no launch)
    if a.is_cuda and (_env.emulate_fp8() or not _hopper(a.get_device())):
        return False
    return all(t.stride(-1) == 1 and not t.data_ptr() & 15 and not t.stride(0) & 15
               for t in (a, b))


@functools.lru_cache(maxsize=None)
def _cublas_blockwise() -> bool:
    """torch._scaled_mm takes DeepSeek-style block scales (1x128 / 128x128) on Hopper from
    PyTorch 2.10 built with CUDA >= 12.9 (cuBLASLt's VEC128 / BLK128x128 scale modes)."""
    major_minor = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return major_minor >= (2, 10) and cuda >= (12, 9)


def _cublas_block_ok(a, b, a_scale_inv, b_scale_inv, b_block_2d: bool) -> bool:
    """cuBLASLt's block-scaled GEMM takes these operands: e4m3 both (it has no e5m2 form), K
    whole 128-slices, and, with 128x128 weight blocks, a K-block count that is a multiple of 4
    (its scale layout pads the K blocks to 4: ours would need a padded copy). Scale layouts:
    `cublas_block_gemm_tn`."""
    kb = a.shape[1] // 128
    return (a.dtype == b.dtype == torch.float8_e4m3fn and a.shape[1] % 128 == 0
            and (not b_block_2d or kb % 4 == 0) and _cublas_blockwise()
            and a_scale_inv.is_contiguous() and b_scale_inv.is_contiguous())


def cublas_block_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias=None, *,
                         b_block_2d: bool = False) -> torch.Tensor:
    """`block_gemm_tn` through cuBLASLt (`torch._scaled_mm` with block scales; mat2 = b.t(),
    [K, N]). Our scale grids are already in its layouts: a's 1x128 `[Kb, M]` transposed is its
    `[M, Kb]` "outer-dim-major" (strides (1, M)); b's 1x128 `[Kb, N]` is its `[Kb, N]` as it is
    (N-major: wgrad, 1x128 x 1x128); b's 128x128 `[Nb, Kb]` transposed is its `[Kb, Nb]`
    "near-inner-dim-major" (strides (1, Kb), 16-byte aligned when Kb % 4 == 0: fprop / dgrad,
    1x128 x 128x128). A bias is added to the rounded result (one more rounding than the twin,
    as `tritium.ops.gemm` does where cuBLASLt cannot fuse a bias)."""
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv.t(),
                           scale_b=b_scale_inv.t() if b_block_2d else b_scale_inv,
                           out_dtype=out_dtype)
    return out if bias is None else out.add_(bias.to(out_dtype))


def block_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias=None, *,
                  b_block_2d: bool = False) -> torch.Tensor:
    if not _gemm_on_kernel(a, b):
        return ref_gemm.block_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                      b_block_2d=b_block_2d)
    if a.is_cuda and _env.fp8_gemm() != "triton" and _cublas_block_ok(
            a, b, a_scale_inv, b_scale_inv, b_block_2d):
        return cublas_block_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                    b_block_2d=b_block_2d)
    return _kernels()[1].block_gemm_tn(a, b, a_scale_inv, b_scale_inv, out_dtype, bias,
                                       b_block_2d=b_block_2d)


quantize_mx = ref_cast.quantize_mx
mx_gemm_tn = ref_gemm.mx_gemm_tn

__all__ = ["quantize_blocks", "activation_fwd_blocks", "activation_bwd_blocks", "norm_fwd_blocks",
           "block_gemm_tn", "cublas_block_gemm_tn", "quantize_mx", "mx_gemm_tn"]
