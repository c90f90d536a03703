"""Sequence parallelism under block-scaled recipes: the all-gathers move fp8 blocks.

Why it is exact. A rowwise block (1x128 along the GEMM's reduction dim, 1x32 under MXFP8) lies
inside one token, so each rank quantizes its own rows and the gathered blocks are the blocks of
the gathered tensor, bit for bit. A columnwise block (along the tokens: wgrad's form) spans 128
(32) consecutive tokens; where each rank's token count is a multiple of that, every such block
lies inside one rank's rows, and the same holds (no padding either: the gathered count is a
multiple of 16 already). Elsewhere (a local token count that is not such a multiple, no tokens,
torch.compile, or `fp8_block_gather(False)`) the high-precision gather runs as before: gather,
then the block Linear quantizes the whole tensor on every rank.

Column-parallel GEMM, the input gathered (`gather_input`):
    forward: this rank's rows quantized rowwise (and columnwise when wgrad follows); the
        rowwise data and scales all-gathered and handed to the block Linear as a carrier of the
        gathered shape (fused_cast.block_carrier); the columnwise form stays on this rank.
    backward: wgrad asks for the columnwise form (`_GatherLater`, called by the block Linear):
        its data and scales are all-gathered then; the input gradient is reduce-scattered.
    A fused norm's carrier of this rank's blocks (LayerNormLinear / LayerNormMLP) is gathered
    as it is: under sequence parallelism the norm is fused exactly where this gather is FP8.
Decided: the columnwise form travels in backward only. Sent in forward with the rowwise one it
would make the forward move 2 * (1 + 4/128) = 2.06 bytes an element, a bf16 gather's 2.0, and
keep the gathered x8^T through to backward. This way the forward moves 1.03 bytes an element
(0.52x of bf16's), and what waits for backward is this rank's columnwise form (1/tp of the
gathered one; no high-precision tensor). The step's total is the same as sending both in forward.

Row-parallel GEMM, the grad gathered (`scatter_output`):
    forward: the output reduce-scattered in high precision (a sum of FP8 values is not FP8).
    backward: this rank's grad rows quantized rowwise along N (for dgrad) and columnwise along
        the tokens (for wgrad), each form that is needed all-gathered and handed to the block
        Linear's backward as a carrier of the gathered grad.
Both forms are needed in one backward, so with both GEMMs the grad gather moves 2.06 bytes an
element: 1.03x a bf16 gather (0.52x an fp32 one; 0.52x bf16's where only dgrad or only wgrad
runs). What it saves there is work and memory: each rank quantizes its T/tp rows instead of all
T, and no gathered high-precision grad [T, N] exists.

Every form is two all-gathers (the fp8 bytes as uint8, the fp32 scales; each through
`all_gather_dim0`); forms whose blocks run along the tokens are gathered as rows and put side by
side (one copy). MXFP8 (emulated) runs the same with its 32-element blocks, its power-of-2
scales sent as their E8M0 bytes (1 byte a block: 1.03 bytes an element, as 1x128's fp32 ones).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..distributed.tensor_parallel import (TPSpec, all_gather_dim0,
                                           gather_from_sequence_parallel_region,
                                           reduce_scatter_dim0,
                                           reduce_scatter_to_sequence_parallel_region)
from ..fp8.autocast import current as current_autocast
from ..fp8.tensor import Float8Tensor
from ..ref.block_cast import BLOCK, MX_BLOCK, BlockQuantized, e8m0_bits
from ._apply import fast_apply
from .block_linear import BlockScheme, is_block_recipe
from .fused_cast import block_carrier, block_operand

_enabled = True


@contextlib.contextmanager
def fp8_block_gather(enabled: bool):
    """Turn the FP8 all-gather of block-scaled operands on or off inside the block (default:
    on); off, sequence parallelism gathers high precision (for tests and comparisons)."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = before


def gathers_fp8(tokens: int, recipe) -> bool:
    """Whether a sequence-parallel gather of `tokens` local rows moves fp8 blocks under
    `recipe`: each rank's rows must hold whole columnwise blocks (see the module note)."""
    if not (_enabled and is_block_recipe(recipe)) or torch.compiler.is_compiling():
        return False
    block = MX_BLOCK if BlockScheme.of(recipe).mx else BLOCK
    return tokens > 0 and tokens % block == 0


def norm_fusable_under_sp(inp: torch.Tensor) -> bool:
    """LayerNormLinear / LayerNormMLP under sequence parallelism: the norm may write the column
    GEMM's blocks (its rows are this rank's) where the gather of them is FP8."""
    state = current_autocast()
    if state is None or not state.enabled or not inp.shape[-1]:
        return False
    return gathers_fp8(inp.numel() // inp.shape[-1], state.recipe)


def _layout(mx: bool):
    """Along which dim each BlockQuantized field of a token-split tensor holds the tokens
    (0: rows, gathered as they are; 1: columns, put side by side after the gather)."""
    # rowwise data [T, K]; scales [Kb, T] (1x128, slice-major) or [T, Kb] (MX);
    # columnwise data [K, T]; scales [Tb, K] (1x128) or [K, Tb] (MX)
    return (0, 0 if mx else 1, 1, 1 if mx else 0)


def _gather(t: torch.Tensor, dim: int, spec: TPSpec, e8m0: bool) -> torch.Tensor:
    if e8m0:   # MXFP8's power-of-2 scales travel as their E8M0 byte (exact both ways)
        t = e8m0_bits(t)
    out = all_gather_dim0(t, spec.group)
    out = out if dim == 0 else torch.cat(out.chunk(spec.size, 0), dim=1)
    if e8m0:
        out = torch.ldexp(torch.ones(out.shape, device=out.device), out.int() - 127)
    return out


def _gather_forms(q: BlockQuantized, which, mx: bool, spec: TPSpec) -> list:
    """The gathered fields of `q` whose index is in `which` (the others None)."""
    return [_gather(t, d, spec, mx and i % 2 == 1) if i in which and t is not None else None
            for i, (t, d) in enumerate(zip(q, _layout(mx)))]


class _GatherLater:
    """The columnwise form of a gathered input, all-gathered when wgrad calls for it."""

    __slots__ = ("data_t", "scale_inv_t", "mx", "spec")

    def __init__(self, data_t, scale_inv_t, mx: bool, spec: TPSpec):
        self.data_t, self.scale_inv_t, self.mx, self.spec = data_t, scale_inv_t, mx, spec

    def __call__(self):
        local = BlockQuantized(None, None, self.data_t, self.scale_inv_t)
        self.data_t = self.scale_inv_t = None
        return tuple(_gather_forms(local, (2, 3), self.mx, self.spec)[2:])


def _local_blocks(x: torch.Tensor, scheme: BlockScheme, columnwise: bool) -> BlockQuantized:
    """This rank's input blocks: a fused norm's (checked) or quantized here."""
    xq = block_operand(x)
    if xq is None:
        return scheme.quantize(x.reshape(-1, x.shape[-1]), scheme.x_q, scheme.fwd_dtype,
                               rowwise=True, columnwise=columnwise)
    tokens = math.prod(x.shape[:-1])
    if xq.data is None or tuple(xq.data.shape) != (tokens, x.shape[-1]) \
            or xq.data.dtype != scheme.fwd_dtype:
        raise ValueError(f"sequence parallelism: a pre-quantized input must hold {tokens} rows "
                         f"of {scheme.fwd_dtype} blocks, got "
                         f"{None if xq.data is None else (xq.data.dtype, tuple(xq.data.shape))}; "
                         "quantize it with the recipe the Linear runs under")
    return xq


class _GatherBlocks(torch.autograd.Function):
    """Forward: the carrier of the gathered input's rowwise blocks (columnwise: gathered when
    wgrad asks); backward: the input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, x, scheme: BlockScheme, spec: TPSpec, need_wgrad: bool):
        xq = _local_blocks(x, scheme, need_wgrad)
        data, scale_inv, _, _ = _gather_forms(xq, (0, 1), scheme.mx, spec)
        later = None
        if need_wgrad and xq.data_t is not None:
            later = _GatherLater(xq.data_t, xq.scale_inv_t, scheme.mx, spec)
        ctx.spec = spec
        shape = (x.shape[0] * spec.size, *x.shape[1:])
        return block_carrier(BlockQuantized(data, scale_inv, later, None), shape, x.dtype)

    @staticmethod
    def backward(ctx, dx):
        return reduce_scatter_dim0(dx, ctx.spec.group), None, None, None


class _ScatterGatherBlocks(torch.autograd.Function):
    """Forward: the row GEMM's output reduce-scattered; backward: this rank's grad rows
    quantized and the needed forms all-gathered, as the carrier of the gathered grad."""

    @staticmethod
    def forward(ctx, out, scheme: BlockScheme, spec: TPSpec, need_dgrad: bool,
                need_wgrad: bool):
        ctx.scheme, ctx.spec, ctx.need = scheme, spec, (need_dgrad, need_wgrad)
        ctx.shape, ctx.dtype = out.shape, out.dtype
        return reduce_scatter_dim0(out, spec.group)

    @staticmethod
    def backward(ctx, dy):
        scheme, (need_dgrad, need_wgrad) = ctx.scheme, ctx.need
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
        q = scheme.quantize(dy2d, scheme.g_q, scheme.bwd_dtype, rowwise=need_dgrad,
                            columnwise=need_wgrad)
        which = (0, 1) * need_dgrad + (2, 3) * need_wgrad
        full = BlockQuantized(*_gather_forms(q, which, scheme.mx, ctx.spec))
        return block_carrier(full, ctx.shape, ctx.dtype), None, None, None, None


_gather_blocks = fast_apply(_GatherBlocks)
_scatter_gather_blocks = fast_apply(_ScatterGatherBlocks)


def _wgrad(plan, weight, main_grad) -> bool:
    return bool(plan.grad and torch.is_grad_enabled()
                and (weight.requires_grad or bool(main_grad)))


def gather_input(inp: torch.Tensor, plan, weight, main_grad, spec: TPSpec) -> torch.Tensor:
    """A column-parallel block GEMM's input under sequence parallelism: the carrier of the
    gathered fp8 blocks where `gathers_fp8`, else the gathered high-precision rows."""
    if inp.dim() < 2 or not gathers_fp8(math.prod(inp.shape[:-1]), plan.recipe):
        if block_operand(inp) is not None:
            raise RuntimeError("sequence parallelism: a block carrier (a fused norm's blocks) "
                               "reached the high-precision gather; the norm is fused only "
                               "where the gather is FP8 (functional/block_sp.py)")
        return gather_from_sequence_parallel_region(inp, spec.group)
    if isinstance(inp, Float8Tensor):   # as the block Linear reads one: its values
        inp = inp.dequantize()
    dev = inp.device.type
    if torch.is_autocast_enabled(dev) and block_operand(inp) is None:
        inp = inp.to(torch.get_autocast_dtype(dev))   # what the Linear would quantize
    return _gather_blocks(inp, BlockScheme.of(plan.recipe), spec,
                          _wgrad(plan, weight, main_grad))


def scatter_output(out: torch.Tensor, inp: torch.Tensor, plan, weight, main_grad,
                   spec: TPSpec) -> torch.Tensor:
    """A row-parallel block GEMM's output under sequence parallelism, reduce-scattered; its
    grad gathered in fp8 blocks where `gathers_fp8` (local rows), else in high precision."""
    tokens = math.prod(out.shape[:-1]) // spec.size if out.dim() >= 2 else 0
    if not gathers_fp8(tokens, plan.recipe):
        return reduce_scatter_to_sequence_parallel_region(out, spec.group)
    need_dgrad = bool(plan.grad and torch.is_grad_enabled() and inp.requires_grad)
    return _scatter_gather_blocks(out, BlockScheme.of(plan.recipe), spec, need_dgrad,
                                  _wgrad(plan, weight, main_grad))


__all__ = ["fp8_block_gather", "gather_input", "gathers_fp8", "norm_fusable_under_sp",
           "scatter_output"]
