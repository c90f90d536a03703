"""Triton delayed-scaling update: one program per slot, one launch per scaling state or one for
many states.

Twin: `tritium.ref.scaling.delayed_scaling_update` (the rules are written there). Each program
loads its whole history column into registers (L <= MAX_HISTORY), computes amax and the new
scale, then, after a barrier (every thread must have read the column before any writes it),
writes the column rolled up by one with row 0 zeroed. Columns whose row 0 is 0 are left alone.
`prepared_update_many` updates the states of every module of an fp8_autocast region in one
launch (grid: states x slots): an int64 table [S, 3] of (history address, scale address, slot
count) per state, uploaded once; twin `tritium.ref.scaling.delayed_scaling_update_many`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2

MAX_HISTORY = 16384


@triton.jit
def _update_column(hist_ptr, scale_ptr, j, L, n, FP8_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr,
                   MOST_RECENT: tl.constexpr, BLOCK_L: tl.constexpr):
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


@triton.jit
def _delayed_update_kernel(hist_ptr, scale_ptr, L, n, FP8_MAX: tl.constexpr,
                           MARGIN_DIV: tl.constexpr, MOST_RECENT: tl.constexpr,
                           BLOCK_L: tl.constexpr):
    _update_column(hist_ptr, scale_ptr, tl.program_id(0), L, n, FP8_MAX, MARGIN_DIV, MOST_RECENT,
                   BLOCK_L)


@triton.jit
def _delayed_update_many_kernel(table_ptr, L, FP8_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr,
                                MOST_RECENT: tl.constexpr, BLOCK_L: tl.constexpr):
    row = table_ptr + tl.program_id(0) * 3
    n = tl.load(row + 2).to(tl.int32)
    j = tl.program_id(1)
    if j < n:  # the grid's second dim is the largest slot count
        _update_column(tl.load(row).to(tl.pointer_type(tl.float32)),
                       tl.load(row + 1).to(tl.pointer_type(tl.float32)), j, L, n, FP8_MAX,
                       MARGIN_DIV, MOST_RECENT, BLOCK_L)


_launch_update = Launcher(_delayed_update_kernel)
_launch_update_many = Launcher(_delayed_update_many_kernel)


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


def prepared_update_many(hists: list, scales: list, fp8_max: float, margin: int, algo: str):
    """`delayed_scaling_update_many` of these states (each history [L, n_i] contiguous, the same
    L, each scale [n_i], all on one device) as a call with no arguments: the address table is
    uploaded now, so the tensors must stay where they are (the caller keeps them)."""
    length = hists[0].shape[0]
    if length > MAX_HISTORY:
        raise ValueError(f"amax history of {length} rows exceeds the kernel's {MAX_HISTORY}")
    rows = []
    for h, s in zip(hists, scales):
        if h.shape != (length, s.numel()) or not h.is_contiguous() or not s.is_contiguous():
            raise ValueError("prepared_update_many: every history must be a contiguous [L, n] "
                             f"with one L ({length}) and its scale [n]; got {tuple(h.shape)} "
                             f"and {tuple(s.shape)}")
        rows += [h.data_ptr(), s.data_ptr(), s.numel()]
    host = torch.tensor(rows, dtype=torch.int64)
    device = scales[0].device
    pinned = None
    if device.type == "cuda":
        pinned = host.pin_memory()
        table = pinned.to(device, non_blocking=True)
    else:
        table = host
    launch = _launch_update_many.fixed(
        (len(hists), max(s.numel() for s in scales)), table, length, FP8_MAX=float(fp8_max),
        MARGIN_DIV=float(2.0 ** margin), MOST_RECENT=algo == "most_recent",
        BLOCK_L=next_pow2(length), num_warps=4)
    launch.keep = (table, pinned)  # the table (and its pinned source, until the copy is done)
    return launch


def delayed_scaling_update_many(hists: list, scales: list, fp8_max: float, margin: int,
                                algo: str) -> None:
    prepared_update_many(hists, scales, fp8_max, margin, algo)()
