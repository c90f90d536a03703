"""tritium.Linear: TE's Linear (names, arguments, parameter names), FP8 under fp8_autocast.

Parameters: `weight` [out, in] and `bias` [out]; with `parameters_split` one weight (and bias)
Parameter per part, named `<part>_weight` / `<part>_bias`, concatenated along dim 0 per call.
The module checks its inputs and builds the call's FP8 plan; the math is
`tritium.functional.linear`. Tensor parallelism (TE's tp_group / tp_size / parallel_mode /
sequence_parallel): the parameters are this rank's shards (column: weight [out/tp, in], bias
[out/tp]; row: weight [out, in/tp], bias [out] replicated) and in_features / out_features are
the local sizes, as in TE; layouts and collectives in tritium.distributed.tensor_parallel,
docs/tensor_parallel.md. parallel_mode=None keeps the Linear whole whatever tp_size says.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Union

import torch

from .._device import default_device
from ..distributed.tensor_parallel import TPConfig, check_parallel_mode, divide, sp_replicated
from ..fp8.autocast import is_fp8_enabled
from ..fp8.formats import HIGH_PRECISION_DTYPES
from ..functional.linear import MainGradTarget, linear
from .base import FP8Module, check_fp8_dims, check_input

DEFAULT_INIT_STD = 0.023


def default_init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def _split_sizes(parameters_split, out_features: int) -> "OrderedDict[str, int]":
    if isinstance(parameters_split, dict):
        sizes = OrderedDict((str(k).rstrip("_"), int(v)) for k, v in parameters_split.items())
    else:
        names = [str(n).rstrip("_") for n in parameters_split]
        if not names or out_features % len(names):
            raise ValueError(f"parameters_split={parameters_split!r}: out_features={out_features} "
                             f"must split evenly into {len(names)} parts")
        sizes = OrderedDict((n, out_features // len(names)) for n in names)
    if sum(sizes.values()) != out_features:
        raise ValueError(f"parameters_split sizes {dict(sizes)} must add up to "
                         f"out_features={out_features}")
    return sizes


class Linear(FP8Module):
    """y = x W^T + b, with fprop/dgrad/wgrad as FP8 GEMMs inside fp8_autocast."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device, None] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 parameters_split=None, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, get_rng_state_tracker=None,
                 rng_tracker_name=None):
        super().__init__(num_gemms=1)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        owner = type(self).__name__
        check_parallel_mode(owner, parallel_mode)
        self.tp = TPConfig.make(owner, tp_group, tp_size, sequence_parallel)
        self.parallel_mode, self.sequence_parallel = parallel_mode, self.tp.sequence_parallel
        self.tp_size = self.tp.size
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        params_dtype = params_dtype or torch.get_default_dtype()
        if params_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"params_dtype must be one of {HIGH_PRECISION_DTYPES}, got {params_dtype}")
        full_splits = (OrderedDict([("", out_features)]) if parameters_split is None
                       else _split_sizes(parameters_split, out_features))
        self._tp_blocks = None  # set by an owner whose fused weight shards in blocks (MHA)
        self._full_sizes = (in_features, full_splits)
        tp = self.tp.size if parallel_mode is not None else 1
        if parallel_mode == "column":  # TE: in/out_features become this rank's sizes
            for part, rows in full_splits.items():
                divide(owner, f"{part or 'out'}_features", rows, tp)
            out_features //= tp
        elif parallel_mode == "row":
            in_features = divide(owner, "in_features", in_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self._fp8_dims_ok = False
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.init_method = init_method or default_init
        device = default_device(device)
        factory = dict(dtype=params_dtype, device=device)
        col = tp if parallel_mode == "column" else 1
        self.split_sizes = OrderedDict((p, rows // col) for p, rows in full_splits.items())
        for part, rows in self.split_sizes.items():
            prefix = f"{part}_" if part else ""
            self.register_parameter(f"{prefix}weight",
                                    torch.nn.Parameter(torch.empty(rows, in_features, **factory)))
            self.register_parameter(f"{prefix}bias", torch.nn.Parameter(torch.empty(rows, **factory))
                                    if bias else None)
        if self.primary_weights_in_fp8:
            if parameters_split is not None:
                raise NotImplementedError(
                    "parameters_split is not supported for modules built under fp8_model_init "
                    "yet: build this Linear without parameters_split (one fused weight)")
            self._fp8_weight_slots = {"weight": 1}
        self.reset_parameters()

    def _parts(self, kind: str) -> list:
        params = self._parameters  # direct look-up: nn.Module.__getattr__ is slow per step
        return [params[f"{p}_{kind}" if p else kind] for p in self.split_sizes]

    def reset_parameters(self) -> None:
        self._unquantize_fp8_params()
        sharded = self.parallel_mode is not None and self.tp.size > 1
        with torch.no_grad(), self._shard_init_rng(sharded, self.rng_tracker_name):
            for w in self._parts("weight"):
                self.init_method(w)
            if self.use_bias:
                for b in self._parts("bias"):
                    b.zero_()
        self._quantize_fp8_params()
        self._clear_weight_caches()

    def _tp_layout(self) -> dict:
        """{param name: (sharded dim, full block sizes)} (tritium.distributed.tensor_parallel)."""
        if self.tp.size == 1 or self.parallel_mode is None:
            return {}
        in_full, splits = self._full_sizes
        out = {}
        for part, rows in splits.items():
            prefix = f"{part}_" if part else ""
            if self.parallel_mode == "row":
                out[f"{prefix}weight"] = (1, (in_full,))
                continue
            blocks = self._tp_blocks or (rows,)
            out[f"{prefix}weight"] = (0, blocks)
            if self.use_bias:
                out[f"{prefix}bias"] = (0, blocks)
        return out

    def _check_input(self, inp, weight: torch.Tensor) -> None:
        check_input("Linear", inp, weight, "in_features", self.in_features)

    def _check_fp8_dims(self) -> None:
        check_fp8_dims("Linear", {"in_features": self.in_features,
                                  "out_features": self.out_features})

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        weights = self._parts("weight")
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        bias = None
        if self.use_bias:
            biases = self._parts("bias")
            bias = biases[0] if len(biases) == 1 else torch.cat(biases)
        self._check_input(inp, weight)
        if not self._fp8_dims_ok and is_fp8_enabled():  # before _fp8_plan registers the module
            self._check_fp8_dims()
            # the sizes never change: checked once (in eager: a compiled graph would guard on
            # the flag and compile again once it flips)
            self._fp8_dims_ok = not torch.compiler.is_compiling()
        plan = self._fp8_plan(inp.device, is_first_microbatch)
        main_grad = ()
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
            main_grad, row = [], 0
            for w, rows in zip(weights, self.split_sizes.values()):
                if getattr(w, "main_grad", None) is None:
                    raise RuntimeError("fuse_wgrad_accumulation=True needs param.main_grad (an fp32 "
                                       "tensor shaped like the weight) set before forward")
                main_grad.append(MainGradTarget(w, row, row + rows))
                row += rows
        tp = self.tp.spec(type(self).__name__, self.parallel_mode)
        out = linear(inp, weight, None if self.return_bias else bias, fp8=plan,
                     main_grad=main_grad, tp=tp)
        if not self.return_bias:
            return out
        return out, (sp_replicated(bias, tp) if self.parallel_mode == "row" else bias)

    def extra_repr(self) -> str:
        tp = (f", parallel_mode={self.parallel_mode}, tp_size={self.tp.size}, "
              f"sequence_parallel={self.sequence_parallel}" if self.tp.size > 1 else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}{tp}")
