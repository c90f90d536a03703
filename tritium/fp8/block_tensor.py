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

FSDP2 (`fully_shard`): split / narrow / new_zeros / copy_ along dim 0 keep the fp8 bytes and
slice the scales with them. `view(-1)` (FSDP2's flat view of a shard) gives the flat rowwise fp8
data, and `untyped_storage()` its storage. Every shard but the last must hold whole 128-row
blocks (128x128: a boundary inside a block would need a second scale for it; 1x128: the
columnwise tiles run 128 rows along N), and FSDP2 needs every all-gather input of a short last
shard padded to the full shard's shape, which a scale grid cannot be: so the rows must split
evenly into whole blocks (N % (128 * world size) == 0); the split raises a ValueError otherwise,
on every rank alike, before any collective. Nothing is reduced: block scales are local, and
`requantize_` of a shard from its local master (the optimizer) writes exactly the shard's
part of what the whole weight's quantization would.
  * 128x128: a shard keeps no columnwise form (`_data_t` and `_scale_inv_t` None; `requantize_`
    then writes the rowwise form only). `fsdp_pre_all_gather` hands FSDP two inputs, the
    shard's fp8 bytes as uint8 (gloo has no fp8 dtypes) and its fp32 scales;
    `fsdp_post_all_gather` makes the columnwise form after the gather (data_t =
    transpose_fp8(data), the scales of the transpose are the same numbers transposed).
  * 1x128: the columnwise form is quantized from high precision (tiles along N) and cannot be
    made from the rowwise bytes, so a shard keeps both (its rows' data and scale columns, its
    columns of data_t and its rows of scale_inv_t) and the all-gather moves both: four inputs,
    each with the shard's rows on dim 0 (the scales [Kb, rows] and data_t [K, rows] transposed
    for the gather and back after it). That is 2 bytes per element, about bf16's.

Deliberately not done: views other than the whole tensor, the fp8 all-gather of tensor
parallelism.
Checkpoints: registered with `torch.serialization.add_safe_globals` (weights_only=True loads).
Distributed checkpoints (tritium.distributed.checkpointing, DCP): the param is saved as its
dequantized values in the nominal dtype (so DCP writes plain storage and the checkpoint loads
into a high-precision model too), and next to it `checkpoint_parts()`, the scales (and for 1x128
blocks the columnwise form, which is quantized from high precision and cannot be derived from
the rowwise one), each laid out with dim 0 along the weight's rows or 128-row blocks, so a
dim-0 shard of the param is a dim-0 shard of every part and DCP reshards them together. Part
names carry the block form (a checkpoint of the other form is refused by name). Requantizing the
values would not do (the block amax of the dequantized values can pick another power-of-2
scale); `load_checkpoint_` divides the values by the saved scales instead, which gives back the
saved fp8 bytes bit for bit (values are fp8 x scale_inv).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..ref.block_cast import BlockQuantized, dequantize_blocks
from . import block as block_ops
from .cast import transpose_fp8
from .formats import FP8_DTYPES
from .quantized_tensor import QuantizedTensor

aten = torch.ops.aten
BLOCK = 128


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
                                      block_2d=self._block_2d, rowwise=True,
                                      columnwise=self._data_t is not None,
                                      power_2_scale=self._qparams[0],
                                      amax_epsilon=self._qparams[1])
        for dst, src in zip(self.operands(), q):
            if dst is not None:
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
        return ([n for n in ("_data", "_scale_inv", "_data_t", "_scale_inv_t")
                 if getattr(self, n) is not None],
                {"fp8_dtype": self._fp8_dtype, "dtype": self.dtype, "block_2d": self._block_2d,
                 "qparams": self._qparams})

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8BlockTensor(inner["_data"], inner["_scale_inv"], inner.get("_data_t"),
                                 inner.get("_scale_inv_t"), meta["fp8_dtype"], meta["dtype"],
                                 meta["block_2d"], meta["qparams"])

    def _same_meta(self, tensors, dtype=None) -> "Float8BlockTensor":
        return Float8BlockTensor(*tensors, self._fp8_dtype, dtype or self.dtype, self._block_2d,
                                 self._qparams)

    def _rows(self, start: int, end: int) -> "Float8BlockTensor":
        """Rows [start, end) as a shard (128x128: no columnwise form); start on a block
        boundary."""
        if start % BLOCK:
            raise ValueError(f"a dim-0 slice of a block-scaled FP8 weight {tuple(self.shape)} "
                             f"must start on a {BLOCK}-row block boundary, got row {start}")
        sr = slice(start // BLOCK, -(-end // BLOCK))
        if self._block_2d:
            return self._same_meta((self._data[start:end], self._scale_inv[sr], None, None))
        return self._same_meta((self._data[start:end], self._scale_inv[:, start:end],
                                self._data_t[:, start:end], self._scale_inv_t[sr]))

    def untyped_storage(self):
        """The rowwise fp8 bytes' storage (a wrapper holds none of its own; FSDP2 compares it)."""
        return self._data.untyped_storage()

    # ------------------------------------------------------------------ distributed checkpoints
    def checkpoint_parts(self) -> dict:
        """What a distributed checkpoint keeps besides the dequantized values (see the module
        note), new tensors (DCP loads into them); shapes as `checkpoint_layout`."""
        if self._block_2d:
            return {"scale_inv_128x128": self._scale_inv.clone()}
        if self._data_t is None:
            raise NotImplementedError("a 1x128 Float8BlockTensor without its columnwise form "
                                      "cannot be checkpointed")
        cols = dequantize_blocks(self._data_t, self._scale_inv_t).t().to(self.dtype)
        return {"scale_inv_1x128": self._scale_inv.t().contiguous(), "columnwise_1x128": cols,
                "scale_inv_t_1x128": self._scale_inv_t.clone()}

    @torch.no_grad()
    def load_checkpoint_(self, values: torch.Tensor, parts: dict) -> "Float8BlockTensor":
        """Write the saved bytes back from a checkpoint's dequantized values and
        `checkpoint_parts` (of this tensor's shape and block form), bit for bit."""
        want = checkpoint_layout(self.shape, self._block_2d)
        got = {n: tuple(t.shape) for n, t in parts.items()}
        if got != want or tuple(values.shape) != tuple(self.shape):
            raise ValueError(f"load_checkpoint_: a {'128x128' if self._block_2d else '1x128'} "
                             f"block-scaled weight {tuple(self.shape)} needs values of its shape "
                             f"and the parts {want}, got values {tuple(values.shape)} and {got}")
        if self._block_2d:
            s = parts["scale_inv_128x128"]
            self._data.copy_(_fp8_of(values, s, True, self._fp8_dtype))
            self._scale_inv.copy_(s)
            if self._data_t is not None:
                transpose_fp8(self._data, out=self._data_t)
                self._scale_inv_t.copy_(s.t())
            return self
        s, st = parts["scale_inv_1x128"].t(), parts["scale_inv_t_1x128"]
        self._data.copy_(_fp8_of(values, s, False, self._fp8_dtype))
        self._scale_inv.copy_(s)
        self._data_t.copy_(_fp8_of(parts["columnwise_1x128"].t(), st, False, self._fp8_dtype))
        self._scale_inv_t.copy_(st)
        return self

    # ------------------------------------------------------------------ FSDP2 extension points
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None,
                            mp_policy=None):
        """(all-gather inputs, metadata): the shard's fp8 bytes (uint8) and its fp32 scales;
        1x128: of both forms, each with the shard's rows on dim 0 (see the module note)."""
        if outer_size is not None:
            check_block_split(tuple(outer_size), mesh.size())
        # shards are equal (check_block_split): no padding rows to drop after the gather
        data = self._data.contiguous().view(torch.uint8)
        if self._block_2d:
            return (data, self._scale_inv.contiguous()), ()
        return (data, self._scale_inv.t().contiguous(),
                self._data_t.t().contiguous().view(torch.uint8), self._scale_inv_t.contiguous()), ()

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded tensor from the gathered bytes and scales; the columnwise form is made
        here (128x128) or put back in its layout (1x128). With `out` (a re-gather into FSDP's
        re-allocated buffers, of which the gathered data is a view): refill the rest."""
        if self._block_2d:
            if out is not None:
                transpose_fp8(out._data, out=out._data_t)
                out._scale_inv_t.copy_(out._scale_inv.t())
                return None
            gathered, scale_inv = all_gather_outputs
            data = gathered.view(self._fp8_dtype)
            data_t, scale_inv_t = transpose_fp8(data), scale_inv.t().contiguous()
        else:
            gathered, scale_inv_rows, cols, scale_inv_t = all_gather_outputs
            if out is not None:
                out._scale_inv.copy_(scale_inv_rows.t())
                transpose_fp8(cols.view(self._fp8_dtype), out=out._data_t)
                return None
            data = gathered.view(self._fp8_dtype)
            scale_inv = scale_inv_rows.t().contiguous()
            data_t = transpose_fp8(cols.view(self._fp8_dtype))
        full = self._same_meta((data, scale_inv, data_t, scale_inv_t), param_dtype)
        return full, (data, scale_inv, data_t, scale_inv_t)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default):
            return t._same_meta(t.operands())
        if func is aten.clone.default:
            return t._same_meta([None if o is None else o.clone() for o in t.operands()])
        if func is aten.as_strided.default and _is_whole_view(t, *args[1:], **kwargs):
            return t._same_meta(t.operands())   # FSDP2's view of the unsharded param
        if func is aten.view.default and list(args[1]) == list(t.shape):
            return t._same_meta(t.operands())   # e.g. DTensor.to_local()'s view_as
        if func is aten.view.default and list(args[1]) in ([-1], [t.numel()]):
            # FSDP2's flat view of a padded shard (kept, never read by a param with all-gather
            # extension points): the rowwise fp8 bytes, whose storage `untyped_storage` reports
            return t._data.view(-1)
        if func in (aten.split.Tensor, aten.split_with_sizes.default):
            # FSDP2 sharding (torch.chunk along dim 0): whole 128-row blocks per shard
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if dim in (0, -2):
                sizes = args[1]
                if isinstance(sizes, int):
                    n = t.shape[0]
                    sizes = [min(sizes, n - i) for i in range(0, n, sizes)] if n else [0]
                    check_block_split(tuple(t.shape), len(sizes), sizes[0])
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                return [t._rows(a, a + n) for a, n in zip(starts, sizes)]
        if func in (aten.slice.Tensor, aten.narrow.default):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim in (0, -2):
                a = args[2] if len(args) > 2 else 0
                a = 0 if a is None else a
                if func is aten.narrow.default:
                    end = a + args[3]
                else:
                    end = args[3] if len(args) > 3 and args[3] is not None else t.shape[0]
                    if len(args) > 4 and args[4] != 1:
                        raise ValueError("a Float8BlockTensor takes dim-0 slices of step 1 only")
                return t._rows(a, min(end, t.shape[0]))
        if func is aten.new_zeros.default:       # FSDP2's storage of a shard: its own form
            rows, cols = args[1]
            dev = t._data.device
            rb, kb = -(-rows // BLOCK), -(-cols // BLOCK)
            data = torch.zeros(rows, cols, dtype=t._fp8_dtype, device=dev)
            if t._block_2d:
                return t._same_meta((data, torch.zeros(rb, kb, device=dev), None, None))
            return t._same_meta((data, torch.zeros(kb, rows, device=dev),
                                 torch.zeros(cols, rows, dtype=t._fp8_dtype, device=dev),
                                 torch.zeros(rb, cols, device=dev)))
        if func is aten.empty_like.default:
            # module.to_empty(): a tensor of the same form whose blocks reset_parameters fills
            device = kwargs.get("device") or t._data.device
            return t._same_meta([None if o is None else torch.empty_like(o, device=device)
                                 for o in t.operands()])
        if func is aten.copy_.default and isinstance(t, Float8BlockTensor):
            src = args[1]
            if (isinstance(src, Float8BlockTensor) and src._fp8_dtype == t._fp8_dtype
                    and src._block_2d == t._block_2d and src.shape == t.shape):
                t._data.copy_(src._data)
                t._scale_inv.copy_(src._scale_inv)
                if t._data_t is not None and src._data_t is not None:
                    t._data_t.copy_(src._data_t)
                    t._scale_inv_t.copy_(src._scale_inv_t)
                elif t._data_t is not None:
                    return t.requantize_(src)
                return t
            return t.requantize_(src)

        def unwrap(x):
            return x.dequantize() if isinstance(x, Float8BlockTensor) else x
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if isinstance(t, Float8BlockTensor) and _writes_self(func):
            return t.requantize_(out)  # in-place op: it ran on a dequantized copy
        return out


def checkpoint_layout(shape, block_2d: bool) -> dict:
    """{part name: shape} of `Float8BlockTensor.checkpoint_parts` for a weight (or a dim-0
    shard of it) of `shape` [rows, K] with 128x128 (block_2d) or 1x128 blocks."""
    rows, k = shape
    kb, rb = -(-k // BLOCK), -(-rows // BLOCK)
    if block_2d:
        return {"scale_inv_128x128": (rb, kb)}
    return {"scale_inv_1x128": (rows, kb), "columnwise_1x128": (rows, k),
            "scale_inv_t_1x128": (rb, k)}


def _expanded(scale_inv: torch.Tensor, shape, block_2d: bool) -> torch.Tensor:
    """Each element's scale_inv for data of `shape` (scale_inv as quantize_blocks writes it)."""
    m, k = shape
    s = scale_inv.repeat_interleave(BLOCK, dim=0)[:m] if block_2d else scale_inv.t()
    return s.repeat_interleave(BLOCK, dim=1)[:, :k]


def _fp8_of(values: torch.Tensor, scale_inv: torch.Tensor, block_2d: bool, fp8_dtype):
    """The fp8 numbers whose dequantized values are `values` (values / scale_inv, exact)."""
    return (values.float() / _expanded(scale_inv, values.shape, block_2d)).to(fp8_dtype)


def _is_whole_view(t, size, stride, storage_offset=0) -> bool:
    return (tuple(size) == tuple(t.shape) and tuple(stride) == (t.shape[1], 1)
            and not storage_offset and t._data.is_contiguous())


def check_block_split(shape: tuple, world: int, rows: int = None) -> None:
    """FSDP2 splits a block-scaled weight [N, K] over `world` ranks in `rows`-row shards
    (torch.chunk: ceil(N / world)): every shard must hold the same number of whole 128-row
    blocks (see the module note)."""
    n = shape[0]
    rows = -(-n // world) if rows is None else rows
    if world > 1 and n > rows and (rows % BLOCK or n % rows):
        raise ValueError(
            f"FSDP2 cannot shard the block-scaled FP8 weight of shape {tuple(shape)} over "
            f"{world} ranks: its shards of {rows} rows would split a {BLOCK}-row scale "
            f"block or leave a short last shard. Its rows must be a multiple of {BLOCK} x the "
            f"shard world size ({BLOCK * world}): shard over fewer ranks, pad the layer's "
            "output features, or keep this weight out of fully_shard / in high precision")


torch.serialization.add_safe_globals([Float8BlockTensor])

__all__ = ["Float8BlockTensor"]
