"""Linear as an autograd Function: three FP8 GEMMs (fprop, dgrad, wgrad) or high precision.

Forward under FP8 (T tokens, K = in_features, N = out_features):
    x [T, K] --cast+transpose+amax--> x8 [Tp, K], x8^T [K, Tp]    (Tp = T rounded up to 16,
    w [N, K] --cast+transpose+amax--> w8 [N, K], w8^T [K, N]       zero rows: the GEMMs ignore them)
    y  = x8 @ w8^T                         E4M3 x E4M3, fast accumulation
Backward:
    dy [T, N] --cast+transpose+amax--> dy8, dy8^T                  (E5M2 under HYBRID)
    dx = dy8 @ (w8^T)^T                    E5M2 x E4M3, precise accumulation
    dw = dy8^T @ (x8^T)^T                  E5M2 x E4M3, precise accumulation
Each GEMM is `fp8_gemm_tn(a, b)` with both operands row-major and K contiguous, so only the
casts produce transposes and nothing is copied in between. Backward runs wgrad first and drops
each fp8 operand after its GEMM; for large out_features it works on blocks of dy
(`backward_blocks`) so that its peak memory stays at or under bf16's (small layers, where
that saves at most 16 MiB, run in one pass: fewer launches). The weight's fp8 copies can be cached
across micro-batches (`is_first_microbatch`): True casts and keeps, False reuses without
recording a new weight amax. Without FP8 (and without calibration or main_grad) the call is
plain `F.linear`, so parity with `nn.Linear` is exact.

What the forward keeps for backward: x8^T, and for dgrad the weight's fp8 transpose w8^T only
where it exists anyway (a weight cache, an FP8 param), the weight is no Parameter or a small
one (rule and cost: functional/_recast.py). Otherwise the forward casts w8 alone and keeps a
`WeightRecast`: the Parameter and what fixes its cast's scale (a copy of the delayed scale, which autocast exit
updates before backward; the measured amax under current scaling), from which backward casts
w8^T again just before dgrad: the forward's bits, no amax recorded. A weight FSDP2 gathered as
FP8 keeps no w8^T either: the forward hands backward the Float8Tensor's `transpose_data` in the
w8^T slot (a callable, as a WeightRecast is), which makes w8^T in FSDP2's buffer when dgrad asks
(the lazy transpose, fp8/tensor.py). A forward without grad (FP8Plan.grad False: a reentrant
recompute's first forward, evaluation) makes neither x8^T nor w8^T.

Float8Tensor operands (the fused norm / activation casts, see `tritium.functional.fused_cast`):
an FP8 input of the forward's fp8 dtype is used as it is (its padded data and transpose), and an
FP8 grad_output of the backward's dtype likewise (its high-precision copy, when the producer
wrote one, gives the bias gradient); such a grad runs the backward in one pass, never in
blocks (its fp8 copies exist whole already: blocks would only add launches). Without FP8
compute such operands are dequantized.

Tensor parallelism (`linear(..., tp=TPSpec)`, layouts in tritium.distributed.tensor_parallel):
the collectives wrap the local GEMM as autograd Functions, except for a column-parallel GEMM in
FP8, whose input may be a fused cast's Float8Tensor: there the Function itself all-reduces
dgrad, or under sequence parallelism casts the local rows with the shared scale, all-gathers
the fp8 bytes (the transpose is made after the gather) and reduce-scatters dgrad. Likewise a
row-parallel GEMM in FP8 under sequence parallelism: the Function reduce-scatters its output,
and its backward casts the local grad rows with the shared grad scale and all-gathers the fp8
bytes (half of the bf16 gather), the same fp8 values as casting the gathered grad.

Block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling) run `tritium.functional.block_linear`
instead (chosen in `_linear`).

`fuse_wgrad_accumulation`: the weight gradient is added into `param.main_grad` (fp32) and the
Function returns no gradient for the weight, so `param.grad` stays None.

How a call's fp8 operands are made (the plan, the weight cache, the one-launch small GEMMs):
`tritium.functional.fp8_plan`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from ..distributed.tensor_parallel import (TPSpec, all_gather_dim0, all_reduce,
                                           copy_to_tensor_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           reduce_from_tensor_parallel_region, reduce_scatter_dim0,
                                           reduce_scatter_to_sequence_parallel_region,
                                           sp_replicated, start_all_reduce,
                                           start_reduce_scatter_dim0)
from ..fp8.cast import amax_into
from ..fp8.recipe import DelayedScaling
from ..fp8 import recompute
from ..fp8.scaling import ScalingState, update_states
from ..fp8.tensor import Float8Tensor
from ._apply import fast_apply
from . import block_sp
from ._recast import WeightRecast, cast_weight_t, dgrad_weight
from .block_linear import apply_block_linear, is_block_recipe
from .fp8_plan import FP8Plan
from .fused_cast import fp8_operands, grad_carriers
from .gemm import fp8_dgrad_wgrad_on_one_launch, fp8_gemm_tn, fp8_gemm_tn_pair_on_one_launch
from .linear_sp import gathered_fp8




@dataclasses.dataclass(frozen=True)
class MainGradTarget:
    """Rows [start, stop) of the weight gradient go into `param.main_grad`."""

    param: torch.nn.Parameter
    start: int
    stop: int


def _wgrad_into_fp32(dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """dy^T x with an fp32 result for main_grad: a bf16/fp16 product must not be rounded to
    16 bits before it is accumulated (TE's wgrad GEMM accumulates into main_grad in fp32)."""
    if dy2d.dtype == torch.float32:
        return dy2d.t() @ x2d
    if dy2d.is_cuda:  # cuBLAS: 16-bit inputs, fp32 accumulation and output
        return torch.mm(dy2d.t(), x2d, out_dtype=torch.float32)
    return dy2d.t().float() @ x2d.float()


def _blocks(n: int, parts: int):
    """[start, stop) blocks covering range(n), each a multiple of 16 long but the last."""
    per_part = -(-n // parts)
    step = -(-per_part // 16) * 16
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def backward_blocks(tokens: int, in_features: int, out_features: int) -> int:
    """How many blocks the FP8 backward splits grad_output into.

    One pass casts dy to dy8 and dy8^T at once and runs wgrad then dgrad: beside y, dx and dW
    that holds x8^T, w8^T, dy8 and dy8^T. That is more than bf16's saved input (2*T*K bytes)
    when N*K + 2*T*N > 3*T*K, i.e. for large out_features. Then the backward works on
    ceil(N/K) blocks: dgrad over row blocks of dy, w8^T dropped, wgrad over column blocks, so
    no block's fp8 copy is larger than x8^T and the peak stays at or under bf16's.
    Where the one pass would hold at most ONE_PASS_SLACK bytes more than that, it runs anyway:
    a small layer's blocks save a few MiB and cost host time (a cast and two GEMM launches
    per extra block), which is what bounds such a layer's step.
    """
    t, k, n = tokens, in_features, out_features
    if n * k + 2 * t * n <= 3 * t * k + ONE_PASS_SLACK:
        return 1
    return -(-n // k)


ONE_PASS_SLACK = 16 * 2**20  # bytes; see backward_blocks


def _fp8_backward(plan: FP8Plan, dy2d, operands, in_features, need_dgrad, need_wgrad,
                  wgrad_dtype, dyq=None, dgrad_ready=None, dbias_dtype=None):
    """(dx, dw, dbias or None). dyq: grad_output already in fp8, (dy8 [Tp, N], dy8^T [N, Tp]
    or None, scale_inv). dgrad_ready(dx): called as soon as dx is final, before wgrad's GEMM
    (a column-parallel GEMM starts its dgrad reduction there, so that it runs during wgrad).
    dbias_dtype: where the one-launch backward runs, it also sums dbias of that dtype (None
    comes back otherwise: the caller sums it)."""
    x8_t, x_si, w8_t, w_si = operands
    operands.clear()  # the caller's list must not keep the fp8 operands alive
    bwd_dtype = plan.recipe.fp8_format.backward_dtype
    out_features = dy2d.shape[-1]
    tokens = math.prod(dy2d.shape[:-1])  # with dyq, dy2d may be the unreshaped Float8Tensor
    dx = dw = None
    # a grad that arrives in fp8 (a fused activation backward's cast) already holds dy8 and
    # dy8^T whole: blocks would save no memory, only add launches and host time
    parts = 1 if dyq is not None else backward_blocks(tokens, in_features, out_features)
    # small GEMMs (the host-bound case) on one launch each backward: dgrad and wgrad
    # together, and under delayed scaling dy's cast in their loads too; not where a reduction
    # starts between them (dgrad_ready) or the weight is cast again (a large layer's recast)
    one_launch = parts == 1 and need_dgrad and need_wgrad and dgrad_ready is None and \
        isinstance(w8_t, torch.Tensor)
    current = plan.current_scaling()
    if one_launch and dyq is None and (current is not None or (
            type(plan.bwd) is ScalingState and isinstance(plan.recipe, DelayedScaling))):
        scale, amax = (None, None) if current is not None else (
            plan.bwd.scale_slot(plan.grad_slot), plan.bwd.amax_slot(plan.grad_slot))
        res = fp8_dgrad_wgrad_on_one_launch(dy2d, scale, amax, bwd_dtype, w8_t, w_si, x8_t,
                                            x_si, dy2d.dtype, wgrad_dtype, dbias_dtype, current)
        if res is not None:
            return res
    if parts == 1:
        if dyq is not None:
            dy8, dy8_t, dy_si = dyq
        else:
            dy8, dy8_t, dy_si = plan.quantize(dy2d, plan.bwd, plan.grad_slot, bwd_dtype,
                                              write_data=need_dgrad, write_transpose=need_wgrad)
        if one_launch:
            pair = fp8_gemm_tn_pair_on_one_launch(
                (dy8, dgrad_weight(w8_t), dy_si, w_si, dy2d.dtype),
                (dy8_t, x8_t, dy_si, x_si, wgrad_dtype))
            if pair is not None:
                dx, dw = pair
                return (dx if dx.shape[0] == tokens else dx[:tokens]), dw, None
        if need_dgrad and dgrad_ready is not None:  # dgrad first: its reduction overlaps wgrad
            dx = fp8_gemm_tn(dy8, dgrad_weight(w8_t), dy_si, w_si, dy2d.dtype)
            dx = dx if dx.shape[0] == tokens else dx[:tokens]
            dgrad_ready(dx)
        if need_wgrad:  # wgrad first otherwise: its operands are freed before dx is allocated
            dw = fp8_gemm_tn(dy8_t, x8_t, dy_si, x_si, wgrad_dtype)
        del dy8_t, x8_t
        if need_dgrad and dx is None:
            dx = fp8_gemm_tn(dy8, dgrad_weight(w8_t), dy_si, w_si, dy2d.dtype)
        return (dx if dx is None or dx.shape[0] == tokens else dx[:tokens]), dw, None
    tensor_amax = None
    # current scaling: one scale for all blocks of dy
    if current is not None:
        tensor_amax = torch.zeros(1, dtype=torch.float32, device=dy2d.device)
        amax_into(dy2d, tensor_amax)
    if need_dgrad:  # dx row block = dy row block @ w, written in place
        w8_t = dgrad_weight(w8_t)
        dx = torch.empty(-(-tokens // 16) * 16, in_features, dtype=dy2d.dtype, device=dy2d.device)
        for t0, t1 in _blocks(tokens, parts):
            dy8, _, dy_si = plan.quantize(dy2d[t0:t1], plan.bwd, plan.grad_slot, bwd_dtype,
                                          tensor_amax=tensor_amax)
            fp8_gemm_tn(dy8, w8_t, dy_si, w_si, dy2d.dtype, out=dx[t0:t0 + dy8.shape[0]])
            del dy8
        dx = dx[:tokens]
        if dgrad_ready is not None:
            dgrad_ready(dx)
    del w8_t
    if need_wgrad:  # dW row block = (dy column block)^T @ x, written in place
        dw = torch.empty(out_features, in_features, dtype=wgrad_dtype, device=dy2d.device)
        for n0, n1 in _blocks(out_features, parts):
            _, dy8_t, dy_si = plan.quantize(dy2d[:, n0:n1], plan.bwd, plan.grad_slot,
                                            bwd_dtype, write_data=False, write_transpose=True,
                                            tensor_amax=tensor_amax)
            fp8_gemm_tn(dy8_t, x8_t, dy_si, x_si, wgrad_dtype, out=dw[n0:n1])
            del dy8_t
    return dx, dw, None


class _GradMeta(NamedTuple):
    """What the backward reads of a grad it takes as gathered fp8 operands: shape and dtype."""

    shape: tuple
    dtype: torch.dtype


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, plan: Optional[FP8Plan],
                main_grad: Sequence[MainGradTarget], tp: Optional[TPSpec] = None,
                fp8_inp: Optional[Float8Tensor] = None, fp8_grad_carriers: bool = False):
        # fp8_inp (torch.compile): a fused producer's fp8 output; `inp` is then its carrier,
        # which only takes the gradient (fused_cast.carrier_outputs). fp8_grad_carriers
        # (torch.compile, FP8): the output comes with three carriers whose gradients are
        # grad_output's fp8 pieces, written by a fused activation backward
        # (fused_cast.grad_carriers)
        carrier_shape = inp.shape
        if fp8_inp is not None:
            inp = fp8_inp
        shape = inp.shape
        # a Float8Tensor is not reshaped (a __torch_dispatch__ call and a new wrapper, host
        # time only): its fp8 operands are read from it as it is, or it is dequantized below
        x2d = inp if len(shape) == 2 or isinstance(inp, Float8Tensor) else \
            inp.reshape(-1, shape[-1])
        tokens = math.prod(shape[:-1])
        # tp: column-parallel: dgrad all-reduced (reduce-scattered under sequence parallelism,
        # where the forward all-gathers the input: in FP8 it casts the local rows and gathers
        # the fp8 bytes), started before wgrad so that it overlaps it; row-parallel (FP8 only)
        # under sequence parallelism: the output reduce-scattered here, and the backward casts
        # the local grad rows and all-gathers the fp8 bytes
        column = tp if tp is not None and tp.mode == "column" else None
        ctx.column = column
        # (TPSpec.size: the group's size, known already; no query per call)
        row_sp = ctx.row_sp = (tp if tp is not None and tp.mode == "row" and tp.sequence_parallel
                               else None)
        gather = column.group if column is not None and column.sequence_parallel else None
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or bool(main_grad)
        if plan is not None and not plan.grad:  # no backward follows (FP8Plan.grad)
            need_dgrad = need_wgrad = False
        fp8 = plan is not None and plan.compute_in_fp8
        fwd_dtype = plan.recipe.fp8_format.forward_dtype if fp8 else None
        if isinstance(inp, Float8Tensor) and not (fp8 and inp._fp8_dtype == fwd_dtype):
            x2d = inp.dequantize().reshape(-1, shape[-1])
        if fp8:
            if gather is not None:
                x8, x8_t, x_si = gathered_fp8(plan, x2d, gather, need_wgrad)
                tokens = tokens * column.size
                shape = (shape[0] * column.size, *shape[1:])
                w8, w8_t, w_si = plan.weight_operands(weight, need_dgrad)
            elif isinstance(x2d, Float8Tensor):  # written in fp8 by a fused norm / activation
                x8, x8_t, x_si = fp8_operands(inp, need_wgrad)
                # a small GEMM casts its weight in its own launch
                fused = plan.fprop_casting_weight(x8, x_si, weight, bias, need_dgrad, inp.dtype)
                if fused is None:
                    w8, w8_t, w_si = plan.weight_operands(weight, need_dgrad)
                else:
                    out, (w8, w8_t, w_si) = fused
            else:
                # a small GEMM casts its input and weight in its own launch
                fused = plan.fprop_casting_both(x2d, weight, bias, need_wgrad, need_dgrad,
                                                inp.dtype)
                if fused is None:
                    (x8, x8_t, x_si), (w8, w8_t, w_si) = plan.forward_operands(
                        x2d, weight, need_wgrad, need_dgrad)
                else:
                    out, (x8, x8_t, x_si), (w8, w8_t, w_si) = fused
            if w8 is not None:
                out = fp8_gemm_tn(x8, w8, x_si, w_si, inp.dtype, bias, fast_accum=True)
            if out.shape[0] != tokens:  # drop the zero rows that padded tokens to 16
                out = out[:tokens]
            # Kept as attributes, not saved tensors, so backward can drop each one as soon as
            # its GEMM is done (lower peak memory); none of them is an input or output. Saved
            # tensors under torch.compile (the compiled graph frees them itself) and inside a
            # non-reentrant checkpoint (its hooks drop saved tensors after the forward and
            # recompute them: attributes would stay alive the whole forward).
            ctx.fp8_saved = torch.compiler.is_compiling() or recompute.drops_saved_tensors()
            if ctx.fp8_saved:
                # a w8^T made in backward, from saved tensors: a WeightRecast's (autograd checks
                # the weight's version), or an FSDP2-gathered weight's lazy transpose
                recast = w8_t if isinstance(w8_t, WeightRecast) else None
                ctx.recast = None if recast is None else (recast.fp8_dtype, recast.current)
                parts = ()
                if recast is not None:
                    parts = (recast.weight, recast.scale, recast.amax)
                elif callable(w8_t):  # Float8Tensor.transpose_data: the weight is saved
                    parts = (weight,)
                ctx.save_for_backward(x8_t, x_si, None if callable(w8_t) else w8_t, w_si, *parts)
                ctx.fp8_operands = None
            else:
                ctx.fp8_operands = [x8_t, x_si, w8_t, w_si]
        else:
            if gather is not None:  # column-parallel under sequence parallelism, high precision
                x2d = all_gather_dim0(x2d, gather)
                tokens = tokens * column.size
                shape = (shape[0] * column.size, *shape[1:])
            if isinstance(weight, Float8Tensor):
                weight = weight.dequantize()
            if plan is not None and plan.fwd.amax_slot(plan.input_slot) is not None:
                # calibration: record what FP8 would have seen (not when recomputing)
                amax_into(x2d, plan.fwd.amax_slot(plan.input_slot))
                amax_into(weight, plan.fwd.amax_slot(plan.weight_slot))
            out = F.linear(x2d, weight, bias)
            ctx.save_for_backward(x2d if need_wgrad else None, weight if need_dgrad else None)
        if plan is not None and plan.weight_ready is not None:
            # the pair cast's w8 was for this GEMM only: the plan kept for backward must not
            # hold it (w8^T is in the operands above, or cast again in backward)
            plan = plan.with_weight_ready(None)
        ctx.fp8, ctx.plan, ctx.main_grad = fp8, plan, main_grad
        ctx.shape, ctx.in_shape, ctx.need = shape, carrier_shape, (need_dgrad, need_wgrad)
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        if row_sp is not None:
            out = reduce_scatter_dim0(out, row_sp.group)
            shape = (shape[0] // row_sp.size, *shape[1:])
        out = out if len(shape) == 2 else out.view(*shape[:-1], out.shape[-1])
        if fp8_grad_carriers:
            return (out, *grad_carriers(out, out.numel() // out.shape[-1], out.shape[-1],
                                        plan.recipe.fp8_format.backward_dtype))
        return out

    @staticmethod
    def backward(ctx, grad_out, *carried):  # carried: fp8_grad_carriers' gradients
        plan, (need_dgrad, need_wgrad) = ctx.plan, ctx.need
        dyq = dy_hp = None
        row_sp = ctx.row_sp
        if len(carried):  # grad_out: d(h) when the activation wrote it (bias), else zero-stride
            dy8, dy8_t, dy_si = carried
            dyq = (dy8, dy8_t if need_wgrad else None, dy_si)
            dy_hp = grad_out if ctx.has_bias else None
        elif row_sp is not None:  # this rank's grad rows: cast, then gather the fp8 bytes
            if isinstance(grad_out, Float8Tensor):
                grad_out = grad_out.dequantize()
            local = grad_out.reshape(-1, grad_out.shape[-1])
            dyq = gathered_fp8(plan, local, row_sp.group, need_wgrad, backward=True)
            # dy2d only gives the backward its shape and dtype: the data is dyq's
            grad_out = _GradMeta((local.shape[0] * row_sp.size, local.shape[1]), local.dtype)
        elif isinstance(grad_out, Float8Tensor):  # written in fp8 by a fused activation backward
            if ctx.fp8 and grad_out._fp8_dtype == plan.recipe.fp8_format.backward_dtype:
                dyq = fp8_operands(grad_out, need_wgrad)
                dy_hp = getattr(grad_out, "_hp", None)
            else:
                grad_out = grad_out.dequantize()
        # a Float8Tensor taken as fp8 (dyq) is not reshaped: only its shape and dtype are read
        dy2d = grad_out if dyq is not None or grad_out.dim() == 2 else \
            grad_out.reshape(-1, grad_out.shape[-1])
        dx = dw = db = None
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        wgrad_dtype = torch.float32 if ctx.main_grad else ctx.weight_dtype
        # column-parallel: dgrad's all-reduce (reduce-scatter under sequence parallelism) is
        # started as soon as dx is done and runs during the wgrad GEMM (eager only)
        reduced, dgrad_ready = [], None
        if ctx.column is not None and not torch.compiler.is_compiling():
            start = (start_reduce_scatter_dim0 if ctx.column.sequence_parallel
                     else start_all_reduce)
            dgrad_ready = lambda d: reduced.append(start(d, ctx.column.group))  # noqa: E731
        if ctx.fp8:
            if ctx.fp8_saved:
                x8_t, x_si, w8_t, w_si, *parts = ctx.saved_tensors
                if ctx.recast is not None:
                    w8_t = functools.partial(cast_weight_t, *parts, *ctx.recast)
                elif parts:  # the gathered Float8Tensor weight
                    w8_t = parts[0].transpose_data
                operands = [x8_t, x_si, w8_t, w_si]
            elif ctx.fp8_operands is None:
                raise RuntimeError(
                    "tritium.Linear under fp8_autocast frees its fp8 operands during backward: "
                    "a second backward through the same graph (retain_graph=True) is not "
                    "supported; run the forward again instead")
            else:
                operands, ctx.fp8_operands = ctx.fp8_operands, None
            dx, dw, db = _fp8_backward(
                plan, dy2d, operands, ctx.shape[-1], need_dgrad, need_wgrad, wgrad_dtype, dyq,
                dgrad_ready, dy2d.dtype if want_db and dyq is None else None)
        else:
            x2d, weight = ctx.saved_tensors
            if plan is not None:
                amax_into(dy2d, plan.bwd.amax_slot(plan.grad_slot))
            if need_dgrad:
                dx = dy2d @ weight
                if dgrad_ready is not None:
                    dgrad_ready(dx)
            if need_wgrad:
                dw = (_wgrad_into_fp32(dy2d, x2d) if ctx.main_grad
                      else (dy2d.t() @ x2d).to(wgrad_dtype))
        if want_db and db is None:
            if dyq is not None and dy_hp is None:
                raise RuntimeError("tritium: an FP8 grad_output without its high-precision copy "
                                   "reached a Linear with a bias to differentiate (the fused "
                                   "activation backward must be asked for write_hp)")
            db = (dy_hp.reshape(-1, dy2d.shape[-1]) if dyq is not None else dy2d).sum(0)
        if ctx.main_grad:
            for target in ctx.main_grad:
                target.param.main_grad.add_(dw[target.start:target.stop])
            dw = None
        if plan is not None and plan.region is not None:
            plan.region.backward_done()
        if plan is not None and plan.update_bwd:
            update_states([plan.bwd], plan.amax_group, plan.recipe.reduce_amax)
        if reduced:
            dx = reduced[0]()
        elif dx is not None and ctx.column is not None:
            group = ctx.column.group
            dx = (reduce_scatter_dim0(dx, group) if ctx.column.sequence_parallel
                  else all_reduce(dx, group))
        if dx is not None and len(ctx.in_shape) != 2:
            dx = dx.view(*ctx.in_shape)  # unpacked: a torch.Size argument parses slower
        return dx, dw, db, None, None, None, None, None


_apply_linear = fast_apply(_LinearFunction)


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           fp8: Optional[FP8Plan] = None, main_grad: Sequence[MainGradTarget] = (),
           tp: Optional[TPSpec] = None, fp8_grad_carriers: bool = False):
    """y = inp @ weight.T + bias, in FP8 when `fp8` says so. Inputs are checked by the caller.

    `tp` (tensor parallelism, see tritium.distributed.tensor_parallel): weight and bias are
    this rank's shards. Column: the input is replicated (gradient all-reduced) or, under
    sequence parallelism, this rank's dim-0 rows, all-gathered first (in FP8 when the GEMM
    runs in FP8; gradient reduce-scattered). Row: the partial outputs are all-reduced (or
    reduce-scattered along dim 0) and the bias is added once, after the reduction.

    `fp8_grad_carriers` (torch.compile, for a fused activation backward after this GEMM):
    returns (y, carriers), carriers the `fused_cast.grad_carriers` of y for
    `functional.activation`, or None where this GEMM cannot take its gradient in fp8 that
    way (not FP8, a block-scaled recipe, not compiling)."""
    carry = (fp8_grad_carriers and fp8 is not None and fp8.compute_in_fp8
             and not is_block_recipe(fp8.recipe) and torch.compiler.is_compiling())
    if tp is not None:
        out = _tp_linear(inp, weight, bias, fp8, main_grad, tp, carry)
    else:
        out = _linear(inp, weight, bias, fp8, main_grad, carry=carry)
    if not fp8_grad_carriers:
        return out
    return (out[0], out[1:]) if isinstance(out, tuple) else (out, None)


def _cache_weight_outside(fp8: FP8Plan, weight: torch.Tensor) -> FP8Plan:
    """torch.compile: a traced autograd.Function may not store into the weight cache, so a
    first micro-batch casts the weight here (recording its amax) and the Function reuses it."""
    fp8.weight_operands(weight, need_transpose=True)
    return dataclasses.replace(fp8, is_first_microbatch=False)


def _linear(inp, weight, bias, fp8, main_grad, tp: Optional[TPSpec] = None, carry=False):
    """carry: the Function returns `fused_cast.grad_carriers` beside its output (`linear`)."""
    dev = inp.device.type
    if fp8 is not None and fp8.is_first_microbatch and fp8.weight_cache is not None \
            and fp8.compute_in_fp8 and torch.compiler.is_compiling():
        fp8 = _cache_weight_outside(fp8, weight)
    carrier = getattr(inp, "_carrier", None)  # torch.compile: a fused producer's Float8Tensor
    if carrier is not None:
        bias = None if bias is None else bias.to(carrier.dtype)
        return _apply_linear(carrier, weight, bias, fp8, tuple(main_grad), tp, inp, carry)
    # block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling): their own Function
    apply = (apply_block_linear if fp8 is not None and fp8.compute_in_fp8
             and is_block_recipe(fp8.recipe) else _apply_linear)
    extra = (None, True) if carry else ()  # carry: FP8, tensorwise (apply is the Function)
    if not torch.is_autocast_enabled(dev):
        if fp8 is None and not main_grad and tp is None:
            return F.linear(inp, weight, bias)
        if fp8 is not None and bias is not None and bias.dtype != inp.dtype:
            bias = bias.to(inp.dtype)
        return apply(inp, weight, bias, fp8, tuple(main_grad), tp, *extra)
    dtype = torch.get_autocast_dtype(dev)
    inp = inp.to(dtype)
    if fp8 is None or not fp8.compute_in_fp8:
        weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if fp8 is None and not main_grad and tp is None:
        return F.linear(inp, weight, bias)
    with torch.autocast(dev, enabled=False):  # the Function's math runs in the dtypes given
        return apply(inp, weight, bias, fp8, tuple(main_grad), tp, *extra)


def _tp_linear(inp, weight, bias, fp8, main_grad, tp: TPSpec, carry: bool = False):
    group = tp.group
    if tp.mode == "column":
        # the Function gathers the input (a fused cast's fp8 under tensorwise recipes) and
        # overlaps the dgrad reduction with wgrad; block-scaled recipes (their own Function)
        # and torch.compile's high-precision path use the autograd collectives below
        block = fp8 is not None and fp8.compute_in_fp8 and is_block_recipe(fp8.recipe)
        in_fp8 = fp8 is not None and fp8.compute_in_fp8 and not block
        if in_fp8 or not (block or torch.compiler.is_compiling()):
            return _linear(inp, weight, bias, fp8, main_grad, tp=tp, carry=carry)
        if block and tp.sequence_parallel:  # fp8 blocks gathered where exact (block_sp.py)
            inp = block_sp.gather_input(inp, fp8, weight, main_grad, tp)
        else:
            inp = (gather_from_sequence_parallel_region(inp, group) if tp.sequence_parallel
                   else copy_to_tensor_parallel_region(inp, group))
        return _linear(inp, weight, bias, fp8, main_grad)
    if tp.sequence_parallel and fp8 is not None and fp8.compute_in_fp8 \
            and not is_block_recipe(fp8.recipe) and not torch.compiler.is_compiling():
        # the Function reduce-scatters the output and gathers the grad in fp8 (half the bytes)
        out = _linear(inp, weight, None, fp8, main_grad, tp=tp)
    else:
        out = _linear(inp, weight, None, fp8, main_grad)
        if tp.sequence_parallel and fp8 is not None and fp8.compute_in_fp8 \
                and is_block_recipe(fp8.recipe):
            # the grad gathered in fp8 blocks where exact (block_sp.py)
            out = block_sp.scatter_output(out, inp, fp8, weight, main_grad, tp)
        else:
            out = (reduce_scatter_to_sequence_parallel_region(out, group)
                   if tp.sequence_parallel else reduce_from_tensor_parallel_region(out, group))
    if bias is None:
        return out
    return out + sp_replicated(bias, tp).to(out.dtype)
