"""Fused FP8 casts: when they apply, what a fused kernel needs, and the Float8Tensor it hands on.

Under fp8_autocast with DelayedScaling the scale of a GEMM operand is known before the operand
exists, so the kernel that produces the operand can write it in fp8 directly:
  * LayerNormLinear / LayerNormMLP: the norm writes the first GEMM's input (data, transpose, amax,
    scale_inv) -- `tritium.kernels.norm_cast`;
  * LayerNormMLP: the activation writes fc2's input, and the activation's backward writes fc1's
    output gradient (data + transpose, its amax) -- `tritium.kernels.act_cast`.
The producer returns a `Float8Tensor` (nominal dtype = the high-precision dtype; `_data` is the
[T, K] view of the padded [Tp, K] buffer, which is kept in `_padded_data`; `_transpose` is the
padded [K, Tp] transpose) and `_LinearFunction` takes its fp8 operands as they are (forward
input, or backward grad_output) instead of casting. Autograd accepts a Float8Tensor both as the
output of a Function and as the gradient of a plain tensor (checked in tests/test_fused_casts.py),
so no side channel is needed. A Float8Tensor that lost `_padded_data` (detached by activation
checkpointing) still works: `fp8_operands` re-pads `_data` with zero rows, the same bits.

Everything stays bit-identical to the unfused path (norm/activation kernel, then the cast
kernel): same scale, same values rounded to the high-precision dtype before scaling, same amax
(max is order-free), same scale_inv. Not fused (unfused path kept): Float8CurrentScaling (the
scale needs the amax first), calibration, high precision, torch.autocast (the unfused path
casts the norm output to the autocast dtype first), empty inputs.

Float8BlockScaling (current scales per 1x128 block, nothing to read in advance): LayerNormMLP's
activation writes fc2's 1x128 input blocks (rowwise and columnwise, `kernels.act_block_cast`)
and returns a *carrier*: a zero-stride high-precision tensor of the activation's shape (no
memory) whose `_block_operand` attribute holds the BlockQuantized; the block Linear Function
takes that instead of quantizing, and returns its input gradient for the carrier, which
autograd hands to the activation's backward (recomputed from fc1's output, as unfused).
`block_operand(t)` reads it. The activation's backward does the same for fc1's grad_output
(1x128 rowwise along 2F / F and columnwise along the tokens): it returns a carrier, or the
high-precision d(h) carrying the blocks when fc1's bias gradient needs the values; autograd
hands it to fc1's block Linear backward, which casts nothing. Not fused there:
checkpoint=True (the reentrant checkpoint detaches the carrier). Under tensor parallelism in
every mode: the activation's input and output are this rank's columns, no collective between.
The norm of LayerNormLinear / LayerNormMLP likewise writes the first GEMM's 1x128 input blocks
(rowwise, and columnwise when wgrad needs them; `kernels.norm_block_cast`) and returns a
carrier (plus the high-precision output for return_layernorm_output), with the same skip;
under tensor parallelism only for a column-parallel GEMM: without sequence parallelism (the
identity `copy_to_tensor_parallel_region` hands the carrier on), or with it where the gather
moves fp8 blocks (`block_sp`: each rank's tokens a multiple of 128; the gather sends this
rank's blocks as they are), not where it gathers high precision (docs/block_scaling.md).

`fused_casts(False)` (a context manager) switches the fusion off, for tests and comparisons.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch

from ..fp8.autocast import AutocastState, current as current_autocast
from ..fp8.cast import transpose_fp8
from ..fp8.recipe import DelayedScaling, Float8BlockScaling
from ..fp8.scaling import ScalingState
from ..fp8.tensor import Float8Tensor
from ..ref.block_cast import BlockQuantized

_enabled = True


def fused_casts_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def fused_casts(enabled: bool):
    """Turn the fused norm/activation FP8 casts on or off inside the block (default: on)."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = before


def fusable_state(inp: torch.Tensor) -> Optional[AutocastState]:
    """The active autocast state when the fused casts apply to a module call on `inp`."""
    if not _enabled:
        return None
    state = current_autocast()
    if state is None or not state.enabled or not isinstance(state.recipe, DelayedScaling):
        return None
    if inp.numel() == 0 or torch.is_autocast_enabled(inp.device.type):
        return None
    return state


def block_fusable(inp: torch.Tensor, plan) -> bool:
    """Whether the fused activation / norm block cast applies to a GEMM with FP8 plan `plan`
    (None: no FP8) whose input comes from an activation (or a norm) of `inp`."""
    return plan is not None and plan.compute_in_fp8 and _block_ok(inp, plan.recipe)


def _block_ok(inp: torch.Tensor, recipe) -> bool:
    if not _enabled or not isinstance(recipe, Float8BlockScaling):
        return False
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(inp.device.type):
        return False
    return inp.numel() > 0


def block_input_spec(recipe: Float8BlockScaling, columnwise: bool) -> "BlockCastSpec":
    """The BlockCastSpec of a block Linear's input under `recipe` (its input QParams)."""
    q = recipe.fp8_quant_fwd_inp
    return BlockCastSpec(recipe.fp8_format.forward_dtype, bool(q.power_2_scale),
                         float(q.amax_epsilon), columnwise)


def block_norm_spec(inp: torch.Tensor, columnwise: bool) -> Optional["BlockCastSpec"]:
    """LayerNormLinear under Float8BlockScaling (the autocast state, no plan yet): the fused
    norm's BlockCastSpec, or None where the norm is not fused."""
    state = current_autocast()
    if state is None or not state.enabled or not _block_ok(inp, state.recipe):
        return None
    return block_input_spec(state.recipe, columnwise)


@dataclasses.dataclass(frozen=True)
class BlockCastSpec:
    """How a fused activation writes a block Linear's 1x128 input: fp8 dtype, the recipe's
    input QParams (power_2_scale, amax_epsilon) and whether to write the columnwise form too
    (the GEMM's wgrad needs it)."""

    fp8_dtype: torch.dtype
    power_2_scale: bool
    amax_epsilon: float
    columnwise: bool


@dataclasses.dataclass(frozen=True)
class BlockGradCastSpec:
    """How a fused activation backward writes a block Linear's 1x128 grad_output: the recipe's
    backward fp8 dtype and grad QParams, the columnwise form (wgrad), and `write_hp`: d(h) in
    high precision too (the Linear's bias gradient sums it)."""

    fp8_dtype: torch.dtype
    power_2_scale: bool
    amax_epsilon: float
    columnwise: bool
    write_hp: bool


def block_carrier(bq: BlockQuantized, shape, dtype,
                  hp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`hp` (the high-precision values, when written) or else a zero-stride tensor of `shape`
    (no memory, `_block_carrier` set), carrying the block operand `bq`."""
    if hp is None:
        hp = bq.scale_inv.new_zeros((), dtype=dtype).expand(shape)
        hp._block_carrier = True
    hp._block_operand = bq
    return hp


def block_operand(t: torch.Tensor) -> Optional[BlockQuantized]:
    """The BlockQuantized a fused activation attached to its output, or None."""
    return getattr(t, "_block_operand", None)


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """Where a fused forward kernel writes a GEMM input: the delayed-scaling `scale` slot, the
    `amax` slot (None: record nothing, e.g. a recompute under frozen scales), the fp8 dtype, and
    whether to write the transpose (the GEMM's wgrad needs it)."""

    scale: torch.Tensor
    amax: Optional[torch.Tensor]
    fp8_dtype: torch.dtype
    write_transpose: bool


@dataclasses.dataclass(frozen=True)
class GradCastSpec:
    """Where a fused backward kernel writes a GEMM's grad_output: slot `slot` of the backward
    state (read at backward time, as the unfused cast does); `write_hp`: also the
    high-precision gradient (the GEMM's bias gradient sums it)."""

    state: ScalingState
    slot: int
    write_hp: bool


def pad16(n: int) -> int:
    return -(-n // 16) * 16


def wrap_fp8(data: torch.Tensor, data_t: Optional[torch.Tensor], scale_inv: torch.Tensor,
             fp8_dtype: torch.dtype, nominal_dtype: torch.dtype, shape,
             hp: Optional[torch.Tensor] = None) -> Float8Tensor:
    """A Float8Tensor of `shape` over the padded buffers of a fused kernel."""
    tokens = math.prod(shape[:-1])
    rows = data if data.shape[0] == tokens else data[:tokens]  # no slice op where unpadded
    # view(*shape): a torch.Size argument parses slower (host time on every fused cast)
    t = Float8Tensor(rows.view(*shape), scale_inv, fp8_dtype, nominal_dtype, data_t)
    t._padded_data, t._hp = data, hp
    return t


def carrier_outputs(ctx, x_shape, dtype, data, data_t, scale_inv):
    """Under torch.compile a fused producer's Function returns its fp8 operand as plain
    tensors: (carrier, data, data_t, scale_inv). dynamo traces a Function's backward with a
    gradient made like its output, and a Float8Tensor output would get a Float8Tensor gradient
    in the trace (a plain tensor at run time). The carrier, a zero-stride high-precision tensor
    of the operand's shape (no memory), is the differentiable output: the GEMM's Function takes
    it as its input and returns the gradient for it (docs/compile.md)."""
    carrier = data.new_zeros((), dtype=dtype).expand(x_shape)
    pieces = [t for t in (data, data_t, scale_inv) if t is not None]
    ctx.mark_non_differentiable(*pieces)
    ctx.carrier = True  # backward: only the first output's gradient counts
    return carrier, data, data_t, scale_inv


def from_carrier(outputs, fp8_dtype, shape) -> Float8Tensor:
    """The Float8Tensor of `carrier_outputs`, made outside the Function, carrying its carrier."""
    carrier, data, data_t, scale_inv = outputs
    t = wrap_fp8(data, data_t, scale_inv, fp8_dtype, carrier.dtype, shape)
    t._carrier = carrier
    return t


def grad_carriers(out: torch.Tensor, rows: int, width: int, fp8_dtype: torch.dtype) -> tuple:
    """Under torch.compile a fused activation backward hands fc1 its fp8 gradient through
    three more outputs of fc1's Linear Function: zero-stride tensors (no memory) shaped like
    dy8 [Tp, N], dy8^T [N, Tp] and scale_inv [1], which the activation's Function takes as
    inputs and returns the fp8 pieces as their gradients. Gradients are plain tensors on both
    sides of the trace, which a Float8Tensor gradient is not (docs/compile.md)."""
    rows_p = pad16(rows)
    z8 = out.new_zeros((), dtype=fp8_dtype)
    return (z8.expand(rows_p, width), z8.expand(width, rows_p),
            out.new_zeros((), dtype=torch.float32).expand(1))


def fp8_operands(t: Float8Tensor, need_transpose: bool):
    """(data [Tp, K], data_t [K, Tp] or None, scale_inv) of a Float8Tensor GEMM operand,
    Tp = rows rounded up to 16 with zero rows."""
    k = t.shape[-1]
    tokens = math.prod(t.shape[:-1])
    tp = pad16(tokens)
    data = getattr(t, "_padded_data", None)
    if data is None:
        d2 = t._data.reshape(-1, k)
        data = d2 if tp == tokens else torch.cat([d2, d2.new_zeros(tp - tokens, k)])
    data_t = None
    if need_transpose:
        data_t = t.transpose_data()
        if data_t is None or tuple(data_t.shape) != (k, tp):
            data_t = transpose_fp8(data)
    return data, data_t, t._scale_inv


__all__ = ["BlockCastSpec", "BlockGradCastSpec", "block_carrier", "block_fusable",
           "block_input_spec", "block_norm_spec",
           "block_operand", "CastSpec", "GradCastSpec", "carrier_outputs", "from_carrier",
           "fused_casts", "fused_casts_enabled", "fusable_state", "fp8_operands", "grad_carriers",
           "wrap_fp8"]
