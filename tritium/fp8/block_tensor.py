"""Float8BlockTensor: a GEMM weight held as block-scaled FP8 (Float8BlockScaling's weight form).

Made by `fp8_model_init(recipe=Float8BlockScaling())` (or `quantized_model_init`) for every
GEMM weight [N, K]. It holds what the block-scaled Linear needs from a weight, so forward and
backward read it as it is (no cast per step):
  * `_data` [N, K] fp8 and `_scale_inv` (128x128: [ceil(N/128), ceil(K/128)]; 1x128:
    [ceil(K/128), N]), the fprop operand;
  * `_data_t` [K, N] and `_scale_inv_t`, the dgrad operand (128x128: the same fp8 numbers and
    the transposed scale grid; 1x128: tiles along N, quantized from the high-precision values);
  * `_block_2d`, `_fp8_dtype` and `_qparams` = (power_2_scale, amax_epsilon): how it was made,
    so `requantize_(x)` (the optimizer, after each step, from its fp32 master) makes the same
    bits a block-scaled Linear would make from x.
The layouts are those of `tritium.ref.block_cast.quantize_blocks`.

A `__torch_dispatch__` subclass like Float8Tensor: detach / alias / clone and `copy_` into it
stay block-FP8 (`copy_` from another Float8BlockTensor of the same form copies bits, from
anything else requantizes); every other op runs on the dequantized values in the nominal dtype
(so it works with plain PyTorch ops and under non-block recipes, where it is cast like any
high-precision weight). In-place ops requantize the result into the tensor.

Deliberately not done: FSDP2 sharding (a shard of 128x128 blocks needs block-aligned splits),
views other than the whole tensor, and the fp8 all-gather of tensor parallelism.
Checkpoints: registered with `torch.serialization.add_safe_globals` (weights_only=True loads).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..ref.block_cast import BlockQuantized, dequantize_blocks
from . import block as block_ops
from .formats import FP8_DTYPES
from .quantized_tensor import QuantizedTensor

aten = torch.ops.aten


def _writes_self(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class Float8BlockTensor(QuantizedTensor):
    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _data_t: torch.Tensor
    _scale_inv_t: torch.Tensor
    _fp8_dtype: torch.dtype
    _block_2d: bool
    _qparams: tuple

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, data_t: torch.Tensor,
                scale_inv_t: torch.Tensor, fp8_dtype: torch.dtype, nominal_dtype: torch.dtype,
                block_2d: bool = True, qparams: tuple = (True, 0.0), requires_grad: bool = False):
        if data.dtype not in FP8_DTYPES or data.dtype != fp8_dtype or data.dim() != 2:
            raise TypeError(f"data must be a 2D tensor of the fp8 dtype {fp8_dtype}, got "
                            f"{data.dtype}{tuple(data.shape)}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=nominal_dtype, device=data.device, requires_grad=requires_grad)
        self._data, self._scale_inv, self._data_t, self._scale_inv_t = (data, scale_inv, data_t,
                                                                        scale_inv_t)
        self._fp8_dtype, self._block_2d = fp8_dtype, bool(block_2d)
        self._qparams = (bool(qparams[0]), float(qparams[1]))
        return self

    @classmethod
    def quantize(cls, x: torch.Tensor, fp8_dtype: torch.dtype, *, block_2d: bool = True,
                 power_2_scale: bool = True, amax_epsilon: float = 0.0) -> "Float8BlockTensor":
        """The block-scaled FP8 form of a 2D high-precision tensor (nominal dtype = x's)."""
        if x.dim() != 2:
            raise ValueError(f"Float8BlockTensor.quantize: x must be 2D, got {tuple(x.shape)}")
        q = block_ops.quantize_blocks(x.detach(), fp8_dtype, block_2d=block_2d, rowwise=True,
                                      columnwise=True, power_2_scale=power_2_scale,
                                      amax_epsilon=float(amax_epsilon))
        return cls(*q, fp8_dtype, x.dtype, block_2d, (power_2_scale, amax_epsilon))

    def operands(self) -> BlockQuantized:
        """(data, scale_inv, data_t, scale_inv_t) as `quantize_blocks` returns them."""
        return BlockQuantized(self._data, self._scale_inv, self._data_t, self._scale_inv_t)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return dequantize_blocks(self._data, self._scale_inv, self._block_2d).to(
            dtype or self.dtype)

    @torch.no_grad()
    def requantize_(self, x: torch.Tensor) -> "Float8BlockTensor":
        """Write the block-scaled form of x (p's shape, any float dtype) into this tensor."""
        x = x.dequantize() if isinstance(x, QuantizedTensor) else x
        q = block_ops.quantize_blocks(x.reshape(self.shape).to(self._data.device), self._fp8_dtype,
                                      block_2d=self._block_2d, rowwise=True, columnwise=True,
                                      power_2_scale=self._qparams[0],
                                      amax_epsilon=self._qparams[1])
        for dst, src in zip(self.operands(), q):
            dst.copy_(src)
        return self

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The initial high-precision value kept (on the CPU) by
        fp8_model_init(preserve_high_precision_init_val=True); else None."""
        return getattr(self, "_high_precision_init_val", None)

    def clear_high_precision_init_val(self) -> None:
        self._high_precision_init_val = None

    def update_usage(self, rowwise_usage: Optional[bool] = None,
                     columnwise_usage: Optional[bool] = None) -> None:
        if rowwise_usage is False or columnwise_usage is False:
            raise NotImplementedError("Float8BlockTensor keeps both its rowwise and columnwise "
                                      "forms (fprop and dgrad read them)")

    def __repr__(self, *, tensor_contents=None):
        head = (f"Float8BlockTensor(fp8_dtype={self._fp8_dtype}, nominal_dtype={self.dtype}, "
                f"blocks={'128x128' if self._block_2d else '1x128'}")
        try:
            return f"{head}, data={self.dequantize()})"
        except Exception:  # a fake or symbolic tensor
            return f"{head}, shape={tuple(self.shape)})"

    def __tensor_flatten__(self):
        return (["_data", "_scale_inv", "_data_t", "_scale_inv_t"],
                {"fp8_dtype": self._fp8_dtype, "dtype": self.dtype, "block_2d": self._block_2d,
                 "qparams": self._qparams})

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8BlockTensor(inner["_data"], inner["_scale_inv"], inner["_data_t"],
                                 inner["_scale_inv_t"], meta["fp8_dtype"], meta["dtype"],
                                 meta["block_2d"], meta["qparams"])

    def _same_meta(self, tensors) -> "Float8BlockTensor":
        return Float8BlockTensor(*tensors, self._fp8_dtype, self.dtype, self._block_2d,
                                 self._qparams)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default):
            return t._same_meta(t.operands())
        if func is aten.clone.default:
            return t._same_meta([o.clone() for o in t.operands()])
        if func is aten.copy_.default and isinstance(t, Float8BlockTensor):
            src = args[1]
            if (isinstance(src, Float8BlockTensor) and src._fp8_dtype == t._fp8_dtype
                    and src._block_2d == t._block_2d and src.shape == t.shape):
                for dst, s in zip(t.operands(), src.operands()):
                    dst.copy_(s)
                return t
            return t.requantize_(src)

        def unwrap(x):
            return x.dequantize() if isinstance(x, Float8BlockTensor) else x
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if isinstance(t, Float8BlockTensor) and _writes_self(func):
            return t.requantize_(out)  # in-place op: it ran on a dequantized copy
        return out


torch.serialization.add_safe_globals([Float8BlockTensor])

__all__ = ["Float8BlockTensor"]
