"""GroupedLinear as an autograd Function: G expert GEMMs, in FP8 as three grouped launches.

inp [M, K] holds the G groups' rows one after the other (m_splits[g] rows for weight g, any
count, 0 included). Forward under FP8 (per-group scales: input g uses forward slot 2g, weight g
slot 2g+1, grad_output g backward slot g, TE's GroupedLinear layout):
    x  --grouped cast+transpose+amax (one launch)--> x8 [M, K], x8^T blocks
    W  = the G weights as one [G, N, K] tensor --grouped cast--> w8, w8^T [G, K, N]
    y  = grouped_gemm(x8, w8)                 one persistent launch, fast accumulation
Backward:
    dy --grouped cast--> dy8, dy8^T blocks
    dW = grouped_wgrad(dy8^T, x8^T)           reduction over each group's rows
    dx = grouped_gemm(dy8, w8^T)              precise accumulation
(dW and dx: one cuBLASLt GEMM per group by default, TRITIUM_FP8_GEMM's rule for Linear:
`tritium.ops.grouped_gemm`.)
The weights are one [G, N, K] operand without a copy when the module's parameters are views of
one buffer (how `tritium.GroupedLinear` allocates them); otherwise they are stacked per call.
The weight's fp8 operands can be cached across micro-batches (`is_first_microbatch`, as in
`tritium.functional.linear`). Without FP8 the Function is a per-group `F.linear` loop (exactly
what a per-expert Linear loop computes); calibration records each group's amaxes.

Kernels run on CUDA (the grouped GEMMs where FP8 tensor cores exist); elsewhere the twins in
`tritium.ref.grouped_gemm` do the same math (the emulated FP8 path).

Not done: block scaling, CUDA-graph weight caching (the device skip flag), FP8 Float8Tensor
inputs from fused norms (they are dequantized).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import _device
from ..fp8.recipe import Float8CurrentScaling
from ..fp8.scaling import update_states
from ..fp8.tensor import Float8Tensor
from ..ops.grouped_gemm import impl as grouped_gemm_impl
from ..ref import grouped_gemm as ref_grouped
from ._apply import fast_apply
from .block_linear import is_block_recipe
from .fp8_plan import FP8Plan
from .linear import MainGradTarget, linear


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..kernels import grouped_gemm as kernel_grouped
    return kernel_grouped


def _cast_impl(t: torch.Tensor):
    return _kernels() if _device.use_triton(t) else ref_grouped


# the grouped GEMMs' implementation (t, fast_accum) -> Triton, cuBLASLt per group or the twin
# (fprop Triton, dgrad and wgrad cuBLASLt by default); a module global the interp tests replace
_gemm_impl = grouped_gemm_impl


def stacked_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The G [N, K] weights as one [G, N, K] tensor: a view when they sit back to back in one
    buffer (no copy), else a stacked copy (always under torch.compile, which cannot trace
    pointer arithmetic; the values are the same)."""
    if torch.compiler.is_compiling():
        return torch.stack([w.detach() for w in weights])
    w0 = weights[0].detach()
    n, k = w0.shape
    step = n * k * w0.element_size()
    base = w0.data_ptr()
    if w0.is_contiguous() and all(
            w.is_contiguous() and w.dtype == w0.dtype and w.data_ptr() == base + i * step
            and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
            for i, w in enumerate(weights)):
        return w0.as_strided((len(weights), n, k), (n * k, k, 1))
    return torch.stack([w.detach() for w in weights])


def _cast(plan: FP8Plan, x2d, offsets, m_splits, state, slots: slice, fp8_dtype, *,
          write_data=True, write_transpose=False):
    """The grouped cast of one operand: per-group scales from `state` at `slots` (delayed,
    amaxes recorded there) or from each group's own amax (current scaling)."""
    impl = _cast_impl(x2d)
    if isinstance(plan.recipe, Float8CurrentScaling):
        amax = torch.zeros(offsets.shape[1] - 1, dtype=torch.float32, device=x2d.device)
        impl.grouped_amax_into(x2d, offsets, amax, m_splits=m_splits)
        return impl.grouped_cast_transpose(
            x2d, offsets, None, amax, fp8_dtype, write_data=write_data,
            write_transpose=write_transpose, m_splits=m_splits,
            current=(plan.recipe.amax_epsilon, plan.recipe.power_2_scale))
    return impl.grouped_cast_transpose(x2d, offsets, state.scale[slots],
                                       state.amax_history[0, slots], fp8_dtype,
                                       write_data=write_data, write_transpose=write_transpose,
                                       m_splits=m_splits)


@functools.lru_cache(maxsize=64)
def _equal_offsets(g: int, n: int, device: torch.device) -> torch.Tensor:
    """The offsets of G groups of n rows (the stacked weights), made once per shape."""
    return ref_grouped.make_offsets([n] * g, device)


def _weight_operands(plan: FP8Plan, weights, need_transpose: bool):
    """(w8 [G, N, K], w8^T [G, K, N] or None, scale_inv [G]) of the weights."""
    g = len(weights)
    n, k = weights[0].shape
    if isinstance(weights[0], Float8Tensor):  # FP8 params (fp8_model_init): no cast
        w8 = torch.stack([w._data for w in weights])
        w8_t = None
        if need_transpose:  # the stack copies: a gathered weight's lazy transpose is not made
            w8_t = torch.stack([w._data.t() if w.lazy_transpose or w._transpose is None
                                else w.transpose_data() for w in weights])
        return w8, w8_t, torch.cat([w._scale_inv.reshape(1) for w in weights])
    fp8_dtype = plan.recipe.fp8_format.forward_dtype
    cache = plan.weight_cache
    key = (type(plan.recipe), fp8_dtype, weights[0].dtype, weights[0].device, g, n, k)
    if plan.is_first_microbatch is False and cache is not None and cache.entry is not None \
            and cache.key == key:
        return cache.entry
    keep = cache is not None and plan.is_first_microbatch is not None
    stack = stacked_weights(weights)
    offsets = (ref_grouped.make_offsets([n] * g, stack.device) if torch.compiler.is_compiling()
               else _equal_offsets(g, n, stack.device))   # dynamo does not trace lru_cache
    w8, w8_t, w_si = _cast(plan, stack.view(g * n, k), offsets, [n] * g, plan.fwd,
                           slice(1, None, 2), fp8_dtype,
                           write_transpose=need_transpose or keep)
    entry = (w8.view(g, n, k), None if w8_t is None else w8_t.view(g, k, n), w_si)
    if keep:
        cache.entry, cache.key = entry, key
    return entry


def _group_sums(dy2d: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
    """[G, N]: each group's rows of dy summed in fp32 (the bias gradients)."""
    ids = torch.repeat_interleave(torch.arange(len(m_splits), device=dy2d.device),
                                  torch.tensor(m_splits, device=dy2d.device),
                                  output_size=dy2d.shape[0])
    out = torch.zeros(len(m_splits), dy2d.shape[1], dtype=torch.float32, device=dy2d.device)
    return out.index_add_(0, ids, dy2d.float())


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, m_splits, plan: Optional[FP8Plan], main_grad: tuple, bias, *weights):
        shape = inp.shape
        x2d = inp.reshape(-1, shape[-1])
        g = len(weights)
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = any(ctx.needs_input_grad[5:]) or bool(main_grad)
        if plan is not None and not plan.grad:  # no backward follows (FP8Plan.grad)
            need_dgrad = need_wgrad = False
        fp8 = plan is not None and plan.compute_in_fp8
        offsets = ref_grouped.make_offsets(m_splits, inp.device)
        if fp8:
            fwd_dtype = plan.recipe.fp8_format.forward_dtype
            w8, w8_t, w_si = _weight_operands(plan, weights, need_dgrad)
            x8, x8_t, x_si = _cast(plan, x2d, offsets, m_splits, plan.fwd, slice(0, None, 2),
                                   fwd_dtype, write_transpose=need_wgrad)
            out = _gemm_impl(x8, True).grouped_fp8_gemm_tn(x8, w8, x_si, w_si, offsets,
                                                           inp.dtype, bias, True,
                                                           m_splits=m_splits)
            ctx.fp8_operands = [x8_t, x_si, w8_t, w_si]
        else:
            ws = [w.dequantize() if isinstance(w, Float8Tensor) else w for w in weights]
            if plan is not None and plan.fwd.amax_slot(0) is not None:  # calibration
                impl = _cast_impl(x2d)
                impl.grouped_amax_into(x2d, offsets, plan.fwd.amax_history[0, 0::2],
                                       m_splits=m_splits)
                for i, w in enumerate(ws):
                    impl.grouped_amax_into(w.detach(), ref_grouped.make_offsets(
                        [w.shape[0]], w.device), plan.fwd.amax_history[0, 2 * i + 1:2 * i + 2],
                        m_splits=[w.shape[0]])
            xs = x2d.split(list(m_splits))
            out = torch.cat([F.linear(xs[i], ws[i], None if bias is None else bias[i])
                             for i in range(g)])
            ctx.save_for_backward(x2d, *ws)
        ctx.fp8, ctx.plan, ctx.main_grad, ctx.num_gemms = fp8, plan, main_grad, g
        ctx.m_splits, ctx.offsets, ctx.shape = m_splits, offsets, shape
        ctx.has_bias, ctx.need = bias is not None, (need_dgrad, need_wgrad)
        ctx.weight_dtype = weights[0].dtype
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        plan, (need_dgrad, need_wgrad) = ctx.plan, ctx.need
        if isinstance(grad_out, Float8Tensor):
            grad_out = grad_out.dequantize()
        dy2d = grad_out.reshape(-1, grad_out.shape[-1])
        g, m_splits, offsets = ctx.num_gemms, ctx.m_splits, ctx.offsets
        wgrad_dtype = torch.float32 if ctx.main_grad else ctx.weight_dtype
        dx = dws = None
        if ctx.fp8:
            if ctx.fp8_operands is None:
                raise RuntimeError("tritium.GroupedLinear under fp8_autocast frees its fp8 "
                                   "operands during backward: a second backward through the "
                                   "same graph is not supported; run the forward again")
            x8_t, x_si, w8_t, w_si = ctx.fp8_operands
            ctx.fp8_operands = None
            bwd_dtype = plan.recipe.fp8_format.backward_dtype
            dy2d = dy2d.contiguous()
            dy8, dy8_t, dy_si = _cast(plan, dy2d, offsets, m_splits, plan.bwd, slice(None),
                                      bwd_dtype, write_data=need_dgrad,
                                      write_transpose=need_wgrad)
            n, k = dy2d.shape[1], ctx.shape[-1]
            if need_wgrad:
                dws = _gemm_impl(dy8_t, False).grouped_fp8_gemm_wgrad(
                    dy8_t, x8_t, dy_si, x_si, offsets, n, k, wgrad_dtype, m_splits=m_splits)
            del dy8_t, x8_t
            if need_dgrad:
                dx = _gemm_impl(dy8, False).grouped_fp8_gemm_tn(
                    dy8, w8_t, dy_si, w_si, offsets, dy2d.dtype, None, False, m_splits=m_splits)
        else:
            x2d, *ws = ctx.saved_tensors
            if plan is not None:
                _cast_impl(dy2d).grouped_amax_into(dy2d, offsets, plan.bwd.amax_history[0],
                                                   m_splits=m_splits)
            dys, xs = dy2d.split(list(m_splits)), x2d.split(list(m_splits))
            if need_dgrad:
                dx = torch.cat([dys[i] @ ws[i] for i in range(g)])
            if need_wgrad:
                dws = [(dys[i].t().float() @ xs[i].float()).to(wgrad_dtype) if ctx.main_grad
                       else dys[i].t() @ xs[i] for i in range(g)]
        db = None
        if ctx.has_bias and ctx.needs_input_grad[4]:
            db = _group_sums(dy2d, m_splits).to(dy2d.dtype)
        wgrads = [None] * g
        if dws is not None:
            if ctx.main_grad:
                for param, dw in zip(ctx.main_grad, dws):
                    param.main_grad.add_(dw)
            else:
                wgrads = [dws[i] for i in range(g)]
        if plan is not None and plan.region is not None:
            plan.region.backward_done()
        if plan is not None and plan.update_bwd:   # under torch.compile, as the Linear's
            update_states([plan.bwd], plan.amax_group, plan.recipe.reduce_amax)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return (dx, None, None, None, db, *wgrads)


_apply = fast_apply(_GroupedLinearFunction)


def grouped_linear(inp: torch.Tensor, m_splits: Sequence[int], weights: Sequence[torch.Tensor],
                   bias: Optional[torch.Tensor] = None, *, fp8: Optional[FP8Plan] = None,
                   main_grad: Sequence[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Rows m_splits[g] of inp times weights[g]^T (+ bias[g]); bias is [G, N] or None.
    main_grad: the G weight Parameters whose fp32 `main_grad` takes the weight gradients
    (fuse_wgrad_accumulation; the Function then returns none). Inputs are checked by the
    caller (the module)."""
    if isinstance(inp, Float8Tensor):  # e.g. from a fused norm: this Function takes 16/32 bits
        inp = inp.dequantize()
    if fp8 is not None and fp8.compute_in_fp8 and is_block_recipe(fp8.recipe):
        return _block_grouped(inp, m_splits, weights, bias, fp8, main_grad)
    dev = inp.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        inp = inp.to(dtype)
        if fp8 is None or not fp8.compute_in_fp8:
            weights = [w.to(dtype) for w in weights]
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(dev, enabled=False):
            return _apply(inp, tuple(m_splits), fp8, tuple(main_grad), bias, *weights)
    if fp8 is not None and bias is not None:
        bias = bias.to(inp.dtype)
    return _apply(inp, tuple(m_splits), fp8, tuple(main_grad), bias, *weights)


def _block_grouped(inp, m_splits, weights, bias, plan: FP8Plan, main_grad):
    """Block-scaled recipes: one block-scaled Linear per group, outputs concatenated. Correct
    (each group's tiles are the Linear's) but not fused: no grouped block GEMM and no weight
    caching yet (docs/block_scaling.md)."""
    plan = dataclasses.replace(plan, weight_cache=None)
    x2d = inp.reshape(-1, inp.shape[-1])
    outs = []
    for g, (x_g, w) in enumerate(zip(x2d.split(list(m_splits)), weights)):
        target = (MainGradTarget(main_grad[g], 0, w.shape[0]),) if main_grad else ()
        outs.append(linear(x_g, w, None if bias is None else bias[g], fp8=plan,
                           main_grad=target))
    return torch.cat(outs).reshape(*inp.shape[:-1], outs[0].shape[-1])
