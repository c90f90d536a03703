"""Rotary position embedding (RoPE, https://arxiv.org/abs/2104.09864), TE's module and function.

`RotaryPositionEmbedding(dim, ...)` owns only `inv_freq` (a buffer, as in TE, so TE state dicts
load) and makes the angle table: `forward(max_seq_len, offset=0)` returns fp32 freqs
[max_seq_len, 1, 1, rot_dim] with freqs[p, 0, 0, :] = (p + offset) * inv_freq laid out for
`apply_rotary_pos_emb` (functional/rope.py): each frequency twice, as two halves
[f_0..f_{R/2-1}, f_0..f_{R/2-1}] (non-interleaved, GPT-NeoX / HF Llama) or as adjacent pairs
[f_0, f_0, f_1, f_1, ...] (interleaved, GPT-J). inv_freq[i] = 1 / base^(2i / R) with
R = rot_dim = int(dim * rotary_percent) when rotary_percent < 1 (the remaining features of each
head pass through). Position interpolation (https://arxiv.org/abs/2306.15595), TE's rule: with
both seq_len_interpolation_factor and pretrained_max_position_embeddings set, positions are
multiplied by 1 / factor, or by pretrained / max_seq_len when max_seq_len exceeds
pretrained * factor.

Deviation from TE, on purpose: forward computes in fp32 even after `module.to(torch.bfloat16)`
(TE then builds bf16 angles; positions in the thousands lose all their fractional digits).
The buffer lives on `tritium._device.default_device()` (TE: the current CUDA device).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device
from ..functional.rope import apply_rotary_pos_emb


class RotaryPositionEmbedding(torch.nn.Module):
    """TE's `RotaryPositionEmbedding(dim, rotary_percent=1.0, seq_len_interpolation_factor=None,
    pretrained_max_position_embeddings=None, rotary_base=10000.0, interleaved=False)`."""

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        rot = int(dim * rotary_percent) if rotary_percent < 1.0 else dim
        if rot < 2 or rot % 2:
            raise ValueError(f"the rotary dim int(dim * rotary_percent) = int({dim} * "
                             f"{rotary_percent}) = {rot} must be even and >= 2 (features rotate "
                             "in pairs); change dim or rotary_percent")
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError("seq_len_interpolation_factor must be > 0, got "
                             f"{seq_len_interpolation_factor}")
        self.rot_dim = rot
        self.rotary_base = rotary_base
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        dev = _device.default_device()
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=dev)
                                          / rot))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """fp32 freqs [max_seq_len, 1, 1, rot_dim] for positions offset .. offset+max_seq_len-1."""
        inv_freq = self.inv_freq.float()
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32) + offset
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            if max_seq_len > pretrained * factor:
                seq *= 1 / (max_seq_len / pretrained)  # dynamic linear scaling
            else:
                seq *= 1 / factor  # fixed linear scaling
        freqs = torch.outer(seq, inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])

    def extra_repr(self) -> str:
        return (f"rot_dim={self.rot_dim}, rotary_base={self.rotary_base}, "
                f"interleaved={self.interleaved}")


__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
