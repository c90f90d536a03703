"""Pure-PyTorch twin of `tritium.kernels.adam`: one Adam/AdamW step over a list of tensors, and
the weight read/write rules that FusedAdam and FusedSGD share. The CPU path and the test oracle.

Kernel and twin agree BIT FOR BIT: both run the same fp32 operations in the same order, each
rounded once (IEEE division and square root; the kernel is compiled without FMA contraction;
torch runs each op below as its own kernel). Every hyperparameter is read from the fp32 tensor
`hp` (layout below), so both see the same fp32 values whether they were computed on the host
(capturable=False) or on the device (capturable=True), and nothing here syncs with the host.
Tensor-by-tensor division (never by a Python number: CUDA torch turns `x / 2.0` into a multiply
by the reciprocal), and the square root through float64 (`sqrt_rn`: torch's fp32 sqrt on
AVX-512 CPUs is not correctly rounded).

The step, per element, all fp32 (w = the weight: master, or the param itself):
    g = grad
    L2 mode (adam_w_mode=False) and weight decay on:  g = g + w * wd
    m = m * b1 + g * omb1                   (omb1 = fp32(1 - b1), computed in float64 first)
    v = v * b2 + (g * g) * omb2
    denom = sqrt(v / bc2) + eps
    u = (m / bc1) / denom
    AdamW mode and weight decay on:  u = u + w * wd
    w = w - u * lr
Moments are stored in their own dtype (fp32 or bf16: one round-to-nearest-even cast).

Weights (`load_weight` / `store_weight`, also used by `tritium.ref.sgd`):
  * no master: the param (fp32, bf16 or fp16) is read, upcast, and written back rounded (RTNE);
  * master (fp32): read and written; the param is written from it: bf16/fp16 by an RTNE cast,
    FP8 (`param` is then the fp8 `_data`) as fp8(clamp(w * scale, -max, max)) (RTNE, NaN kept),
    scale_inv = 1 / scale (IEEE), and amax = max(amax, max |w|) when an amax tensor is given;
  * bf16 remainders: the master is not stored; its low 16 bits are (int16 state), and
    `split_remainder` / `join_remainder` define the exact round trip (see there).
Empty tensors are skipped (nothing written, not even scale_inv).

Scaled states (FusedAdam's fp16 / FP8 moments and fp16 masters; TE's scheme, per tensor): a
state stored in fp16 or FP8 E4M3 keeps an fp32 dequantization factor d and its value is
stored * d (one fp32 multiply). After the update the factor is recomputed from the NEW values:
    amax = max |new value| over the tensor (NaN propagates)
    d = amax / RANGE      (RANGE: fp16 max / 2 = 32752 for fp16, 448 for E4M3; IEEE division)
    q = 1 / d if d > 0 else 0
    stored = fp16(new * q)  or  e4m3(clamp(new * q, -448, 448))      (RTNE)
so each tensor uses its format's range fully whatever its magnitude (fp16 keeps a factor 2 of
headroom). `state_scales` holds, per tensor, an fp32 [3, 3] table: rows exp_avg, exp_avg_sq,
master (SCALED_ROWS), columns d, q, amax. bf16 states are plain casts (no factor), as in TE.
The kernel needs two passes for this (amax, then write); the twin computes the same values once.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..fp8.formats import FP8_MAX

# Layout of the fp32 hyperparameter tensor `hp` of an Adam step.
LR, BC1, BC2, B1, OMB1, B2, OMB2, EPS, WD = range(9)
NUM_HP = 9

Fp8Meta = tuple  # (scale [1] fp32, scale_inv [1] fp32, amax [1] fp32 or None)

# Scaled states: the [3, 3] table's rows and columns, and each scaled dtype's range.
ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_MASTER = range(3)
COL_D, COL_Q, COL_AMAX = range(3)
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0,
                torch.float8_e4m3fn: FP8_MAX[torch.float8_e4m3fn]}


def is_scaled(dtype: torch.dtype) -> bool:
    return dtype in SCALED_RANGE


def new_scale_factors(table: torch.Tensor, ranges: torch.Tensor) -> None:
    """Columns d and q of a [3, 3] table from its amax column (`ranges`: fp32 [3], each row's
    RANGE; 1 for rows that are not scaled). The kernel's launcher runs the same ops."""
    d = table[:, COL_AMAX] / ranges
    table[:, COL_Q] = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    table[:, COL_D] = d


def scaled_store(stored: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> None:
    """stored = format(x * q) (the E4M3 product clamped to +-448 first)."""
    y = x * q
    if stored.dtype == torch.float8_e4m3fn:
        y = y.clamp(-FP8_MAX[stored.dtype], FP8_MAX[stored.dtype])
    stored.copy_(y.to(stored.dtype))


def scaled_load(stored: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return stored.to(torch.float32) * d


def quantize_state(stored: torch.Tensor, table: torch.Tensor, row: int, x: torch.Tensor) -> None:
    """Store fp32 `x` into the scaled state `stored` with a factor from x's own amax (writes
    row `row` of `table`); used to create and load scaled states outside a step."""
    x = x.reshape(-1).to(torch.float32)
    one = table[row:row + 1]
    one[:, COL_AMAX] = _abs_max(x) if x.numel() else 0.0
    new_scale_factors(one, torch.full((1,), SCALED_RANGE[stored.dtype], device=table.device))
    scaled_store(stored.view(-1), x, table[row, COL_Q])


def state_ranges(m_dtype, v_dtype, master_dtype, device) -> torch.Tensor:
    return torch.tensor([SCALED_RANGE.get(dt, 1.0) for dt in (m_dtype, v_dtype, master_dtype)],
                        dtype=torch.float32, device=device)


def split_remainder(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 param as int16 bits, int16 remainder); exact inverse: join_remainder.

    With b the 32 bits of w, hi = b >> 16 and lo = b & 0xFFFF (unsigned): the param is
    hi + (lo >= 0x8000), i.e. w rounded to nearest with ties away from zero (bf16 is
    sign-magnitude, so adding one to the bit pattern moves away from zero), and the remainder
    is lo. Rounding to nearest EVEN could not be undone from 16 bits: at a tie (lo == 0x8000)
    both neighbours are even candidates. So the param differs from w.to(bfloat16) only at exact
    ties, by one unit. A NaN master gives a quiet-NaN param (hi | 0x40) instead of a round-up
    (the round-up of a NaN pattern could wrap into -0.0 or an infinity); its payload is lost
    in the round trip, every other value comes back exactly.
    """
    b = w.contiguous().view(torch.int32)
    hi = (b >> 16) & 0xFFFF
    lo = b & 0xFFFF
    param = torch.where(torch.isnan(w), hi | 0x40, hi + (lo >= 0x8000).to(torch.int32))
    return _to_int16(param), _to_int16(lo)


def join_remainder(param_bits: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 param bits as int16, int16 remainder) -> the fp32 master (see split_remainder)."""
    pb = param_bits.to(torch.int32) & 0xFFFF
    r = remainder.to(torch.int32)
    is_nan = (pb & 0x7FFF) > 0x7F80
    hi = torch.where(is_nan, pb, pb - (r < 0).to(torch.int32))
    hi = hi - (hi >= 0x8000).to(torch.int32) * 0x10000   # signed: hi * 65536 fits in int32
    return (hi * 0x10000 + (r & 0xFFFF)).view(torch.float32)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root. torch's own fp32 sqrt is not on every CPU (torch 2.13,
    AVX-512: 15% of uniform random inputs one ulp off); the float64 square root of an fp32
    value, rounded once to fp32, is (53 >= 2*24 + 2 bits: the double rounding is harmless)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _to_int16(x: torch.Tensor) -> torch.Tensor:
    """int32 values in [0, 0xFFFF] -> the int16 with the same 16 bits."""
    return (x - (x >= 0x8000).to(torch.int32) * 0x10000).to(torch.int16)


def load_weight(param: torch.Tensor, master: Optional[torch.Tensor],
                remainder: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 weight to update (a fresh tensor, never an alias of the state)."""
    if remainder is not None:
        return join_remainder(param.view(torch.int16), remainder)
    if master is not None:
        return master.clone()
    return param.to(torch.float32, copy=True)


def store_weight(param: torch.Tensor, master: Optional[torch.Tensor],
                 remainder: Optional[torch.Tensor], fp8: Optional[Fp8Meta],
                 w: torch.Tensor) -> None:
    """Write the updated fp32 weight `w` into master/remainder and the model param."""
    if remainder is not None:
        p_bits, rem = split_remainder(w)
        param.view(torch.int16).copy_(p_bits)
        remainder.copy_(rem)
        return
    if master is not None and master is not w:
        master.copy_(w)
    if fp8 is None:
        if param is not w:
            param.copy_(w)
        return
    scale, scale_inv, amax = fp8
    limit = FP8_MAX[param.dtype]
    param.copy_((w * scale).clamp(-limit, limit).to(param.dtype))
    scale_inv.copy_(torch.ones_like(scale) / scale)
    if amax is not None:
        amax.copy_(torch.maximum(amax, w.abs().amax().reshape(1)))


def _flat(*ts):
    """1-D views (0-dim params broadcast against the [1] hyperparameters otherwise)."""
    return tuple(None if t is None else t.view(-1) for t in ts)


def _opt(xs: Optional[Sequence], i: int):
    return None if xs is None else xs[i]


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
              masters: Optional[Sequence[torch.Tensor]], fp8_meta: Optional[Sequence[Fp8Meta]],
              remainders: Optional[Sequence[torch.Tensor]], hp: torch.Tensor, *,
              adam_w_mode: bool, weight_decay: bool, cache: Optional[dict] = None,
              state_scales: Optional[Sequence[torch.Tensor]] = None) -> None:
    """One Adam step over a group of tensors, in place (see the module docstring).

    params: the model's storage (fp32/bf16/fp16 params, or the fp8 `_data` of FP8 params);
    grads: same shapes, fp32/bf16/fp16; exp_avgs/exp_avg_sqs: fp32 or bf16; masters: fp32 or
    None; fp8_meta: per tensor (scale, scale_inv, amax or None), or None; remainders: int16 or
    None; hp: fp32 [NUM_HP] on the params' device; weight_decay: whether wd is applied at all
    (hp[WD] holds its value). `cache` is the kernel's table cache (unused here).
    Scaled states (fp16 / E4M3 moments, fp16 masters): `state_scales` gives each tensor's
    fp32 [3, 3] table (see the module docstring); masters may then be fp16.
    """
    if state_scales is not None:
        return _adam_step_scaled(params, grads, exp_avgs, exp_avg_sqs, masters, fp8_meta,
                                 remainders, hp, state_scales, adam_w_mode=adam_w_mode,
                                 weight_decay=weight_decay)
    lr, bc1, bc2, b1, omb1, b2, omb2, eps, wd = (hp[i:i + 1] for i in range(NUM_HP))
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        p, master, rem, m_state, v_state = _flat(p, _opt(masters, i), _opt(remainders, i),
                                                 exp_avgs[i], exp_avg_sqs[i])
        # In-place ops on fp32 state and scratch buffers: the same roundings as the formulas
        # in the docstring, without allocating a fresh tensor per op (the CPU path is memory
        # bound). An fp32 master (or fp32 param without one) is updated where it lies.
        w = weight_in_place(p, master, rem)
        g = grads[i].reshape(-1).to(torch.float32, copy=True)
        if weight_decay and not adam_w_mode:
            g += w * wd
        m = m_state if m_state.dtype == torch.float32 else m_state.float()
        v = v_state if v_state.dtype == torch.float32 else v_state.float()
        m.mul_(b1).add_(g * omb1)
        g.mul_(g).mul_(omb2)
        v.mul_(b2).add_(g)
        denom = sqrt_rn(torch.div(v, bc2, out=g)).add_(eps)   # g is free from here on
        u = (m / bc1).div_(denom)
        if weight_decay and adam_w_mode:
            u += w * wd
        w.sub_(u.mul_(lr))
        if m is not m_state:
            m_state.copy_(m)
        if v is not v_state:
            v_state.copy_(v)
        store_weight(p, master, rem, _opt(fp8_meta, i), w)


def _adam_step_scaled(params, grads, exp_avgs, exp_avg_sqs, masters, fp8_meta, remainders, hp,
                      state_scales, *, adam_w_mode: bool, weight_decay: bool) -> None:
    """adam_step with scaled states: the same fp32 math, written out op by op."""
    lr, bc1, bc2, b1, omb1, b2, omb2, eps, wd = (hp[i:i + 1] for i in range(NUM_HP))
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        table = state_scales[i]
        p, master, rem, m_state, v_state = _flat(p, _opt(masters, i), _opt(remainders, i),
                                                 exp_avgs[i], exp_avg_sqs[i])
        rows = [(m_state, ROW_EXP_AVG), (v_state, ROW_EXP_AVG_SQ)]
        w_scaled = master is not None and is_scaled(master.dtype)
        if w_scaled:
            rows.append((master, ROW_MASTER))

        def load(t, row):
            return (scaled_load(t, table[row, COL_D]) if is_scaled(t.dtype)
                    else t.to(torch.float32, copy=True))
        w = load(master, ROW_MASTER) if w_scaled else load_weight(p, master, rem)
        g = grads[i].reshape(-1).to(torch.float32)
        if weight_decay and not adam_w_mode:
            g = g + w * wd
        m = load(m_state, ROW_EXP_AVG) * b1 + g * omb1
        v = load(v_state, ROW_EXP_AVG_SQ) * b2 + (g * g) * omb2
        denom = sqrt_rn(v / bc2) + eps
        u = (m / bc1) / denom
        if weight_decay and adam_w_mode:
            u = u + w * wd
        w = w - u * lr
        new = {ROW_EXP_AVG: m, ROW_EXP_AVG_SQ: v, ROW_MASTER: w}
        ranges = state_ranges(m_state.dtype, v_state.dtype,
                              master.dtype if master is not None else torch.float32, p.device)
        table[:, COL_AMAX] = 0.0
        for t, row in rows:
            if is_scaled(t.dtype):
                table[row, COL_AMAX] = _abs_max(new[row])
        new_scale_factors(table, ranges)
        for t, row in rows:
            if is_scaled(t.dtype):
                scaled_store(t, new[row], table[row, COL_Q])
            else:
                t.copy_(new[row])
        store_weight(p, None if w_scaled else master, rem, _opt(fp8_meta, i), w)


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x|, NaN if any element is NaN (as the kernel's reduction)."""
    a = x.abs()
    return torch.where(torch.isnan(a).any(), torch.full_like(a[0], float("nan")), a.amax())


def weight_in_place(p, master, rem) -> torch.Tensor:
    """The fp32 weight to update: the master or fp32 param itself, else a fresh copy."""
    if rem is None and master is not None:
        return master
    if rem is None and p.dtype == torch.float32:
        return p
    return load_weight(p, master, rem)


__all__ = ["NUM_HP", "adam_step", "quantize_state", "scaled_load", "scaled_store", "is_scaled",
           "SCALED_RANGE", "new_scale_factors", "state_ranges", "sqrt_rn", "load_weight",
           "weight_in_place", "store_weight", "split_remainder", "join_remainder"]
