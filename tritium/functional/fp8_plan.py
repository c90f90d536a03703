"""What one FP8 Linear call knows about FP8: `FP8Plan` (built by the module for each call), the
weight's fp8 copies kept across micro-batches (`WeightCache`), and two GEMMs' weight casts in one
launch (`cast_weights_together`, a LayerNormMLP's fc1 and fc2).

A plan holds the recipe, the module's forward / backward ScalingStates (None under current
scaling), which of their slots this GEMM uses, the weight cache and micro-batch flag, and
decides how the forward's operands are made: `forward_operands` (x and the weight cast in one
launch, or the weight from a cache, an FP8 param or an FSDP2 gather), `fprop_casting_weight` /
`fprop_casting_both` (a small GEMM that casts its high-precision operands in its own launch,
`kernels.small_gemm`; None where the rule says no), `quantize` (one operand, the backward's
grad). The Function that runs the GEMMs is `tritium.functional.linear`; its design note covers
what the forward keeps for backward (`WeightRecast`, `functional/_recast.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..fp8.autocast import FP8Region
from ..fp8.cast import cast_transpose, quantize_2d, quantize_pair, transpose_fp8
from ..fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from ..fp8.recompute import FrozenScales
from ..fp8.scaling import ScalingState
from ..fp8.tensor import Float8Tensor
from ._recast import WeightRecast, recast_in_backward
from .block_linear import is_block_recipe
from .gemm import fp8_gemm_tn_casting_both, fp8_gemm_tn_casting_weight, gemm_casts_weight


class WeightCache:
    """The weight's fp8 copies (data, transpose, scale_inv), kept across micro-batches.

    `skip` (set by `tritium.make_graphed_callables` with fp8_weight_caching): an int32 [1]
    device flag. With it the cast always launches, into this cache's persistent buffers (the
    same addresses every call), and the kernel itself returns at once while the flag is
    non-zero; the graph's caller writes the flag before each replay (0: first micro-batch)."""

    def __init__(self):
        self.entry: Optional[tuple] = None
        self.key: Optional[tuple] = None  # (recipe type, fp8 dtype, weight dtype, device)
        self.skip: Optional[torch.Tensor] = None

    def flagged_operands(self, plan: "FP8Plan", weight: torch.Tensor, fp8_dtype, key):
        n, k = weight.shape
        if self.entry is None or self.key != key or self.entry[0].shape != (n, k):
            dev = weight.device
            self.entry = (torch.empty(n, k, dtype=fp8_dtype, device=dev),
                          torch.empty(k, n, dtype=fp8_dtype, device=dev),
                          torch.empty(1, dtype=torch.float32, device=dev))
            self.key = key
        current = plan.current_scaling()
        if current is not None:
            scale = amax = None
        else:
            scale, current = plan.fwd.scale_slot(plan.weight_slot), None
            amax = plan.fwd.amax_slot(plan.weight_slot)
        quantize_2d(weight.detach(), fp8_dtype, scale=scale, amax=amax, current=current,
                    pad_rows_to=1, write_transpose=True, skip=self.skip, out=self.entry)
        return self.entry


@dataclasses.dataclass
class FP8Plan:
    """What one Linear call needs to know about FP8 (built by the module for each call)."""

    recipe: Recipe
    fwd: Optional[ScalingState]          # None under current scaling
    bwd: Optional[ScalingState]
    compute_in_fp8: bool = True          # False: calibration (high precision, amaxes recorded)
    region: Optional[FP8Region] = None   # set on the region's first module: it runs the bwd update
    weight_cache: Optional[WeightCache] = None
    is_first_microbatch: Optional[bool] = None
    # Which slots of the module's states this GEMM uses (a LayerNormMLP has two GEMMs).
    input_slot: int = 0
    weight_slot: int = 1
    grad_slot: int = 0
    # Under torch.compile: the backward scales update in the graph, at the end of the backward
    # of the module's GEMM 0 (its last), over `amax_group` (see docs/compile.md).
    update_bwd: bool = False
    amax_group: object = None
    # The weight's fp8 operands (w8, w8^T, scale_inv), cast already with another GEMM's weight
    # in one launch (`cast_weights_together`): used as they are, no cast here.
    weight_ready: Optional[tuple] = None
    # False: the call runs without grad (a reentrant recompute's first forward, evaluation), so
    # no backward follows: the forward makes none of the transposes that only backward reads
    # (ctx.needs_input_grad says True there for a weight that requires grad).
    grad: bool = True

    def frozen(self) -> "FP8Plan":
        """This plan with its forward scales fixed now and no amax recording (for recompute)."""
        fwd = None if self.fwd is None else FrozenScales(self.fwd)
        return dataclasses.replace(self, fwd=fwd)

    def current_scaling(self) -> Optional[tuple]:
        """(amax_epsilon, power_2_scale) under Float8CurrentScaling (the casts' `current`
        argument), else None."""
        rec = self.recipe
        return (rec.amax_epsilon, rec.power_2_scale) if isinstance(rec, Float8CurrentScaling) \
            else None

    def with_weight_ready(self, ready: tuple) -> "FP8Plan":
        """dataclasses.replace(self, weight_ready=ready) without its walk over every field
        (two plans per LayerNormMLP call): a shallow copy, then the one field set."""
        plan = object.__new__(type(self))
        plan.__dict__.update(self.__dict__)
        plan.weight_ready = ready
        return plan

    def quantize(self, x2d, state, slot, fp8_dtype, *, record=True, pad_rows_to=16,
                 write_data=True, write_transpose=False, tensor_amax=None):
        """Cast one GEMM operand. `tensor_amax` (current scaling only): the amax of the whole
        tensor that x2d is a block of, so that every block gets the tensor's one scale."""
        current = self.current_scaling()
        if current is not None:
            scale = amax = None
            if tensor_amax is not None:
                return cast_transpose(x2d, None, tensor_amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                      write_data=write_data, write_transpose=write_transpose,
                                      current=current)
        else:
            scale = state.scale_slot(slot)
            amax = state.amax_slot(slot) if record else None
        return quantize_2d(x2d, fp8_dtype, scale=scale, amax=amax, current=current,
                           pad_rows_to=pad_rows_to, write_data=write_data,
                           write_transpose=write_transpose)

    def _weight_key(self, weight: torch.Tensor, fp8_dtype: torch.dtype) -> tuple:
        """What a cached fp8 weight must match to be reused."""
        return (type(self.recipe), fp8_dtype, weight.dtype, weight.device)

    def _reused_weight(self, key):
        """The cached fp8 weight operands when this micro-batch reuses them, else None."""
        cache = self.weight_cache
        if self.is_first_microbatch is False and cache.entry is not None and cache.key == key:
            return cache.entry
        return None

    def _weight_cast_due(self, weight: torch.Tensor, key) -> bool:
        """False where the weight's fp8 operands come without a plain cast now: an FP8 param,
        a CUDA-graph cache (its own flagged cast) or a cache reused on a later micro-batch."""
        if isinstance(weight, Float8Tensor) or self.weight_ready is not None:
            return False
        if self.weight_cache is None:
            return True
        return self.weight_cache.skip is None and self._reused_weight(key) is None

    def forward_operands(self, x2d: torch.Tensor, weight: torch.Tensor, need_wgrad: bool,
                         need_dgrad: bool):
        """The forward GEMM's fp8 operands, ((x8, x8_t, x_si), (w8, w8_t, w_si)): x cast with
        its transpose when wgrad needs it, the weight with its transpose when dgrad does (or a
        cache keeps it; w8_t may be a WeightRecast instead, see `_recast`). Where both must be
        cast now, one launch casts both."""
        fp8_dtype = self.recipe.fp8_format.forward_dtype
        key = None if self.weight_cache is None else self._weight_key(weight, fp8_dtype)
        if not self._weight_cast_due(weight, key):
            return (self.quantize(x2d, self.fwd, self.input_slot, fp8_dtype,
                                  write_transpose=need_wgrad),
                    self.weight_operands(weight, need_dgrad))
        keep = key is not None and self.is_first_microbatch is not None
        recast = self._recast(weight, need_dgrad, keep)
        current = self.current_scaling()
        if current is not None:
            x_scale = x_amax = w_scale = None
            w_amax = None if recast is None else recast.amax  # measured already: keep it
        else:
            fwd = self.fwd
            x_scale, x_amax = fwd.scale_slot(self.input_slot), fwd.amax_slot(self.input_slot)
            w_scale, w_amax = fwd.scale_slot(self.weight_slot), fwd.amax_slot(self.weight_slot)
        xq, wq = quantize_pair((x2d, x_scale, x_amax, 16, True, need_wgrad),
                               (weight, w_scale, w_amax, 1, True,
                                (need_dgrad and recast is None) or keep),
                               fp8_dtype, current)
        if keep:
            self.weight_cache.entry, self.weight_cache.key = wq, key
        return xq, wq if recast is None else (wq[0], recast, wq[2])

    def casts_weight_in_gemm(self, weight: torch.Tensor, rows: int, need_transpose: bool) -> bool:
        """Whether the forward GEMM of `rows` rows casts this weight in its own launch
        (`functional.gemm.fp8_gemm_tn_casting_weight`: a small GEMM under delayed scaling with
        live states or under current scaling, a high-precision weight cast now, no weight
        caching, its fp8 transpose kept for dgrad)."""
        cache = self.weight_cache
        return ((isinstance(self.recipe, Float8CurrentScaling)
                 or (isinstance(self.recipe, DelayedScaling) and type(self.fwd) is ScalingState))
                and gemm_casts_weight(rows, weight)  # False at once under torch.compile
                and self.weight_ready is None and type(weight) in _PLAIN
                and (cache is None or (cache.skip is None and self.is_first_microbatch is None))
                and not recast_in_backward(weight, need_transpose, False))

    def fprop_casting_weight(self, x8, x_si, weight, bias, need_transpose: bool, out_dtype):
        """(out, (w8, w8^T, w_si)) of the forward GEMM with the weight cast in its launch (w8 is
        None: never in memory), or None where it does not (`casts_weight_in_gemm`)."""
        if not self.casts_weight_in_gemm(weight, x8.shape[0], need_transpose):
            return None
        scale, amax = self._fwd_slots(self.weight_slot)
        res = fp8_gemm_tn_casting_weight(
            x8, x_si, weight.detach(), scale, amax, self.recipe.fp8_format.forward_dtype,
            out_dtype, bias, need_transpose, self.current_scaling())
        return None if res is None else (res[0], (None, res[1], res[2]))

    def fprop_casting_both(self, x2d, weight, bias, need_wgrad: bool, need_dgrad: bool,
                           out_dtype):
        """(out, (x8, x8^T, x_si), (w8, w8^T, w_si)) of the forward GEMM with the
        high-precision input and weight both cast in its launch (x8 and w8 are None: never
        in memory), or None where it does not (`casts_weight_in_gemm`, x's layout)."""
        rows = -(-x2d.shape[0] // 16) * 16
        if not (x2d.stride(-1) == 1 and self.casts_weight_in_gemm(weight, rows, need_dgrad)):
            return None
        res = fp8_gemm_tn_casting_both(
            x2d, *self._fwd_slots(self.input_slot), weight.detach(),
            *self._fwd_slots(self.weight_slot), self.recipe.fp8_format.forward_dtype, out_dtype,
            bias, need_wgrad, need_dgrad, self.current_scaling())
        if res is None:
            return None
        out, x8_t, x_si, w8_t, w_si = res
        return out, (None, x8_t, x_si), (None, w8_t, w_si)

    def _fwd_slots(self, slot: int) -> tuple:
        """(scale, amax) of a forward slot under delayed scaling; (None, None) under current
        scaling (the one-launch forms measure the amaxes)."""
        if self.fwd is None:
            return None, None
        return self.fwd.scale_slot(slot), self.fwd.amax_slot(slot)

    def weight_operands(self, weight: torch.Tensor, need_transpose: bool):
        if self.weight_ready is not None:
            return self.weight_ready
        if isinstance(weight, Float8Tensor):  # an FP8 param or an FSDP2 FP8 gather: no cast
            w8, w8_t = weight._data, None
            if need_transpose and weight.lazy_transpose:
                # an FSDP2 gather's: made when backward asks, in FSDP2's buffer (fp8/tensor.py)
                w8_t = weight.transpose_data
            elif need_transpose:
                w8_t = weight.transpose_data()
                w8_t = transpose_fp8(w8) if w8_t is None else w8_t
            return w8, w8_t, weight._scale_inv
        cache, first = self.weight_cache, self.is_first_microbatch
        fp8_dtype = self.recipe.fp8_format.forward_dtype
        key = self._weight_key(weight, fp8_dtype)
        if cache is not None and cache.skip is not None:  # a device flag decides (CUDA graphs)
            return cache.flagged_operands(self, weight, fp8_dtype, key)
        reused = None if cache is None else self._reused_weight(key)
        if reused is not None:
            return reused
        keep = cache is not None and first is not None
        recast = self._recast(weight, need_transpose, keep)
        if recast is not None:
            w8, _, w_si = self.quantize(weight.detach(), self.fwd, self.weight_slot, fp8_dtype,
                                        pad_rows_to=1, tensor_amax=recast.amax)
            return w8, recast, w_si
        w8, w8_t, w_si = self.quantize(weight.detach(), self.fwd, self.weight_slot, fp8_dtype,
                                       pad_rows_to=1, write_transpose=need_transpose or keep)
        if keep:
            cache.entry, cache.key = (w8, w8_t, w_si), key
        return w8, w8_t, w_si

    def _recast(self, weight: torch.Tensor, need_transpose: bool,
                keep: bool) -> Optional[WeightRecast]:
        """For a high-precision weight whose plain cast is due now: None where dgrad's w8^T is
        kept from forward, else the WeightRecast that casts it again in backward."""
        if recast_in_backward(weight, need_transpose, keep):
            return WeightRecast(self, weight)
        return None


def cast_weights_together(plans: Sequence[FP8Plan], weights: Sequence[torch.Tensor],
                          need_transposes: Sequence[bool],
                          rows: Optional[int] = None) -> Sequence[FP8Plan]:
    """Two GEMMs' weight casts (e.g. a LayerNormMLP's fc1 and fc2) in one launch, before the
    first GEMM runs: the plans come back with `weight_ready` set. The same values as two
    casts (forward scales change only at the autocast's exit; each weight's amax goes to its
    own slot). Only for the plain case, where each GEMM would cast its weight alone: FP8 on,
    a per-tensor recipe, live delayed-scaling states (no recompute) or current scaling, no
    weight caching, high-precision weights on one device, eager; the plans come back
    unchanged otherwise, and where both GEMMs, of `rows` fp8 input rows each, cast their
    weights in their own launches (`FP8Plan.casts_weight_in_gemm`: small GEMMs)."""
    a, b = plans
    wa, wb = weights
    rec = a.recipe
    current = isinstance(rec, Float8CurrentScaling)
    if not (a.compute_in_fp8 and b.compute_in_fp8 and b.recipe is rec
            and (current or (type(a.fwd) is ScalingState and b.fwd is a.fwd))
            and a.is_first_microbatch is None and b.is_first_microbatch is None
            and all(p.weight_cache is None or p.weight_cache.skip is None for p in plans)
            and type(wa) in _PLAIN and type(wb) in _PLAIN and wa.device == wb.device
            and not is_block_recipe(rec) and not torch.compiler.is_compiling()):
        return plans
    if rows is not None and all(p.casts_weight_in_gemm(w, rows, bool(t))
                                for p, w, t in zip(plans, weights, need_transposes)):
        return plans
    jobs, recasts = [], []
    for plan, w, need_t in zip(plans, weights, need_transposes):
        # dgrad's w8^T cast again in backward (functional/_recast.py): the pair writes w8 only
        recast = plan._recast(w, bool(need_t), keep=False)
        slot = plan.weight_slot
        scale, amax = (None, None) if current else (plan.fwd.scale_slot(slot),
                                                    plan.fwd.amax_slot(slot))
        if recast is not None and current:
            amax = recast.amax   # measured by the WeightRecast: the pair casts with it
        jobs.append((w.detach(), scale, amax, 1, True, bool(need_t) and recast is None))
        recasts.append(recast)
    ready = quantize_pair(*jobs, rec.fp8_format.forward_dtype,
                          (rec.amax_epsilon, rec.power_2_scale) if current else None)
    ready = [r if c is None else (r[0], c, r[2]) for r, c in zip(ready, recasts)]
    return [p.with_weight_ready(r) for p, r in zip(plans, ready)]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


__all__ = ["FP8Plan", "WeightCache", "cast_weights_together"]
