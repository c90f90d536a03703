"""Float8Tensor: FP8 data that behaves like a tensor of its nominal (high-precision) dtype.

Holds `_data` (fp8, row-major), optionally `_transpose` (the fp8 transpose, for the GEMMs that
need the other layout), `_scale_inv` (fp32 [1], written with the data as the exactly rounded
1/scale), `_fp8_dtype` and the nominal dtype that `dtype` reports. `dequantize()` gives the
high-precision values. A `__torch_dispatch__` subclass: ops it does not implement run on the
dequantized values (so `x + 1`, `x.sum()`, `x @ w` simply work, in the nominal dtype); the few
it implements (detach, clone, copy_ into it, views that keep the data) stay in FP8. In-place
ops (`x.mul_(2)`) run on the dequantized values and requantize into x with x's scale.

TE 2.x API: `Float8Tensor` derives from `QuantizedTensor`; one made by a quantizer
(`tritium/fp8/quantizer.py`) keeps it in `_quantizer`, so `quantize_(src)` and `copy_` into it
requantize the way that quantizer does (current scaling recomputes the scale);
`update_usage(rowwise_usage=, columnwise_usage=)` makes or drops the fp8 transpose.

Checkpoints: the class is registered with `torch.serialization.add_safe_globals`, so a state
dict holding Float8Tensors (FP8 params from fp8_model_init) loads with
`torch.load(weights_only=True)` in any process that imported tritium; what it unpickles is
tensors and dtypes only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from .cast import cast_transpose, dequantize as _dequantize
from .formats import FP8_DTYPES
from .quantized_tensor import QuantizedTensor

aten = torch.ops.aten


def _writes_self(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class Float8Tensor(QuantizedTensor):
    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _fp8_dtype: torch.dtype
    _transpose: Optional[torch.Tensor]
    _scale: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                nominal_dtype: torch.dtype = torch.float32, transpose: Optional[torch.Tensor] = None,
                scale: Optional[torch.Tensor] = None, requires_grad: bool = False):
        if data.dtype not in FP8_DTYPES or data.dtype != fp8_dtype:
            raise TypeError(f"data must have the fp8 dtype {fp8_dtype}, got {data.dtype}")
        if scale_inv.dtype != torch.float32 or scale_inv.numel() != 1:
            raise TypeError("scale_inv must be a one-element float32 tensor")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=nominal_dtype, device=data.device, requires_grad=requires_grad)
        self._data, self._scale_inv, self._fp8_dtype = data, scale_inv, fp8_dtype
        self._transpose, self._scale = transpose, scale
        return self

    @classmethod
    def quantize(cls, x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                 amax: Optional[torch.Tensor] = None, with_transpose: bool = False) -> "Float8Tensor":
        """Cast a 2D (or any, without transpose) tensor with `scale`, recording amax if given."""
        if with_transpose and x.dim() != 2:
            raise ValueError(f"with_transpose needs a 2D tensor, got shape {tuple(x.shape)}")
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        data, data_t, scale_inv = cast_transpose(x2d.detach(), scale, amax, fp8_dtype,
                                                 write_transpose=with_transpose)
        return cls(data.view(x.shape), scale_inv, fp8_dtype, x.dtype, data_t, scale)

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The initial high-precision value, kept (on the CPU) by
        fp8_model_init(preserve_high_precision_init_val=True); else None."""
        return getattr(self, "_high_precision_init_val", None)

    def clear_high_precision_init_val(self) -> None:
        self._high_precision_init_val = None

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return _dequantize(self._data, self._scale_inv, dtype or self.dtype)

    def update_usage(self, rowwise_usage: Optional[bool] = None,
                     columnwise_usage: Optional[bool] = None) -> None:
        """TE's usage switch: columnwise = the fp8 transpose (made from the data, or dropped).
        The row-wise data is always kept (it is what the tensor is)."""
        if rowwise_usage is False:
            raise NotImplementedError("Float8Tensor.update_usage(rowwise_usage=False): tritium's "
                                      "Float8Tensor always holds its row-wise fp8 data")
        if columnwise_usage is True and self._transpose is None:
            self._transpose = self._data.reshape(-1, self._data.shape[-1]).t().contiguous()
        elif columnwise_usage is False:
            self._transpose = None

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8Tensor(fp8_dtype={self._fp8_dtype}, scale_inv={self._scale_inv.item():.6g}, "
                f"nominal_dtype={self.dtype}, data={self.dequantize()})")

    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"] + [n for n in ("_transpose", "_scale")
                                           if getattr(self, n) is not None]
        return names, {"fp8_dtype": self._fp8_dtype, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta["fp8_dtype"], meta["dtype"],
                            inner.get("_transpose"), inner.get("_scale"))

    def _same_meta(self, data, transpose=None) -> "Float8Tensor":
        out = Float8Tensor(data, self._scale_inv, self._fp8_dtype, self.dtype, transpose,
                           self._scale)
        if self._quantizer is not None:
            out._quantizer = self._quantizer
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._same_meta(args[0]._data, args[0]._transpose)
        if func is aten.clone.default:
            t = args[0]
            return t._same_meta(t._data.clone(), None if t._transpose is None else t._transpose.clone())
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return args[0]._same_meta(args[0]._data.view(args[1]))
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            return cls._copy_into(args[0], args[1])

        def unwrap(t):
            return t.dequantize() if isinstance(t, Float8Tensor) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if args and isinstance(args[0], Float8Tensor) and _writes_self(func):
            # In-place op (x.add_(1), x.mul_(2), x.zero_()): it ran on a dequantized copy;
            # requantize the result into x, or the op would silently do nothing.
            return cls._copy_into(args[0], out)
        return out

    @staticmethod
    def _copy_into(dst: "Float8Tensor", src: torch.Tensor) -> "Float8Tensor":
        """dst.copy_(src): take src's fp8 bits as they are, or quantize src with dst's scale."""
        if dst._quantizer is not None and not (isinstance(src, Float8Tensor)
                                               and src._fp8_dtype == dst._fp8_dtype):
            return dst._quantizer.update_quantized(src, dst)
        if isinstance(src, Float8Tensor) and src._fp8_dtype == dst._fp8_dtype:
            dst._data.copy_(src._data)
            dst._scale_inv.copy_(src._scale_inv)
        else:
            if dst._scale is None:
                raise RuntimeError("copy_ into a Float8Tensor needs its scale; this one was made "
                                   "without one. Quantize with Float8Tensor.quantize(x, scale, ...)")
            x = src.dequantize() if isinstance(src, Float8Tensor) else src
            x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
            data, _, scale_inv = cast_transpose(x2d.to(dst._data.device), dst._scale, None,
                                                dst._fp8_dtype)
            dst._data.copy_(data.view(dst._data.shape))
            dst._scale_inv.copy_(scale_inv)
        if dst._transpose is not None:
            dst._transpose.copy_(dst._data.reshape(-1, dst._data.shape[-1]).t())
        return dst


torch.serialization.add_safe_globals([Float8Tensor])
