"""`Function.apply` without its Python preamble, for the eager hot path.

`torch.autograd.Function.apply` runs Python before the C++ apply: a pytree walk over the
arguments that unwraps dead functorch wrappers, and (when setup_context is defined) a signature
bind. tritium's Functions define no setup_context, and outside torch.func transforms no argument
is a functorch wrapper, so `fast_apply(Fn)` calls the C++ apply directly and goes through
`Fn.apply` only when a transform is active or an argument is such a wrapper.
"""
from __future__ import annotations

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

_transforms_active = torch._C._are_functorch_transforms_active


def fast_apply(fn_cls):
    c_apply = super(torch.autograd.Function, fn_cls).apply  # torch._C._FunctionBase.apply
    slow_apply = fn_cls.apply

    def apply(*args):
        if torch.compiler.is_compiling() or _transforms_active():
            return slow_apply(*args)
        for a in args:
            if isinstance(a, torch.Tensor) and is_functorch_wrapped_tensor(a):
                return slow_apply(*args)
        return c_apply(*args)
    return apply
