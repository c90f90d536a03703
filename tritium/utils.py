"""`tritium.utils`, as TE's `transformer_engine.pytorch.utils`: the helpers TE users import.

`init_method_normal(sigma)` / `scaled_init_method_normal(sigma, num_layers)` return in-place
initializers (Megatron's: normal(0, sigma), and normal(0, sigma / sqrt(2 * num_layers)) for the
output projections of a residual stack); `attention_mask_func(scores, mask)` fills the masked
positions (mask True = masked out, TE's convention) with -10000.0 in place and returns the scores.
`interleave_glu_tensor` / `deinterleave_glu_tensor` convert a gated fc1 weight between the
[gate; up] layout and blocks alternating gate / up rows (other frameworks' fused layouts).
Capability queries are re-exported from `tritium.fp8.global_state`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .fp8.global_state import (get_cudnn_version, get_device_compute_capability,  # noqa: F401
                               is_bf16_available)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer that fills a tensor with normal(0, sigma) in place."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float,
                              num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """normal(0, sigma / sqrt(2 * num_layers)): for the layers that write into the residual."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"scaled_init_method_normal: num_layers must be an int >= 1, got "
                         f"{num_layers!r}")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """Masked positions (True in the mask) of the scores become -10000.0, in place."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def _glu_blocks(tensor: torch.Tensor, interleave_size: int, where: str) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise ValueError(f"{where}: tensor must have at least one dim")
    if not isinstance(interleave_size, int) or isinstance(interleave_size, bool) or \
            interleave_size < 1:
        raise ValueError(f"{where}: interleave_size must be an int >= 1, got {interleave_size!r}")
    if tensor.shape[0] % (2 * interleave_size):
        raise ValueError(f"{where}: dim 0 ({tensor.shape[0]}) must be a multiple of "
                         f"2 * interleave_size ({2 * interleave_size})")
    return tensor.shape[0] // (2 * interleave_size)


def interleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """A gated-activation weight (or bias) [gate; up] along dim 0 (tritium's and TE's fc1
    layout) -> blocks of `interleave_size` rows alternating gate, up, gate, up, ... (a new
    tensor; the inverse is deinterleave_glu_tensor)."""
    n = _glu_blocks(tensor, interleave_size, "interleave_glu_tensor")
    halves = tensor.reshape(2, n, interleave_size, *tensor.shape[1:])
    return halves.transpose(0, 1).reshape(tensor.shape).clone()


def deinterleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """Blocks alternating gate, up (`interleave_size` rows each) -> [gate; up] along dim 0."""
    n = _glu_blocks(tensor, interleave_size, "deinterleave_glu_tensor")
    blocks = tensor.reshape(n, 2, interleave_size, *tensor.shape[1:])
    return blocks.transpose(0, 1).reshape(tensor.shape).clone()


def is_bf16_compatible() -> bool:
    """TE's older name: bfloat16 compute on the current device."""
    return is_bf16_available()


__all__ = ["init_method_normal", "scaled_init_method_normal", "attention_mask_func",
           "interleave_glu_tensor", "deinterleave_glu_tensor",
           "get_device_compute_capability", "get_cudnn_version", "is_bf16_available",
           "is_bf16_compatible"]
