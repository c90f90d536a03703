"""tritium.GroupedLinear: TE's GroupedLinear (num_gemms expert GEMMs in one module).

Parameters `weight0..weight{G-1}` [out, in] and `bias0..bias{G-1}` [out], TE's names. The G
weights are allocated as views of one [G, out, in] buffer, so the FP8 path casts and multiplies
them as one operand without a copy (after `.to()` or anything else that moves them apart they
are stacked per call: still right, a little slower). forward(inp, m_splits,
is_first_microbatch=None): inp's rows are grouped by expert, m_splits[g] rows for weight g
(sum(m_splits) rows in all; 0 is allowed). One FP8Meta with 2G forward slots (input 2g, weight
2g+1) and G backward slots, so each expert's input, weight and grad_output has its own scale.
The math is `tritium.functional.grouped_linear`. Tensor parallelism is not built.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from .._device import default_device
from ..fp8.autocast import is_fp8_enabled
from ..fp8.formats import HIGH_PRECISION_DTYPES
from ..functional.grouped_linear import grouped_linear
from .base import FP8Module, check_fp8_dims, check_input
from .linear import default_init


class GroupedLinear(FP8Module):
    """y[rows of g] = x[rows of g] W_g^T + b_g for g in range(num_gemms)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device, None] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 fuse_wgrad_accumulation: bool = False, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, parallel_mode: Optional[str] = None,
                 get_rng_state_tracker=None, rng_tracker_name=None, **unsupported):
        for name, value in (("num_gemms", num_gemms), ("in_features", in_features),
                            ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GroupedLinear: {name} must be a positive int, got {value!r}")
        if unsupported:
            raise TypeError(f"GroupedLinear got unsupported arguments {sorted(unsupported)}")
        if tp_size != 1 or sequence_parallel or parallel_mode not in (None, "column", "row"):
            raise NotImplementedError("tensor/sequence parallel GroupedLinear is not built yet: "
                                      "use tp_size=1, sequence_parallel=False")
        super().__init__(num_gemms=num_gemms)
        params_dtype = params_dtype or torch.get_default_dtype()
        if params_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"params_dtype must be one of {HIGH_PRECISION_DTYPES}, got "
                            f"{params_dtype}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.init_method = init_method or default_init
        self._fp8_dims_ok = False
        factory = dict(dtype=params_dtype, device=default_device(device))
        buffer = torch.empty(num_gemms, out_features, in_features, **factory)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(buffer[i]))
            self.register_parameter(f"bias{i}", torch.nn.Parameter(
                torch.empty(out_features, **factory)) if bias else None)
        if self.primary_weights_in_fp8:
            self._fp8_weight_slots = {f"weight{i}": 2 * i + 1 for i in range(num_gemms)}
        self.reset_parameters()

    def _weights(self) -> list:
        params = self._parameters
        return [params[f"weight{i}"] for i in range(self.num_gemms)]

    def _biases(self) -> list:
        params = self._parameters
        return [params[f"bias{i}"] for i in range(self.num_gemms)]

    def reset_parameters(self) -> None:
        self._unquantize_fp8_params()
        with torch.no_grad():
            for w in self._weights():
                self.init_method(w)
            if self.use_bias:
                for b in self._biases():
                    b.zero_()
        self._quantize_fp8_params()
        self._clear_weight_caches()

    def _check_splits(self, inp: torch.Tensor, m_splits) -> list:
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        if not isinstance(m_splits, (list, tuple)) or len(m_splits) != self.num_gemms or \
                not all(isinstance(m, int) and m >= 0 for m in m_splits):
            raise ValueError(f"GroupedLinear.forward: m_splits must be {self.num_gemms} "
                             f"non-negative ints (rows per expert), got {m_splits!r}")
        rows = inp.numel() // self.in_features
        if sum(m_splits) != rows:
            raise ValueError(f"GroupedLinear.forward: m_splits add up to {sum(m_splits)} but inp "
                             f"has {rows} rows of in_features={self.in_features}")
        return list(m_splits)

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int],
                is_first_microbatch: Optional[bool] = None):
        weights = self._weights()
        check_input("GroupedLinear", inp, weights[0], "in_features", self.in_features)
        m_splits = self._check_splits(inp, m_splits)
        if not self._fp8_dims_ok and is_fp8_enabled():
            check_fp8_dims("GroupedLinear", {"in_features": self.in_features,
                                             "out_features": self.out_features})
            self._fp8_dims_ok = True
        plan = self._fp8_plan(inp.device, is_first_microbatch)
        main_grad = ()
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
            for i, w in enumerate(weights):
                if getattr(w, "main_grad", None) is None:
                    raise RuntimeError(f"fuse_wgrad_accumulation=True needs weight{i}.main_grad "
                                       "(an fp32 tensor shaped like the weight) set before forward")
            main_grad = weights
        biases = self._biases() if self.use_bias else None
        bias = None if biases is None or self.return_bias else torch.stack(biases)
        out = grouped_linear(inp, m_splits, weights, bias, fp8=plan, main_grad=main_grad)
        return (out, biases) if self.return_bias else out

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
