"""Mask semantics of DotProductAttention, in one place: mask types, sliding windows, padding.

TE's conventions (followed exactly):
  * A mask tensor holds True where attention is NOT allowed (masked out).
  * attn_mask_type: no_mask, padding, causal, padding_causal, causal_bottom_right,
    padding_causal_bottom_right, arbitrary ("padding,causal" and "causal,padding" are accepted
    spellings of padding_causal).
  * "causal" is aligned to the top-left corner of the [s_q, s_kv] score matrix (query i sees keys
    j <= i); "*_bottom_right" to the bottom-right corner (j <= i + s_kv - s_q). With padding the
    lengths are each sequence's actual lengths.
  * window_size = (left, right), -1 = unbounded: query i sees keys j with
    i + o - left <= j <= i + o + right, where o = s_kv - s_q (bottom-right alignment) for every
    mask type except "causal" and "padding_causal", whose window is top-left aligned (o = 0) like
    their causal diagonal. A causal mask type forces right = 0; None means (-1, -1).
  * Padding masks: [b, 1, 1, s_q] for self-attention (used for the keys too) or a pair
    ([b, 1, 1, s_q], [b, 1, 1, s_kv]) for cross-attention; or cu_seqlens_q/kv instead of a mask.
  * A query row with no visible key (a padded query, a window that misses every key) gives
    output 0 and log-sum-exp -inf, and passes no gradient.

`dense_mask` turns all of that into one boolean [b, 1 or h, s_q, s_kv] tensor (True = masked):
the reference backend's and the additive-bias backend's input. `thd_index`, `pack`, `unpack`
move packed [t, h, d] sequences to padded [b, s, h, d] and back without a host sync.
"""
from __future__ import annotations

from typing import Optional

import torch

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")
_ALIASES = {"padding,causal": "padding_causal", "causal,padding": "padding_causal"}


def parse_mask_type(mask_type: str, where: str = "attn_mask_type") -> str:
    name = _ALIASES.get(mask_type, mask_type)
    if name not in MASK_TYPES:
        raise ValueError(f"{where}={mask_type!r} is not a mask type; use one of {MASK_TYPES}")
    return name


def is_causal(mask_type: str) -> bool:
    return "causal" in mask_type


def is_padding(mask_type: str) -> bool:
    return mask_type.startswith("padding")


def bottom_right(mask_type: str) -> bool:
    """Alignment of the causal diagonal and of the window (see the module note)."""
    return mask_type not in ("causal", "padding_causal")


def normalize_window(window_size, mask_type: str, where: str = "window_size") -> tuple[int, int]:
    if window_size is None:
        left, right = -1, -1
    else:
        try:
            left, right = (int(w) for w in window_size)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={window_size!r} must be a pair of ints (left, right), "
                             "-1 meaning unbounded") from None
        if left < -1 or right < -1:
            raise ValueError(f"{where}={window_size!r}: each side must be >= 0 or -1 "
                             "(unbounded)")
    if is_causal(mask_type):
        right = 0
    return left, right


def padding_from_mask(attention_mask, batch: int, sq: int, sk: int, self_attention: bool):
    """(q_pad [b, s_q], kv_pad [b, s_kv]) bool, True = padding, from TE's padding mask forms."""
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError("attention_mask: a padding mask pair must be (q_mask, kv_mask), "
                             f"got {len(attention_mask)} tensors")
        q_mask, kv_mask = attention_mask
    else:
        q_mask = kv_mask = attention_mask
        if not self_attention or sq != sk:
            raise ValueError("attention_mask: cross-attention (or s_q != s_kv) needs a pair "
                             f"(q_mask [b,1,1,{sq}], kv_mask [b,1,1,{sk}]), got one tensor")
    return (_pad_vector(q_mask, batch, sq, "attention_mask (q)"),
            _pad_vector(kv_mask, batch, sk, "attention_mask (kv)"))


def _pad_vector(mask, batch: int, s: int, what: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{what} must be a bool tensor of shape [{batch}, 1, 1, {s}], "
                        f"got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{what} must have dtype torch.bool (True = masked out), got {mask.dtype}")
    shape = tuple(mask.shape)  # `==`, not `in`: Dynamo mis-evaluates `in` on symbolic shapes
    if shape != (batch, 1, 1, s) and shape != (batch, s):
        raise ValueError(f"{what} has shape {tuple(mask.shape)}; a padding mask is "
                         f"[b, 1, 1, s] = [{batch}, 1, 1, {s}]")
    return mask.reshape(batch, s)


def padding_from_cu_seqlens(cu: torch.Tensor, batch: int, s: int) -> torch.Tensor:
    """[b, s] bool, True past each sequence's length (right padding)."""
    lens = (cu[1:] - cu[:-1]).to(torch.long)
    return torch.arange(s, device=cu.device)[None, :] >= lens[:, None]


def dense_mask(batch: int, sq: int, sk: int, device, *, causal: bool, bottom_right: bool,
               left: int, right: int, q_pad: Optional[torch.Tensor] = None,
               kv_pad: Optional[torch.Tensor] = None,
               arbitrary: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Bool [b, 1 or h, s_q, s_kv], True = masked; None when nothing is masked."""
    mask = None
    if causal or left >= 0 or right >= 0:
        i = torch.arange(sq, device=device).view(1, 1, sq, 1)
        j = torch.arange(sk, device=device).view(1, 1, 1, sk)
        if bottom_right:
            lq = sq if q_pad is None else (~q_pad).sum(-1).view(batch, 1, 1, 1)
            lk = sk if kv_pad is None else (~kv_pad).sum(-1).view(batch, 1, 1, 1)
            diag = i + (lk - lq)
        else:
            diag = i
        band = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device)
        if right >= 0:
            band = band | (j > diag + right)
        if left >= 0:
            band = band | (j < diag - left)
        mask = band
    if q_pad is not None:
        m = q_pad.view(batch, 1, sq, 1)
        mask = m if mask is None else mask | m
    if kv_pad is not None:
        m = kv_pad.view(batch, 1, 1, sk)
        mask = m if mask is None else mask | m
    if arbitrary is not None:
        mask = arbitrary if mask is None else mask | arbitrary
    if mask is not None:
        mask = mask.expand(batch, mask.shape[1], sq, sk)
    return mask


def thd_index(cu: torch.Tensor, total: int):
    """(batch index, position) of each of `total` packed tokens, computed on cu's device."""
    t = torch.arange(total, device=cu.device, dtype=cu.dtype)
    b = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=cu.numel() - 2)
    return b, (t - cu[b]).to(torch.long)


def pack(x: torch.Tensor, index) -> torch.Tensor:
    """Padded [b, s, ...] -> packed [t, ...] (differentiable)."""
    b, pos = index
    return x[b, pos]


def unpack(x: torch.Tensor, index, batch: int, s: int) -> torch.Tensor:
    """Packed [t, ...] -> zero-padded [b, s, ...] (differentiable)."""
    b, pos = index
    out = x.new_zeros((batch, s) + tuple(x.shape[1:]))
    return out.index_put((b, pos), x)


__all__ = ["MASK_TYPES", "parse_mask_type", "is_causal", "is_padding", "bottom_right",
           "normalize_window", "padding_from_mask", "padding_from_cu_seqlens", "dense_mask",
           "thd_index", "pack", "unpack"]
