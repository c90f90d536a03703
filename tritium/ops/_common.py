"""Helpers shared by the op families: empty placeholders for outputs that were not written, and
outputs that are contiguous and never alias inputs (what the fake implementations promise)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _device


def filled(t: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t, or where the Python twin returned None, the 0-element tensor the op returns."""
    return t if t is not None else torch.empty(0, dtype=dtype, device=like.device)


def or_none(t: torch.Tensor, written: bool) -> Optional[torch.Tensor]:
    """An op output back to the Python result: None where the flag said "not written"."""
    return t if written else None


def fresh(outs, ins) -> tuple:
    """outs (tensors) made contiguous, and cloned where one shares memory with an input or an
    earlier output (e.g. ref's `y.t().contiguous()` of a one-column y is y itself).
    The Triton launchers allocate every output themselves (contiguous, never an alias): where
    they ran (`_device.use_triton` of the first input, the choice the ops make) nothing is
    checked, since the checks cost more host time than the op (see docs/compile.md)."""
    first = next((t for t in ins if isinstance(t, torch.Tensor)), None)
    if first is not None and _device.use_triton(first):
        return tuple(outs)
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


_LIB = torch.library.Library("tritium", "FRAGMENT")


class TritiumOp:
    """A `tritium::` operator registered straight with the dispatcher: the schema inferred from
    the function's annotations (as `torch.library.custom_op` does), the function as the kernel
    of every backend (CompositeExplicitAutograd: it picks the Triton kernel or the ref twin
    itself) and no autograd (a fallthrough: these ops run inside tritium's autograd.Functions).
    `torch.library.custom_op` wraps each call in Python layers for autograd, in-place views and
    aliasing checks: about 30 us per call on the host, which a compiled FP8 layer that calls
    ~60 ops a step paid in full. Through the dispatcher directly a call costs a few us.
    `register_fake` as custom_op's."""

    def __init__(self, qualname: str, fn, mutates_args):
        self.name = qualname.split("::", 1)[1]
        _LIB.define(self.name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(self.name, fn, "CompositeExplicitAutograd")
        _LIB.impl(self.name, torch.library.fallthrough_kernel, "Autograd")
        self._qualname = qualname
        self._op = getattr(torch.ops.tritium, self.name).default

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)

    def register_fake(self, fn):
        torch.library.register_fake(self._qualname, fn, lib=_LIB)
        return fn


def tritium_op(qualname: str, mutates_args=()):
    """Decorator: `TritiumOp(qualname, fn, mutates_args)` (in place of torch.library.custom_op)."""
    return lambda fn: TritiumOp(qualname, fn, tuple(mutates_args))
