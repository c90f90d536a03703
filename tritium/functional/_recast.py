"""Keep the weight's fp8 transpose from forward to backward, or cast it again in backward.

dgrad reads the weight's fp8 transpose (w8^T: N*K bytes, or its columnwise blocks under
block-scaled recipes). Kept from forward, it lives from each Linear's forward to its backward,
i.e. for every Linear of a model at the end of the forward, where memory peaks (~0.9 GiB for a
1B-parameter Llama). Cast again in backward from the high-precision weight, it lives only for
dgrad, at the cost of one more weight cast per backward (~3 bytes moved per weight element).

The rule, for both Linear Functions (tensorwise: functional/linear.py, blocks:
functional/block_linear.py), asked only where a plain weight cast happens now (not an FP8 param,
not a cache reused, not the CUDA-graph flagged cast): cast again when dgrad needs w8^T, no weight
cache keeps it (`is_first_microbatch` None), the weight is a Parameter, alive until backward
anyway, and it has more than `KEEP_TRANSPOSE_MAX_NUMEL` elements. A weight made for the call
(parameters_split's concatenation, a dequantized fp8 weight) would be kept in high precision
instead, more bytes than its fp8 transpose: there w8^T is kept. So is a small weight's: up to
4 MiB of fp8 per GEMM (all of a hidden-512 model's, a 1B Llama's attention output projection,
+64 MiB at its peak), what keeping costs is little memory, and what it saves is two launches per
GEMM and step (the scale's copy or amax in forward, the cast in backward), the host time of a
step that small GEMMs leave bound by its host. The recast must give the forward's bits (same
scale, no amax recorded): the callers keep what fixes the scale.
"""
from __future__ import annotations

import torch

from ..fp8.cast import amax_into, cast_transpose
from ..fp8.recipe import Float8CurrentScaling
from ..fp8.recompute import FrozenScales


KEEP_TRANSPOSE_MAX_NUMEL = 1 << 22  # weights up to this many elements keep w8^T (see above)


def recast_in_backward(weight: torch.Tensor, need_transpose: bool, keep: bool) -> bool:
    """Whether the weight's fp8 transpose is cast again in backward (else kept from forward)."""
    return (need_transpose and not keep and isinstance(weight, torch.nn.Parameter)
            and weight.numel() > KEEP_TRANSPOSE_MAX_NUMEL)


def weight_version(weight: torch.Tensor):
    """The weight's version now, for `check_unchanged` (None while compiling: a traced Function
    saves the weight as a tensor, whose version autograd checks itself)."""
    return None if torch.compiler.is_compiling() else weight._version


def check_unchanged(weight: torch.Tensor, version) -> None:
    if version is not None and weight._version != version:
        raise RuntimeError(
            "tritium.Linear under fp8_autocast: its weight was modified in place between forward "
            "and backward, so dgrad cannot cast again the fp8 weight the forward used; update "
            "weights only after backward (or run the forward again)")


class WeightRecast:
    """dgrad's w8^T cast again in backward instead of kept from forward (see the module note):
    the weight and what fixes its cast's scale as the forward's cast had it."""

    __slots__ = ("weight", "version", "fp8_dtype", "scale", "amax", "current")

    def __init__(self, plan, weight: torch.Tensor):
        self.weight, self.version = weight, weight_version(weight)
        self.fp8_dtype = plan.recipe.fp8_format.forward_dtype
        if isinstance(plan.recipe, Float8CurrentScaling):
            # the weight's amax, measured now for the forward's cast and kept for backward's
            self.scale, self.current = None, (plan.recipe.amax_epsilon, plan.recipe.power_2_scale)
            self.amax = torch.zeros(1, dtype=torch.float32, device=weight.device)
            amax_into(weight.detach(), self.amax)
        else:  # a copy: autocast exit updates the live scale before backward (frozen: as it is)
            scale = plan.fwd.scale_slot(plan.weight_slot)
            self.scale = scale if isinstance(plan.fwd, FrozenScales) else scale.clone()
            self.amax = self.current = None

    def __call__(self) -> torch.Tensor:
        """w8^T [K, N], bit for bit the forward's cast; records no amax."""
        check_unchanged(self.weight, self.version)
        return cast_weight_t(self.weight, self.scale, self.amax, self.fp8_dtype, self.current)


def cast_weight_t(weight, scale, amax, fp8_dtype, current) -> torch.Tensor:
    return cast_transpose(weight.detach(), scale, amax, fp8_dtype, pad_rows_to=1,
                          write_data=False, write_transpose=True, current=current)[1]


def dgrad_weight(w8_t):
    """dgrad's w8^T: kept from forward, or cast again now (a WeightRecast, or its compiled
    form: a partial of `cast_weight_t` over the saved tensors)."""
    return w8_t() if callable(w8_t) else w8_t
