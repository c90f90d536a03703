"""Triton delayed-scaling update: one launch per scaling state, one program per slot.

Twin: `tritium.ref.scaling.delayed_scaling_update` (the rules are written there). Each program
loads its whole history column into registers (L <= MAX_HISTORY), computes amax and the new
scale, then, after a barrier (every thread must have read the column before any writes it),
writes the column rolled up by one with row 0 zeroed. Columns whose row 0 is 0 are left alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2

MAX_HISTORY = 16384


@triton.jit
def _delayed_update_kernel(hist_ptr, scale_ptr, L, n, FP8_MAX: tl.constexpr,
                           MARGIN_DIV: tl.constexpr, MOST_RECENT: tl.constexpr,
                           BLOCK_L: tl.constexpr):
    j = tl.program_id(0)
    rows = tl.arange(0, BLOCK_L)
    mask = rows < L
    a0 = tl.load(hist_ptr + j)
    if MOST_RECENT:
        amax = a0
    else:
        h = tl.load(hist_ptr + rows * n + j, mask=mask, other=0.0)
        has_nan = tl.max((h != h).to(tl.int32)) > 0
        amax = tl.where(has_nan, float("nan"), tl.max(h))
    old = tl.load(scale_ptr + j)
    s = tl.math.div_rn(tl.math.div_rn(FP8_MAX + 0.0 * amax, amax), MARGIN_DIV + 0.0 * amax)
    ok = (amax > 0) & (amax < float("inf"))
    s = tl.where(ok, s, old)
    s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
    rolled = tl.load(hist_ptr + ((rows + 1) % L) * n + j, mask=mask, other=0.0)
    rolled = tl.where(rows == 0, 0.0, rolled)
    tl.debug_barrier()
    active = a0 != 0
    tl.store(hist_ptr + rows * n + j, rolled, mask=mask & active)
    tl.store(scale_ptr + j, tl.where(active, s, old))


_launch_update = Launcher(_delayed_update_kernel)


def prepared_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                    margin: int, algo: str):
    """`delayed_scaling_update` of these tensors as a call with no arguments, everything but
    the launch itself worked out now (a scaling state updates twice a step)."""
    length, slots = amax_history.shape
    if length > MAX_HISTORY:  # one program holds a whole column in registers
        raise ValueError(f"amax history of {length} rows exceeds the kernel's {MAX_HISTORY}")
    return _launch_update.fixed(
        (slots,), amax_history, scale, length, slots, FP8_MAX=float(fp8_max),
        MARGIN_DIV=float(2.0 ** margin), MOST_RECENT=algo == "most_recent",
        BLOCK_L=next_pow2(length), num_warps=4)


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                           margin: int, algo: str) -> None:
    prepared_update(amax_history, scale, fp8_max, margin, algo)()
