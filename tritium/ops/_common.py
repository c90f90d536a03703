"""Helpers shared by the op families: empty placeholders for outputs that were not written, and
outputs that are contiguous and never alias inputs (what the fake implementations promise)."""
from __future__ import annotations

from typing import Optional

import torch


def filled(t: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t, or where the Python twin returned None, the 0-element tensor the op returns."""
    return t if t is not None else torch.empty(0, dtype=dtype, device=like.device)


def or_none(t: torch.Tensor, written: bool) -> Optional[torch.Tensor]:
    """An op output back to the Python result: None where the flag said "not written"."""
    return t if written else None


def fresh(outs, ins) -> tuple:
    """outs (tensors) made contiguous, and cloned where one shares memory with an input or an
    earlier output (e.g. ref's `y.t().contiguous()` of a one-column y is y itself)."""
    seen = {t.untyped_storage().data_ptr() for t in ins
            if isinstance(t, torch.Tensor) and t.numel()}
    res = []
    for t in outs:
        t = t.contiguous()
        if t.numel():
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        res.append(t)
    return tuple(res)
