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

FSDP2 (`torch.distributed.fsdp.fully_shard`): a Float8Tensor param is sharded as a Float8Tensor
(split / narrow / new_zeros / copy_ along dim 0 keep the fp8 bytes; a shard keeps no transpose)
and gathered as FP8 bytes through FSDP2's tensor-subclass extension points:
`fsdp_pre_all_gather` hands FSDP the shard's fp8 data as uint8 (gloo takes no fp8 dtypes; the
bytes are what NCCL moves either way), padded to FSDP's padded shard rows where the shard is
short; `fsdp_post_all_gather` views the gathered bytes as fp8, drops the padding rows, gives the
unsharded tensor a buffer for the transpose that dgrad needs (it is never sent) and reuses the
shard's scale_inv. All shards were written with the same scale (the owning module's delayed
scale, equal on every rank because the amax reduction covers the shard group), so one scale_inv
describes the whole weight. The unsharded tensor's nominal dtype is FSDP's param_dtype
(MixedPrecisionPolicy), so its GEMM outputs come out in the dtype the inputs are cast to.

The transpose of a gathered tensor is lazy. FSDP2 gathers each weight more than once a step (the
forward, then again in backward after reshard_after_forward or for a recompute) and only
backward's dgrad reads w8^T, so a gather marks the transpose stale (no kernel) and its first
reader makes it, into the same buffer: the one returned to FSDP2, which frees its storage at
reshard and allocates it again before the next gather (`out=`). The rule: every reader of
`_transpose` goes through `transpose_data()` (refreshes a stale one), and whatever writes
`_data` in place calls `data_written()` (the transpose made again now, or for a gathered tensor
marked stale). The stale flag lives on the buffer, so every wrapper of the gathered data
(FSDP2's unsharded param, its detached aliases) sees it. A Linear's forward asks a gathered
weight for no transpose: it hands backward `transpose_data` itself (functional/linear.py), so a
no-grad forward makes none and a recomputed step makes one per weight. Tensors not gathered keep
eager transposes.

Checkpoints: the class is registered with `torch.serialization.add_safe_globals`, so a state
dict holding Float8Tensors (FP8 params from fp8_model_init) loads with
`torch.load(weights_only=True)` in any process that imported tritium; what it unpickles is
tensors and dtypes only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from .cast import cast_transpose, dequantize as _dequantize, transpose_fp8
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

    def transpose_data(self) -> Optional[torch.Tensor]:
        """The fp8 transpose [K, N] of the 2D data, None where none is kept. A stale one (an
        FSDP2 gather wrote new data since it was made) is made now, into its own buffer."""
        t = self._transpose
        if t is not None and getattr(t, "_stale", False):
            transpose_fp8(self._data.reshape(-1, self._data.shape[-1]), out=t)
            t._stale = False
        return t

    @property
    def lazy_transpose(self) -> bool:
        """True for an FSDP2-gathered tensor: its transpose is made by its first reader."""
        return self._transpose is not None and hasattr(self._transpose, "_stale")

    def data_written(self) -> None:
        """After `_data` was written in place: the kept transpose follows it (made again now;
        a gathered tensor's is marked stale, made by its next reader)."""
        t = self._transpose
        if t is None:
            return
        if hasattr(t, "_stale"):
            t._stale = True
        else:
            transpose_fp8(self._data.reshape(-1, self._data.shape[-1]), out=t)

    def update_usage(self, rowwise_usage: Optional[bool] = None,
                     columnwise_usage: Optional[bool] = None) -> None:
        """TE's usage switch: columnwise = the fp8 transpose (made from the data, or dropped).
        The row-wise data is always kept (it is what the tensor is)."""
        if rowwise_usage is False:
            raise NotImplementedError("Float8Tensor.update_usage(rowwise_usage=False): tritium's "
                                      "Float8Tensor always holds its row-wise fp8 data")
        if columnwise_usage is True and self._transpose is None:
            self._transpose = transpose_fp8(self._data.reshape(-1, self._data.shape[-1]))
        elif columnwise_usage is False:
            self._transpose = None

    def __repr__(self, *, tensor_contents=None):
        head = f"Float8Tensor(fp8_dtype={self._fp8_dtype}, nominal_dtype={self.dtype}"
        try:
            return (f"{head}, scale_inv={self._scale_inv.item():.6g}, "
                    f"data={self.dequantize()})")
        except Exception:  # no values to show: a fake or symbolic tensor (torch.compile tracing)
            return f"{head}, shape={tuple(self.shape)})"

    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"]
        if self._transpose is not None and not getattr(self._transpose, "_stale", False):
            names.append("_transpose")  # a stale one is left out: never read in its place
        if self._scale is not None:
            names.append("_scale")
        return names, {"fp8_dtype": self._fp8_dtype, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta["fp8_dtype"], meta["dtype"],
                            inner.get("_transpose"), inner.get("_scale"))

    def _same_meta(self, data, transpose=None, scale_inv=None, dtype=None) -> "Float8Tensor":
        out = Float8Tensor(data, self._scale_inv if scale_inv is None else scale_inv,
                           self._fp8_dtype, dtype or self.dtype, transpose, self._scale)
        amax = getattr(self, "_amax", None)   # the optimizer's link to the module's history
        if amax is not None:
            out._amax = amax
        current = getattr(self, "_current_scaling", None)  # fp8_model_init(Float8CurrentScaling)
        if current is not None:
            out._current_scaling = current
        if self._quantizer is not None:
            out._quantizer = self._quantizer
        return out

    # ------------------------------------------------------------------ FSDP2 extension points
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None,
                            mp_policy=None):
        """(inputs to all-gather, metadata): this shard's fp8 bytes, padded to FSDP's shard rows."""
        if getattr(self, "_current_scaling", None) is not None:
            raise ValueError(
                "FP8 weights made under Float8CurrentScaling cannot be sharded (FSDP2) yet: each "
                "shard would take its own scale. Build the model under "
                "fp8_model_init(recipe=DelayedScaling()), or keep bf16 weights and call "
                "te.distributed.enable_fp8_all_gather(model, recipe=...)")
        check_amax_group_covers(mesh, "an FP8 param")
        data = self._data
        if outer_size is not None and data.dim() >= 1:
            rows = -(-outer_size[0] // mesh.size())
            if data.shape[0] < rows:
                data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        rows = None if outer_size is None else outer_size[0]
        return (data.contiguous().view(torch.uint8),), (rows, self._scale_inv)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded Float8Tensor from the gathered bytes (transpose made here)."""
        return fp8_from_all_gather(all_gather_outputs, metadata, self._fp8_dtype, param_dtype,
                                   self._scale, getattr(self, "_amax", None), out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._same_meta(args[0]._data, args[0]._transpose)
        if func is aten.clone.default:
            t, data_t = args[0], args[0].transpose_data()
            return t._same_meta(t._data.clone(), None if data_t is None else data_t.clone())
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return args[0]._same_meta(args[0]._data.view(args[1]))
        if func in _DIM0_OPS and _on_dim0(func, args, kwargs):
            # FSDP2 sharding (chunk/narrow along dim 0): fp8 views of the data, no transpose
            t = args[0]
            out = func(t._data, *args[1:], **kwargs)
            if isinstance(out, (list, tuple)):
                return [t._same_meta(o) for o in out]
            return t._same_meta(out)
        if func is aten.as_strided.default and _is_whole_view(args[0], *args[1:], **kwargs):
            return args[0]._same_meta(args[0]._data, args[0]._transpose)
        if func is aten.new_zeros.default:
            t = args[0]
            data = torch.zeros(args[1], dtype=t._fp8_dtype, device=t._data.device)
            return t._same_meta(data, scale_inv=t._scale_inv.clone())
        if func is aten.empty_like.default:
            # module.to_empty() (a meta-device model made real, e.g. FSDP2 shards): a
            # Float8Tensor whose bytes reset_parameters fills; scale_inv 1 until then
            t, device = args[0], kwargs.get("device") or args[0]._data.device
            return t._same_meta(torch.empty_like(t._data, device=device),
                                scale_inv=torch.ones_like(t._scale_inv, device=device))
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
        dst.data_written()
        return dst


_CHECKED_GROUPS: set = set()


def check_amax_group_covers(mesh, what: str) -> None:
    """Under delayed scaling the shards of a weight share one scale only if the amaxes are
    reduced over a group containing every rank of the shard mesh: check it (host-side, no
    collective, once per group and mesh) before FSDP's all-gather runs."""
    from .autocast import current
    from .recipe import DelayedScaling
    state = current()
    if state is None or not state.enabled or not isinstance(state.recipe, DelayedScaling):
        return
    if not state.recipe.reduce_amax:
        raise ValueError(f"FSDP2 gathers {what} whose shards were cast on different ranks; under "
                         "DelayedScaling(reduce_amax=False) each rank would keep its own scale. "
                         "Use reduce_amax=True (the default)")
    key = (id(state.group), id(mesh))
    if key in _CHECKED_GROUPS:
        return
    import torch.distributed as dist
    group = state.group if state.group is not None else dist.group.WORLD
    have = set(dist.get_process_group_ranks(group))
    need = set(mesh.mesh.flatten().tolist())
    if not need <= have:
        raise ValueError(f"fp8_autocast(fp8_group=...) spans ranks {sorted(have)} but FSDP2 shards "
                         f"{what} over ranks {sorted(need)}: the amax group must contain the shard "
                         "group so that every shard gets the same scale; pass fp8_group=None (all "
                         "ranks) or a group containing the FSDP mesh's ranks")
    _CHECKED_GROUPS.add(key)


def fp8_from_all_gather(all_gather_outputs, metadata, fp8_dtype, nominal_dtype, scale=None,
                        amax=None, out=None):
    """FSDP2's post-all-gather step for FP8 bytes (shared by Float8Tensor params and
    tritium.distributed.fsdp's high-precision weights cast before the gather): view the bytes as
    fp8, drop FSDP's padding rows, allocate the transpose's buffer, stale (the module note: made
    by its first reader). With `out` (every gather after the first) FSDP has re-allocated the
    buffers returned the first time and gathered into them: the transpose is stale again."""
    (gathered,), (rows, scale_inv) = all_gather_outputs, metadata
    data = gathered.view(fp8_dtype)
    if rows is not None and data.shape[0] != rows:
        data = data[:rows]
    if out is not None:
        out.data_written()
        out._scale_inv.copy_(scale_inv)
        return None
    transpose = None
    if data.dim() >= 2:
        transpose = data.new_empty(data.shape[-1], math.prod(data.shape[:-1]))
        transpose._stale = True
    full = Float8Tensor(data, scale_inv.clone(), fp8_dtype, nominal_dtype, transpose, scale)
    if amax is not None:
        full._amax = amax
    return full, tuple(t for t in (data, transpose) if t is not None)


_DIM0_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
             aten.narrow.default, aten.chunk.default)


def _on_dim0(func, args, kwargs) -> bool:
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if func in (aten.slice.Tensor, aten.narrow.default):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return dim == 0 or dim == -args[0].dim()


def _is_whole_view(t, size, stride, storage_offset=0) -> bool:
    """as_strided that views all of t, contiguously (FSDP's view of the unsharded param)."""
    d = t._data
    return (tuple(size) == tuple(d.shape) and tuple(stride) == tuple(d.stride())
            and not storage_offset and d.is_contiguous())


torch.serialization.add_safe_globals([Float8Tensor])
