"""Linear under block-scaled recipes: Float8BlockScaling (1x128 / 128x128) and MXFP8 (emulated).

Forward (T tokens, K = in_features, N = out_features; all casts from high precision):
    x [T, K] --1x128 along K--> x8 [T, K] (fprop); when wgrad is needed also
             --1x128 along T--> x8^T [K, T]
    w [N, K] --128x128 (w_block_scaling_dim=2)--> w8 [N, K], w8^T [K, N] (same numbers, scales
              transposed); or 1x128 along K and 1x128 along N (w_block_scaling_dim=1)
    y  = block_gemm(x8, w8)                        per 128-slice of K, fp32 promotion
Backward:
    dy [T, N] --1x128 along N--> dy8 (dgrad), 1x128 along T --> dy8^T [N, T] (wgrad)
    dx = block_gemm(dy8, w8^T)     dw = block_gemm(dy8^T, x8^T)
Every scale is a current scale of its own block (no amax history, nothing to reduce across
ranks). The fp8 operands the backward needs (x8^T, w8^T and their scales) are kept as Function
attributes and dropped after use; w8^T's blocks only where they exist anyway (a weight cache, an
FP8 param), the weight is no Parameter or a small one, else backward quantizes them again from the Parameter
just before dgrad (`_WeightRecast`; rule and cost: functional/_recast.py): every block's scale
comes from the weight alone, so the bits are the forward's. Tokens are padded with zero rows to
a multiple of 16 (TMA's 16-byte rows for wgrad's K = T); zero rows change no block's amax and no
sum.

MXFP8BlockScaling runs the same structure with 32-element E8M0 blocks along each GEMM's
reduction dim (rowwise and columnwise made separately from high precision, weights too) and the
emulated GEMM (`tritium.ref.block_gemm.mx_gemm_tn`) on every device: no speed claim.

Weight caching (`is_first_microbatch`) as for tensorwise recipes: True quantizes and keeps the
weight's block-quantized forms in the module's WeightCache, False reuses them.
FP8 weights (fp8_model_init under Float8BlockScaling: a `Float8BlockTensor` param) are read as
they are, no cast and no cache, when their form is the recipe's (same fp8 dtype, same 1x128 /
128x128 weight blocks, Float8BlockScaling); otherwise they are dequantized and cast like a
high-precision weight.
CUDA graphs (make_graphed_callables) capture this path; with fp8_weight_caching the weight cast
is the flagged block cast (quantize_blocks(skip=, out=): a device flag makes it a no-op on later
micro-batches), as for tensorwise recipes; MXFP8 (emulated) re-quantizes at every replay.
Pre-quantized input (the fused activation block cast of LayerNormMLP, or the fused norm block
cast of LayerNormLinear / LayerNormMLP; `fused_cast.block_carrier`):
the input is a zero-stride carrier whose BlockQuantized (1x128 rowwise + columnwise, tokens
padded to 16) is used as it is, no cast; its gradient goes back to the carrier as usual.
Likewise a grad_output written in blocks by the fused activation backward (a carrier, or the
high-precision gradient when the bias gradient needs its values) is not cast again.
Tensor parallelism: the collectives wrap this Function (functional.linear._tp_linear); block
scales are local, nothing is reduced across ranks (what equals the unsharded module and why:
docs/block_scaling.md). Sequence parallelism gathers fp8 blocks where each rank's token count
is a multiple of the block (128; MXFP8: 32), else high precision (functional/block_sp.py): a
column-parallel layer's input arrives as a carrier of the gathered rowwise blocks whose
columnwise form (`data_t`) is a callable that all-gathers it when wgrad asks; a row-parallel
layer's grad arrives as a carrier of the gathered blocks (rowwise for dgrad, columnwise for
wgrad). Both are the bits of quantizing the gathered tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..fp8 import block as block_ops
from ..fp8.block_tensor import Float8BlockTensor
from ..fp8.recipe import Float8BlockScaling, MXFP8BlockScaling, QParams, Recipe
from ..fp8.tensor import Float8Tensor
from ..ref.block_cast import BlockQuantized
from ._apply import fast_apply
from ._recast import check_unchanged, recast_in_backward, weight_version
from .fused_cast import block_operand


def is_block_recipe(recipe: Recipe) -> bool:
    return isinstance(recipe, (Float8BlockScaling, MXFP8BlockScaling))


@dataclasses.dataclass(frozen=True)
class BlockScheme:
    """How one block recipe quantizes each GEMM role and which GEMM it runs."""

    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    mx: bool
    w_2d: bool
    x_q: QParams
    w_q: QParams
    g_q: QParams

    @staticmethod
    def of(recipe: Recipe) -> "BlockScheme":
        fmt = recipe.fp8_format
        if isinstance(recipe, MXFP8BlockScaling):
            q = QParams(True, 0.0)
            return BlockScheme(fmt.forward_dtype, fmt.backward_dtype, True, False, q, q, q)
        return BlockScheme(fmt.forward_dtype, fmt.backward_dtype, False,
                           recipe.w_block_scaling_dim == 2, recipe.fp8_quant_fwd_inp,
                           recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)

    def quantize(self, x: torch.Tensor, q: QParams, fp8_dtype, *, rowwise: bool,
                 columnwise: bool, block_2d: bool = False, **flagged) -> BlockQuantized:
        """flagged: skip= / out= of quantize_blocks (CUDA-graph weight caching; not for MX)."""
        if self.mx:
            data, scale = block_ops.quantize_mx(x, fp8_dtype) if rowwise else (None, None)
            data_t, scale_t = (block_ops.quantize_mx(x.t(), fp8_dtype) if columnwise
                               else (None, None))
            return BlockQuantized(data, scale, data_t, scale_t)
        return block_ops.quantize_blocks(x, fp8_dtype, block_2d=block_2d, rowwise=rowwise,
                                         columnwise=columnwise, power_2_scale=q.power_2_scale,
                                         amax_epsilon=float(q.amax_epsilon), **flagged)

    def gemm(self, a, b, sa, sb, out_dtype, bias=None, b_block_2d=False) -> torch.Tensor:
        if self.mx:
            return block_ops.mx_gemm_tn(a, b, sa, sb, out_dtype, bias)
        return block_ops.block_gemm_tn(a, b, sa, sb, out_dtype, bias, b_block_2d=b_block_2d)


def _pad16(t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0]
    if rows % 16 == 0:
        return t
    return torch.cat([t, t.new_zeros(-(-rows // 16) * 16 - rows, t.shape[1])])


class _WeightRecast:
    """w8^T's blocks (data_t, scale_inv_t) quantized again in backward from the weight."""

    __slots__ = ("scheme", "weight", "version")

    def __init__(self, scheme: BlockScheme, weight: torch.Tensor):
        self.scheme, self.weight, self.version = scheme, weight, weight_version(weight)

    def __call__(self):
        check_unchanged(self.weight, self.version)
        s = self.scheme
        wq = s.quantize(self.weight.detach(), s.w_q, s.fwd_dtype, rowwise=False, columnwise=True,
                        block_2d=s.w_2d)
        return wq.data_t, wq.scale_inv_t


def _weight_operands(plan, scheme: BlockScheme, weight: torch.Tensor,
                     need_t: bool) -> BlockQuantized:
    """The weight's blocks; data_t is a _WeightRecast (scale_inv_t None) where backward
    quantizes w8^T again."""
    if isinstance(weight, Float8BlockTensor):
        if (not scheme.mx and weight._block_2d == scheme.w_2d
                and weight._fp8_dtype == scheme.fwd_dtype):
            return weight.operands()   # an FP8 param (fp8_model_init): its own blocks, no cast
        weight = weight.dequantize()
    cache = plan.weight_cache
    key = ("block", plan.recipe, weight.dtype, weight.device, tuple(weight.shape))
    if cache is not None and cache.skip is not None:
        if scheme.mx:  # no flagged MX cast: every replay quantizes (the same bits)
            cache = None
        else:          # CUDA graphs: the device flag decides, the buffers stay put
            if cache.entry is None or cache.key != key:
                cache.entry = scheme.quantize(weight.detach(), scheme.w_q, scheme.fwd_dtype,
                                              rowwise=True, columnwise=True, block_2d=scheme.w_2d)
                cache.key = key
            return scheme.quantize(weight.detach(), scheme.w_q, scheme.fwd_dtype, rowwise=True,
                                   columnwise=True, block_2d=scheme.w_2d, skip=cache.skip,
                                   out=cache.entry)
    if (cache is not None and plan.is_first_microbatch is False and cache.entry is not None
            and cache.key == key):
        return cache.entry
    keep = cache is not None and plan.is_first_microbatch is not None
    again = recast_in_backward(weight, need_t, keep)
    wq = scheme.quantize(weight.detach(), scheme.w_q, scheme.fwd_dtype, rowwise=True,
                         columnwise=(need_t and not again) or keep, block_2d=scheme.w_2d)
    if keep:
        cache.entry, cache.key = wq, key
    return wq._replace(data_t=_WeightRecast(scheme, weight)) if again else wq


def _check_block_operand(xq: BlockQuantized, scheme: BlockScheme, shape, fp8_dtype, what: str):
    """An operand a fused producer (or an FP8 sequence-parallel gather) already quantized: its
    form must be what this GEMM casts: fp8 dtype, shape, and the scales' layout (1x128 blocks,
    or MXFP8's 1x32)."""
    tokens, k = shape
    tp = -(-tokens // 16) * 16
    if xq.data is not None:
        data, scale, want = xq.data, xq.scale_inv, (tp, k)
    else:
        data, scale, want = xq.data_t, xq.scale_inv_t, (k, tp)
    rows, cols = want
    want_scale = (rows, -(-cols // 32)) if scheme.mx else (-(-cols // 128), rows)
    form = "1x32 MXFP8" if scheme.mx else "1x128"
    if (data is None or data.dtype != fp8_dtype or tuple(data.shape) != want
            or scale is None or tuple(scale.shape) != want_scale):
        got = None if data is None else f"{data.dtype}{tuple(data.shape)}"
        raise ValueError(
            f"block Linear: a pre-quantized {what} must hold {form} {fp8_dtype} blocks of "
            f"[{tp}, {k}] (tokens padded to 16), got {got}; quantize it with the recipe the "
            "Linear runs under")


class _BlockLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, plan, main_grad: Sequence, column=None):
        if isinstance(inp, Float8Tensor):
            inp = inp.dequantize()
        if isinstance(weight, Float8Tensor):
            weight = weight.dequantize()
        scheme = BlockScheme.of(plan.recipe)
        shape = inp.shape
        x2d = inp.reshape(-1, shape[-1])
        tokens = x2d.shape[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or bool(main_grad)
        if not plan.grad:  # no backward follows (FP8Plan.grad)
            need_dgrad = need_wgrad = False
        xq = block_operand(inp)
        if xq is None:
            xq = scheme.quantize(_pad16(x2d), scheme.x_q, scheme.fwd_dtype, rowwise=True,
                                 columnwise=need_wgrad)
        else:
            _check_block_operand(xq, scheme, x2d.shape, scheme.fwd_dtype, "input")
        wq = _weight_operands(plan, scheme, weight, need_dgrad)
        out = scheme.gemm(xq.data, wq.data, xq.scale_inv, wq.scale_inv, inp.dtype, bias,
                          b_block_2d=scheme.w_2d)[:tokens]
        ctx.operands = [xq.data_t, xq.scale_inv_t, wq.data_t, wq.scale_inv_t]
        ctx.scheme, ctx.plan, ctx.main_grad, ctx.tokens = scheme, plan, main_grad, tokens
        ctx.in_shape, ctx.need = shape, (need_dgrad, need_wgrad)
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.operands is None:
            raise RuntimeError("tritium.Linear under a block-scaled recipe frees its fp8 operands "
                               "during backward: a second backward through the same graph "
                               "(retain_graph=True) is not supported")
        x_t, x_st, w_t, w_st = ctx.operands
        ctx.operands = None
        scheme, (need_dgrad, need_wgrad) = ctx.scheme, ctx.need
        if need_wgrad and x_t is None:  # a pre-quantized input made without grad enabled
            raise RuntimeError("block Linear: wgrad needs the input's columnwise blocks, which "
                               "its fused producer did not write (it ran with grad disabled)")
        if isinstance(grad_out, Float8Tensor):
            grad_out = grad_out.dequantize()
        dy2d = grad_out.reshape(-1, grad_out.shape[-1])
        # written in blocks by a fused activation backward, or gathered so (block_sp.py)
        dyq = block_operand(grad_out)
        if dyq is None:
            dyq = scheme.quantize(_pad16(dy2d), scheme.g_q, scheme.bwd_dtype, rowwise=need_dgrad,
                                  columnwise=need_wgrad)
        else:
            _check_block_operand(dyq, scheme, dy2d.shape, scheme.bwd_dtype, "grad_output")
            if (need_wgrad and dyq.data_t is None) or (need_dgrad and dyq.data is None) or (
                    ctx.has_bias and ctx.needs_input_grad[2]
                    and getattr(grad_out, "_block_carrier", False)):
                raise RuntimeError("block Linear: a pre-quantized grad_output lacks the "
                                   "columnwise blocks (wgrad), the rowwise blocks (dgrad) or "
                                   "the high-precision values (bias gradient) this GEMM needs")
        dx = dw = db = None
        if need_wgrad:
            if callable(x_t):  # gathered now (an FP8 sequence-parallel gather: block_sp.py)
                x_t, x_st = x_t()
            wgrad_dtype = torch.float32 if ctx.main_grad else ctx.weight_dtype
            dw = scheme.gemm(dyq.data_t, x_t, dyq.scale_inv_t, x_st, wgrad_dtype)
        del x_t, x_st
        if need_dgrad:
            if callable(w_t):  # a _WeightRecast: w8^T's blocks quantized again now
                w_t, w_st = w_t()
            dx = scheme.gemm(dyq.data, w_t, dyq.scale_inv, w_st, dy2d.dtype,
                             b_block_2d=scheme.w_2d)[:ctx.tokens].reshape(ctx.in_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        if ctx.main_grad:
            for target in ctx.main_grad:
                target.param.main_grad.add_(dw[target.start:target.stop])
            dw = None
        if ctx.plan.region is not None:
            ctx.plan.region.backward_done()
        return dx, dw, db, None, None, None


apply_block_linear = fast_apply(_BlockLinearFunction)

__all__ = ["BlockScheme", "is_block_recipe", "apply_block_linear"]
