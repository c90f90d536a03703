"""Custom ops behind `tritium.functional.rope` (tritium::rope_fwd, tritium::rope_bwd: a new
contiguous tensor shaped like the input, nothing written in place), and the namespace with
`tritium.ref.rope`'s names."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _device
from ..ref import rope as ref_rope
from ._common import fresh, tritium_op


def _impl(t: Tensor):
    if _device.use_triton(t):
        from ..kernels import rope as kernel_rope
        return kernel_rope
    return ref_rope


@tritium_op("tritium::rope_fwd", mutates_args=())
def _fwd(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    return fresh((_impl(x).rope_fwd(x, cos, sin, pos, interleaved),), (x, cos, sin, pos))[0]


@tritium_op("tritium::rope_bwd", mutates_args=())
def _bwd(dy: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    return fresh((_impl(dy).rope_bwd(dy, cos, sin, pos, interleaved),), (dy, cos, sin, pos))[0]


@_fwd.register_fake
@_bwd.register_fake
def _(x, cos, sin, pos, interleaved):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    return torch.ops.tritium.rope_fwd(x, cos, sin, pos, interleaved)


def rope_bwd(dy: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    return torch.ops.tritium.rope_bwd(dy, cos, sin, pos, interleaved)


__all__ = ["rope_fwd", "rope_bwd"]
