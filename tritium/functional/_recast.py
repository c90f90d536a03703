"""Keep the weight's fp8 transpose from forward to backward, or cast it again in backward.

dgrad reads the weight's fp8 transpose (w8^T: N*K bytes, or its columnwise blocks under
block-scaled recipes). Kept from forward, it lives from each Linear's forward to its backward,
i.e. for every Linear of a model at the end of the forward, where memory peaks (~0.9 GiB for a
1B-parameter Llama). Cast again in backward from the high-precision weight, it lives only for
dgrad, at the cost of one more weight cast per backward (~3 bytes moved per weight element).

The rule, for both Linear Functions (tensorwise: functional/linear.py, blocks:
functional/block_linear.py), asked only where a plain weight cast happens now (not an FP8 param,
not a cache reused, not the CUDA-graph flagged cast): cast again when dgrad needs w8^T, no weight
cache keeps it (`is_first_microbatch` None) and the weight is a Parameter, alive until backward
anyway. A weight made for the call (parameters_split's concatenation, a dequantized fp8 weight)
would be kept in high precision instead, more bytes than its fp8 transpose: there w8^T is kept.
The recast must give the forward's bits (same scale, no amax recorded): the callers keep what
fixes the scale.
"""
from __future__ import annotations

import torch


def recast_in_backward(weight: torch.Tensor, need_transpose: bool, keep: bool) -> bool:
    """Whether the weight's fp8 transpose is cast again in backward (else kept from forward)."""
    return need_transpose and not keep and isinstance(weight, torch.nn.Parameter)


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
