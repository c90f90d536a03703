"""tritium.LayerNorm and tritium.RMSNorm: TE's norm modules (names, arguments, parameters).

    LayerNorm(normalized_shape, eps=1e-5, sequence_parallel=None, params_dtype=None,
              zero_centered_gamma=False, device="cuda")          params: weight, bias
    RMSNorm(the same arguments)                                   params: weight

normalized_shape is the hidden size (an int or a 1-tuple: only the last dim is normalized).
weight starts at 1, or at 0 with zero_centered_gamma (then 1 + weight is applied); bias at 0.
device "cuda" falls back to the CPU where there is no GPU. The math (fp32, one rounding to the
input's dtype; the input's dtype may differ from params_dtype) is `tritium.functional.norm`.
sequence_parallel is recorded on the module and as an attribute of each parameter, where
Megatron-style code looks for it to all-reduce their gradients; the module itself communicates
nothing.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._device import default_device
from ..fp8.formats import HIGH_PRECISION_DTYPES
from ..distributed.tensor_parallel import sp_replicated
from ..functional.norm import layer_norm, rms_norm


def _hidden_size(cls: str, normalized_shape) -> int:
    shape = normalized_shape
    if isinstance(shape, (tuple, list, torch.Size)):
        if len(shape) != 1:
            raise ValueError(f"{cls}: normalized_shape={tuple(shape)!r} must be an int or a "
                             "1-tuple (only the last dim is normalized)")
        shape = shape[0]
    if not isinstance(shape, int) or isinstance(shape, bool) or shape < 1:
        raise ValueError(f"{cls}: normalized_shape must be a positive int, "
                         f"got {normalized_shape!r}")
    return shape


class _Norm(torch.nn.Module):
    """What LayerNorm and RMSNorm share: arguments, parameters, input checks."""

    def __init__(self, normalized_shape, eps: float, sequence_parallel: Optional[bool],
                 params_dtype: Optional[torch.dtype], zero_centered_gamma: bool,
                 device: Union[str, torch.device, None], has_bias: bool):
        super().__init__()
        cls = type(self).__name__
        self.hidden_size = _hidden_size(cls, normalized_shape)
        self.normalized_shape = (self.hidden_size,)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{cls}: eps must be a float >= 0, got {eps!r}")
        params_dtype = params_dtype or torch.get_default_dtype()
        if params_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{cls}: params_dtype must be one of {HIGH_PRECISION_DTYPES}, "
                            f"got {params_dtype}")
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        factory = dict(dtype=params_dtype, device=default_device(device))
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, **factory))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(self.hidden_size, **factory))
                                if has_bias else None)
        for p in self.parameters():
            p.sequence_parallel = self.sequence_parallel
        self._sp_spec = None  # set by TransformerLayer: all-reduce the grads over its TP group
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _check_input(self, inp) -> None:
        cls = type(self).__name__
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{cls}.forward: inp must be a torch.Tensor, got {type(inp).__name__}")
        if inp.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{cls}.forward: inp dtype {inp.dtype} is not supported; pass "
                            "float32, bfloat16 or float16")
        if inp.dim() < 1 or inp.shape[-1] != self.hidden_size:
            raise ValueError(f"{cls}.forward: inp has shape {tuple(inp.shape)}; its last dim must "
                             f"be normalized_shape={self.hidden_size}")
        if inp.device != self.weight.device:
            raise ValueError(f"{cls}.forward: inp is on {inp.device} but the weight is on "
                             f"{self.weight.device}; move one of them "
                             f"(inp.to({str(self.weight.device)!r}))")

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(_Norm):
    """y = ((x - mean) / sqrt(var + eps)) * gamma + bias over the last dim (biased variance)."""

    def __init__(self, normalized_shape, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device: Union[str, torch.device, None] = "cuda"):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype,
                         zero_centered_gamma, device, has_bias=True)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._check_input(inp)
        return layer_norm(inp, sp_replicated(self.weight, self._sp_spec),
                          sp_replicated(self.bias, self._sp_spec), self.eps,
                          self.zero_centered_gamma)


class RMSNorm(_Norm):
    """y = (x / sqrt(mean(x^2) + eps)) * gamma over the last dim."""

    def __init__(self, normalized_shape, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device: Union[str, torch.device, None] = "cuda"):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype,
                         zero_centered_gamma, device, has_bias=False)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._check_input(inp)
        return rms_norm(inp, sp_replicated(self.weight, self._sp_spec), self.eps,
                        self.zero_centered_gamma)


__all__ = ["LayerNorm", "RMSNorm"]
