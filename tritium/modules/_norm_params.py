"""The layer-norm parameters that LayerNormLinear and LayerNormMLP put in front of their GEMMs.

`normalization` is "LayerNorm" (params `layer_norm_weight`, `layer_norm_bias`) or "RMSNorm"
(`layer_norm_weight` only); with zero_centered_gamma the weight starts at 0 and (1 + weight)
is used. `apply_norm` runs the functional norm on any leading dims; with `fp8_cast` (a
`tritium.functional.fused_cast.CastSpec`) the norm writes the next GEMM's fp8 input directly and
returns a Float8Tensor, or (Float8Tensor, high-precision output) with `return_hp`; with a
`BlockCastSpec` (Float8BlockScaling) it returns a carrier of the 1x128 blocks instead.
"""
from __future__ import annotations

import torch

from ..distributed.tensor_parallel import sp_replicated
from ..functional.fused_cast import BlockCastSpec, CastSpec
from ..functional.norm import layer_norm, rms_norm

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def register_norm_params(module: torch.nn.Module, hidden: int, normalization: str,
                         zero_centered_gamma: bool, dtype: torch.dtype,
                         device: torch.device) -> None:
    check_normalization(normalization)
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = torch.nn.Parameter(init(hidden, dtype=dtype, device=device))
    bias = torch.zeros(hidden, dtype=dtype, device=device) if normalization == "LayerNorm" else None
    module.layer_norm_bias = None if bias is None else torch.nn.Parameter(bias)


def reset_norm_params(module: torch.nn.Module, zero_centered_gamma: bool) -> None:
    with torch.no_grad():
        module.layer_norm_weight.fill_(0.0 if zero_centered_gamma else 1.0)
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.zero_()


def apply_norm(module: torch.nn.Module, inp: torch.Tensor, normalization: str, eps: float,
               zero_centered_gamma: bool, fp8_cast=None, return_hp: bool = False, tp=None):
    """`tp`: a sequence-parallel TPSpec when inp holds this rank's rows only: the norm's
    (replicated) parameters then get their gradients all-reduced over the group."""
    weight, bias = module.layer_norm_weight, module.layer_norm_bias
    if tp is not None:
        weight, bias = sp_replicated(weight, tp), sp_replicated(bias, tp)
    if normalization == "LayerNorm":
        return layer_norm(inp, weight, bias, eps, zero_centered_gamma, fp8_cast=fp8_cast,
                          return_hp=return_hp)
    return rms_norm(inp, weight, eps, zero_centered_gamma, fp8_cast=fp8_cast,
                    return_hp=return_hp)


def norm_then_gemm_input(module: torch.nn.Module, inp: torch.Tensor, fp8_cast,
                         want_hp: bool, tp=None):
    """(the GEMM's input, the norm's high-precision output or None): with `fp8_cast` the first
    is the fused norm's Float8Tensor and the second is written only when `want_hp`."""
    args = (module, inp, module.normalization, module.eps, module.zero_centered_gamma)
    kw = {"tp": tp} if tp is not None and tp.sequence_parallel else {}
    if isinstance(fp8_cast, BlockCastSpec):  # a carrier of 1x128 blocks (+ y when wanted)
        out = apply_norm(*args, fp8_cast=fp8_cast, return_hp=want_hp, **kw)
        return out if want_hp else (out, None)
    if fp8_cast is None or (want_hp and torch.compiler.is_compiling()):
        # (compiled: a fused norm gives its fp8 output alone, see fused_cast.carrier_outputs)
        ln_out = apply_norm(*args, **kw)
        return ln_out, ln_out
    if want_hp:
        return apply_norm(*args, fp8_cast=fp8_cast, return_hp=True, **kw)
    return apply_norm(*args, fp8_cast=fp8_cast, **kw), None


def norm_cast_spec(module, recipe, device, write_transpose: bool):
    """The CastSpec of the fused norm: the first GEMM's input slot (0) of the forward state
    (its frozen copy when a checkpoint recomputes)."""
    module.fp8_meta.prepare(recipe, device)
    fwd = module._forward_scales()
    return CastSpec(fwd.scale_slot(0), fwd.amax_slot(0), fwd.fp8_dtype, write_transpose)
