"""TE 2.x's quantizer API: builders of `Float8Tensor`s with per-tensor scaling.

    q = Float8Quantizer(scale, amax, fp8_dtype)          # delayed scaling: the scale is given
    q = Float8CurrentScalingQuantizer(fp8_dtype, device) # scale from the tensor's own amax
    x8 = q(x)  or  q.quantize(x)                          # -> Float8Tensor (a QuantizedTensor)
    x8.dequantize();  q.update_quantized(y, x8);  x8.quantize_(y)
    q.set_usage(rowwise=True, columnwise=True)            # columnwise: also the fp8 transpose

Mapping onto tritium: the cast is tritium's (`fp8/cast.py`: the Triton kernel on CUDA, its
twin elsewhere; saturating, scale_inv = exact 1/scale). `Float8Quantizer.scale` / `.amax` are
the caller's tensors, used in place: the cast reads `scale` and max-accumulates max|x| into
`amax` (tritium's delayed-scaling rule; TE's cast writes the amax of the last cast, which after
TE's per-step history roll is the same value). `Float8CurrentScalingQuantizer` measures the
amax into its own `amax` buffer, writes the scale (`fp8/scaling` rules: amax_epsilon,
power-of-2, amax 0/inf/NaN -> 1) into `scale` and casts with it; with_amax_reduction all-reduces
(MAX) that amax over `amax_reduction_group` first. `fp8_dtype` is a torch fp8 dtype or TE's
`DType.kFloat8E4M3` / `kFloat8E5M2`. The fp8 transpose (columnwise) is of the tensor flattened
to 2D, [last dim, rest], as TE's.

Differences (clear errors): rowwise=False (tritium's Float8Tensor always holds the row-wise
data), `noop_flag`, `internal=True` storage-only tensors (every tritium Float8Tensor is a full
tensor). Quantizers are registered as safe globals, so a state dict holding quantizer-made
Float8Tensors loads with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import copy
from typing import Iterable, Optional

import torch

from ..ref.cast import current_scale
from .cast import amax_into, cast_transpose
from .formats import DType, fp8_dtype_arg
from .quantized_tensor import QuantizedTensor
from .tensor import Float8Tensor


class Quantizer:
    """Base of tritium's quantizers (TE's `Quantizer`): usage flags, call = quantize."""

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True):
        self.rowwise_usage = True
        self.columnwise_usage = True
        self.internal = False
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def set_usage(self, *, rowwise: Optional[bool] = None,
                  columnwise: Optional[bool] = None) -> None:
        """rowwise: the fp8 data (always on in tritium); columnwise: also the fp8 transpose."""
        if rowwise is False:
            raise NotImplementedError(
                f"{type(self).__name__}.set_usage(rowwise=False): tritium's Float8Tensor always "
                "holds the row-wise fp8 data (the transpose is an extra copy); keep rowwise=True")
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def __call__(self, tensor: torch.Tensor) -> QuantizedTensor:
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor, *, out: Optional[QuantizedTensor] = None,
                 dtype: Optional[torch.dtype] = None) -> QuantizedTensor:
        """A new Float8Tensor of `tensor` (nominal dtype: `dtype` or tensor's), or into `out`."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or \
                tensor.dim() < 1:
            raise TypeError(f"{type(self).__name__}.quantize: tensor must be a floating-point "
                            "tensor with at least one dim")
        x2d = tensor.detach().reshape(-1, tensor.shape[-1])
        data, data_t, scale_inv = self._cast(x2d)
        out = Float8Tensor(data.view(tensor.shape), scale_inv, self.dtype,
                           dtype or tensor.dtype, data_t, self._tensor_scale())
        out._quantizer = self
        return out

    def update_quantized(self, src: torch.Tensor, dst: QuantizedTensor, *,
                         noop_flag: Optional[torch.Tensor] = None) -> QuantizedTensor:
        """Requantize `src` into `dst` in place (data, scale_inv and transpose, if dst has one)."""
        if noop_flag is not None:
            raise NotImplementedError("update_quantized(noop_flag=...) is not supported in tritium")
        if not isinstance(dst, Float8Tensor):
            raise TypeError(f"{type(self).__name__}.update_quantized: dst must be a Float8Tensor, "
                            f"got {type(dst).__name__}")
        if isinstance(src, QuantizedTensor):
            src = src.dequantize()
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"update_quantized: src has shape {tuple(src.shape)}, dst "
                             f"{tuple(dst.shape)}")
        fp8_dtype = self.dtype
        if dst._fp8_dtype != fp8_dtype:
            raise TypeError(f"update_quantized: dst holds {dst._fp8_dtype}, this quantizer makes "
                            f"{fp8_dtype}")
        x2d = src.detach().to(dst._data.device).reshape(-1, src.shape[-1])
        data, _, scale_inv = self._cast(x2d, transpose=False)
        dst._data.copy_(data.view(dst._data.shape))
        dst._scale_inv.copy_(scale_inv)
        if dst._scale is not None and dst._scale is not self.scale:
            dst._scale.copy_(self.scale)
        dst.data_written()
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None,
                   requires_grad: bool = False) -> Float8Tensor:
        """An uninitialised Float8Tensor of `shape` to fill with `quantize_` / `copy_`."""
        shape = tuple(shape)
        device = torch.device(device) if device is not None else self.scale.device
        data = torch.empty(shape, dtype=self.dtype, device=device)
        data_t = None
        if self.columnwise_usage and shape:
            rest = 1
            for s in shape[:-1]:
                rest *= s
            data_t = torch.empty(shape[-1], rest, dtype=self.dtype, device=device)
        out = Float8Tensor(data, torch.ones(1, dtype=torch.float32, device=device), self.dtype,
                           dtype, data_t, self._tensor_scale(), requires_grad=requires_grad)
        out._quantizer = self
        return out

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Record the tensor's amax without quantizing (delayed scaling's calibration)."""

    def copy(self) -> "Quantizer":
        return copy.copy(self)

    def _cast(self, x2d: torch.Tensor, transpose: Optional[bool] = None):
        raise NotImplementedError

    def _tensor_scale(self) -> torch.Tensor:
        """The `_scale` a new tensor keeps (the quantizer's own, where it is the given one)."""
        return self.scale


class Float8Quantizer(Quantizer):
    """Delayed (given) scale: fp8 = cast(x * scale); max|x| is recorded into `amax`."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *,
                 rowwise: bool = True, columnwise: bool = True):
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"Float8Quantizer: {name} must be a one-element float32 tensor, "
                                f"got {getattr(t, 'dtype', type(t).__name__)}"
                                f"{tuple(getattr(t, 'shape', ()))}")
        if amax.device != scale.device:
            raise ValueError(f"Float8Quantizer: scale is on {scale.device}, amax on {amax.device}")
        self.scale, self.amax = scale.reshape(1), amax.reshape(1)
        self.dtype = fp8_dtype_arg(fp8_dtype, "Float8Quantizer")
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    def _cast(self, x2d, transpose=None):
        write_t = self.columnwise_usage if transpose is None else transpose
        return cast_transpose(x2d.to(self.scale.device), self.scale, self.amax, self.dtype,
                              write_transpose=write_t)

    def calibrate(self, tensor: torch.Tensor) -> None:
        amax_into(tensor.detach(), self.amax)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: each quantize measures the tensor's amax and derives the scale from it."""

    def __init__(self, fp8_dtype, device, *, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0):
        self.dtype = fp8_dtype_arg(fp8_dtype, "Float8CurrentScalingQuantizer")
        device = torch.device(device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.amax = torch.zeros(1, dtype=torch.float32, device=device)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        if not isinstance(amax_epsilon, (int, float)) or amax_epsilon < 0:
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon must be a float >= 0, "
                             f"got {amax_epsilon!r}")
        self.amax_epsilon = float(amax_epsilon)
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    def _cast(self, x2d, transpose=None):
        write_t = self.columnwise_usage if transpose is None else transpose
        x2d = x2d.to(self.scale.device)
        self.amax.zero_()
        amax_into(x2d, self.amax)
        if self.with_amax_reduction:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(self.amax, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
        self.scale.copy_(current_scale(self.amax, self.dtype, self.amax_epsilon,
                                       self.force_pow_2_scales))
        return cast_transpose(x2d, self.scale, None, self.dtype, write_transpose=write_t)

    def _tensor_scale(self) -> torch.Tensor:
        return self.scale.clone()  # the buffer changes with the next quantize


torch.serialization.add_safe_globals([Quantizer, Float8Quantizer, Float8CurrentScalingQuantizer,
                                      DType])

__all__ = ["Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "QuantizedTensor",
           "DType"]
