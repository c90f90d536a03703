"""`QuantizedTensor`: TE 2.x's base class of quantized tensors (`Float8Tensor` derives from it).

TE code tests `isinstance(t, QuantizedTensor)` to find quantized params and activations, calls
`t.dequantize()`, `t.quantize_(src)` (requantize in place with the tensor's quantizer) and
`t.update_usage(rowwise_usage=, columnwise_usage=)`. This base holds only that contract; the
data layout belongs to the subclass (`tritium/fp8/tensor.py`). It is a plain `torch.Tensor`
subclass with no dispatch of its own.
"""
from __future__ import annotations

from typing import Optional

import torch


class QuantizedTensor(torch.Tensor):
    """A tensor whose values are stored quantized; ops it does not implement dequantize."""

    _quantizer = None  # the Quantizer that made it, where one did (TE's `_quantizer`)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize()")

    def _get_quantizer(self):
        if self._quantizer is None:
            raise ValueError(f"this {type(self).__name__} was not made by a quantizer; quantize "
                             "with Float8Quantizer / Float8CurrentScalingQuantizer to get one")
        return self._quantizer

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None):
        """Requantize `tensor` into this tensor in place (with its quantizer)."""
        if noop_flag is not None:
            raise NotImplementedError("quantize_(noop_flag=...) is not supported: tritium's "
                                      "device-side skip flag lives in make_graphed_callables' "
                                      "FP8 weight caching")
        return self._get_quantizer().update_quantized(tensor, self)
