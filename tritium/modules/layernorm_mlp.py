"""tritium.LayerNormMLP: norm -> fc1 -> activation -> fc2, with TE's names and layout.

Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `fc1_weight` [F, H] or
[2F, H] for gated activations, `fc1_bias`, `fc2_weight` [H, F], `fc2_bias`. Gated activations
(swiglu, geglu, ...) split fc1's output in two along the last dim: the FIRST half goes through
the activation, the SECOND half multiplies. So a Llama port puts gate_proj in rows [0, F) of
fc1_weight and up_proj in rows [F, 2F) (see tritium.integrations.llama and docs/porting.md).

Under fp8_autocast both GEMMs run in FP8 with their own scaling slots (fc1: input 0, weight 1,
grad 0; fc2: input 2, weight 3, grad 1) and weight caches. checkpoint=True recomputes fc1 and
the activation in backward instead of keeping them (reentrant checkpoint; the recompute uses the
forward's scales, frozen, and records no amax).

Fused FP8 casts (DelayedScaling only; `tritium.functional.fused_cast` says when they apply): the
norm writes fc1's fp8 input (+ transpose, amax), the activation writes fc2's fp8 input, and the
activation's backward writes fc1's fp8 grad_output (+ transpose, amax; plus the high-precision
grad only when fc1_bias needs a gradient). Bit-identical to the unfused chain; with
checkpoint=True the recompute's activation cast uses the frozen scales and records nothing.
With both inputs fused (and no checkpoint or weight caching; tensor parallelism included) the
two weights are cast in one launch before fc1 (`functional.fp8_plan.cast_weights_together`).
Under Float8BlockScaling the norm writes fc1's 1x128 input blocks (`kernels.norm_block_cast`),
the activation writes fc2's 1x128 input blocks instead of its bf16 output, and its backward
writes fc1's 1x128 grad_output blocks (plus the high-precision grad only when fc1_bias needs a
gradient); not with checkpoint=True. Under tensor parallelism the activation's casts run in
every mode (its input and output are this rank's F/tp columns, no collective between), the
norm's under sequence parallelism only where fc1 all-gathers fp8 blocks (each rank's token
count a multiple of 128: functional/block_sp.py), not where it gathers high precision.

Tensor parallelism (TE's tp_group / tp_size / set_parallel_mode / sequence_parallel): the
parameters are this rank's shards: fc1_weight [F/tp, H] (gated: [gate_r; up_r], [2F/tp, H],
so the local activation pairs matching halves), fc1_bias likewise, fc2_weight [H, F/tp], fc2_bias
[H] replicated. With set_parallel_mode=True fc1 is column-parallel and fc2 row-parallel (output
all-reduced, or reduce-scattered along dim 0 under sequence parallelism, where the input is
this rank's rows and is all-gathered, in fp8 under FP8, before fc1). As in TE, without
set_parallel_mode the GEMMs run on the shards with no collective (the output is a partial sum).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.utils.checkpoint

from .._device import default_device
from ..distributed.tensor_parallel import TPConfig, divide, sp_replicated
from ..fp8.autocast import is_fp8_enabled
from ..fp8.formats import HIGH_PRECISION_DTYPES
from ..functional.activation import ACTIVATIONS, GATED, activation as apply_activation
from ..functional.block_sp import norm_fusable_under_sp
from ..functional.fused_cast import BlockGradCastSpec, CastSpec, GradCastSpec, block_fusable, \
    block_input_spec, fusable_state
from ..functional.fp8_plan import cast_weights_together
from ..functional.linear import linear
from ._norm_params import norm_cast_spec, norm_then_gemm_input, register_norm_params, \
    reset_norm_params
from .base import FP8Module, check_fp8_dims, check_input
from .linear import default_init


class LayerNormMLP(FP8Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 return_bias: bool = False, return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device, None] = "cuda",
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 checkpoint: bool = False, tp_group=None, tp_size: int = 1,
                 set_parallel_mode: bool = False, sequence_parallel: bool = False,
                 get_rng_state_tracker=None, seq_length=None, micro_batch_size=None):
        super().__init__(num_gemms=2)
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.tp = TPConfig.make("LayerNormMLP", tp_group, tp_size, sequence_parallel)
        self.tp_size, self.sequence_parallel = self.tp.size, self.tp.sequence_parallel
        self.set_parallel_mode = set_parallel_mode
        self.get_rng_state_tracker = get_rng_state_tracker
        self._ffn_full = ffn_hidden_size
        ffn_hidden_size = divide("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size, self.tp.size)
        params_dtype = params_dtype or torch.get_default_dtype()
        if params_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"params_dtype must be one of {HIGH_PRECISION_DTYPES}, got {params_dtype}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, self._ffn_full
        self.size_per_partition = ffn_hidden_size  # TE's name: this rank's share of the ffn
        self._fp8_dims_ok = False  # the FP8 dims check passed (the sizes never change)
        self.eps, self.normalization, self.activation = float(eps), normalization, activation
        self.zero_centered_gamma, self.use_bias = zero_centered_gamma, bias
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.checkpoint = checkpoint
        self.init_method = init_method or default_init
        self.output_layer_init_method = output_layer_init_method or self.init_method
        device = default_device(device)
        factory = dict(dtype=params_dtype, device=device)
        register_norm_params(self, hidden_size, normalization, zero_centered_gamma, params_dtype,
                             device)
        fc1_rows = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_rows, hidden_size, **factory))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_rows, **factory)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        if self.primary_weights_in_fp8:
            self._fp8_weight_slots = {"fc1_weight": 1, "fc2_weight": 3}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_norm_params(self, self.zero_centered_gamma)
        self._unquantize_fp8_params()
        with torch.no_grad(), self._shard_init_rng(self.tp.size > 1):
            self.init_method(self.fc1_weight)
            self.output_layer_init_method(self.fc2_weight)
            for b in (self.fc1_bias, self.fc2_bias):
                if b is not None:
                    b.zero_()
        self._quantize_fp8_params()
        self._clear_weight_caches()

    def _tp_layout(self) -> dict:
        """{param name: (sharded dim, full block sizes)}: fc1 column (gate and up sharded
        separately), fc2 row (tritium.distributed.tensor_parallel)."""
        if self.tp.size == 1:
            return {}
        f = self._ffn_full
        blocks = (f, f) if self.activation in GATED else (f,)
        out = {"fc1_weight": (0, blocks), "fc2_weight": (1, (f,))}
        if self.use_bias:
            out["fc1_bias"] = (0, blocks)
        return out

    def _check(self, inp) -> None:
        check_input("LayerNormMLP", inp, self.fc1_weight, "hidden_size", self.hidden_size)
        if not self._fp8_dims_ok and is_fp8_enabled():
            check_fp8_dims("LayerNormMLP", {"hidden_size": self.hidden_size,
                                            "ffn_hidden_size / tp_size": self.size_per_partition})
            # checked once (in eager: a compiled graph would guard on the flag), as Linear
            self._fp8_dims_ok = not torch.compiler.is_compiling()

    def _fc1_act(self, ln_out: torch.Tensor, plan, fused, tp, block_cast=None) -> torch.Tensor:
        # compiled with the fused casts: fc1's fp8 gradient comes through carriers (eager: a
        # Float8Tensor gradient)
        carry = fused is not None and torch.compiler.is_compiling()
        h = linear(ln_out, self.fc1_weight, self.fc1_bias, fp8=plan, tp=tp,
                   fp8_grad_carriers=carry)
        h, carriers = h if carry else (h, None)
        if block_cast is not None:
            return apply_activation(h, self.activation, fp8_out=block_cast[0],
                                    fp8_grad=block_cast[1])
        if fused is None:
            return apply_activation(h, self.activation)
        fc2_input_slot, fc2_need_t = fused
        act_cast = CastSpec(plan.fwd.scale_slot(fc2_input_slot), plan.fwd.amax_slot(fc2_input_slot),
                            plan.recipe.fp8_format.forward_dtype, fc2_need_t)
        fc1_bias_grad = self.fc1_bias is not None and self.fc1_bias.requires_grad
        grad_cast = GradCastSpec(plan.bwd, plan.grad_slot, write_hp=fc1_bias_grad)
        return apply_activation(h, self.activation, fp8_out=act_cast, fp8_grad=grad_cast,
                                grad_carriers=carriers)

    def _block_casts(self, inp, fc1_plan, fc2_plan):
        """Float8BlockScaling: (fc2's 1x128 input blocks written by the activation, fc1's
        grad_output blocks written by its backward or None), or None where not fused."""
        if not block_fusable(inp, fc2_plan):
            return None
        r, grad_on = fc2_plan.recipe, torch.is_grad_enabled()
        g = r.fp8_quant_bwd_grad
        fwd = block_input_spec(r, grad_on)
        if not (grad_on and block_fusable(inp, fc1_plan)):
            return fwd, None
        bias_grad = self.fc1_bias is not None and self.fc1_bias.requires_grad
        return fwd, BlockGradCastSpec(r.fp8_format.backward_dtype, bool(g.power_2_scale),
                                      float(g.amax_epsilon), True, bias_grad)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check(inp)
        state = fusable_state(inp)
        plans = self._fp8_plans(inp.device, is_first_microbatch)
        fc1_plan, fc2_plan = plans if plans is not None else (None, None)
        mode = self.set_parallel_mode  # TE: without it the GEMMs are local (no collectives)
        fc1_tp = self.tp.spec("LayerNormMLP", "column" if mode else None)
        fc2_tp = self.tp.spec("LayerNormMLP", "row" if mode else None)
        sp_gather = fc1_tp is not None and fc1_tp.sequence_parallel
        norm_cast = fused = None
        if state is not None and plans is not None:
            grad_on = torch.is_grad_enabled()
            norm_cast = norm_cast_spec(self, state.recipe, inp.device,
                                       grad_on and self.fc1_weight.requires_grad and not sp_gather)
            fused = (fc2_plan.input_slot, grad_on and self.fc2_weight.requires_grad)
        if fused is not None and not self.checkpoint:
            # fc1's input comes from the norm's cast (all-gathered in fp8 under sequence
            # parallelism) and fc2's from the activation's: each would cast its weight (its
            # shard under TP) alone, so both weights are cast in one launch here
            grad_on = torch.is_grad_enabled()  # transposes for dgrad (unused ones: harmless)
            # (small GEMMs cast their weights in their own launches instead: `rows`, the fp8
            # input rows of both, where fc1's input is not all-gathered)
            rows = None if sp_gather else -(-math.prod(inp.shape[:-1]) // 16) * 16
            fc1_plan, fc2_plan = cast_weights_together(
                plans, (self.fc1_weight, self.fc2_weight), (grad_on, grad_on), rows)
        block_cast = None
        if not (self.checkpoint and torch.is_grad_enabled()):
            block_cast = self._block_casts(inp, fc1_plan, fc2_plan)
            if block_fusable(inp, fc1_plan) and (not sp_gather or norm_fusable_under_sp(inp)):
                # the norm writes fc1's blocks (under SP where they are gathered as fp8 blocks)
                norm_cast = block_input_spec(fc1_plan.recipe, torch.is_grad_enabled()
                                             and self.fc1_weight.requires_grad)
        ln_out, ln_out_hp = norm_then_gemm_input(self, inp, norm_cast,
                                                 self.return_layernorm_output, fc1_tp)
        if self.checkpoint and torch.is_grad_enabled():
            replay = [fc1_plan, None if fc1_plan is None else fc1_plan.frozen()]

            def fc1_act(x):  # first call: the live plan; the recompute: frozen scales
                plan = replay.pop(0) if len(replay) > 1 else replay[0]
                return self._fc1_act(x, plan, fused, fc1_tp)
            act_out = torch.utils.checkpoint.checkpoint(fc1_act, ln_out, use_reentrant=True)
        else:
            act_out = self._fc1_act(ln_out, fc1_plan, fused, fc1_tp, block_cast)
        fc2_bias = None if self.return_bias else self.fc2_bias
        out = linear(act_out, self.fc2_weight, fc2_bias, fp8=fc2_plan, tp=fc2_tp)
        result = (out, sp_replicated(self.fc2_bias, fc2_tp)) if self.return_bias else (out,)
        if self.return_layernorm_output:
            result = result + (ln_out_hp,)
        return result if len(result) > 1 else result[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, "
                f"bias={self.use_bias}")
