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
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..fp8.formats import FP8_MAX

# Layout of the fp32 hyperparameter tensor `hp` of an Adam step.
LR, BC1, BC2, B1, OMB1, B2, OMB2, EPS, WD = range(9)
NUM_HP = 9

Fp8Meta = tuple  # (scale [1] fp32, scale_inv [1] fp32, amax [1] fp32 or None)


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
              adam_w_mode: bool, weight_decay: bool, cache: Optional[dict] = None) -> None:
    """One Adam step over a group of tensors, in place (see the module docstring).

    params: the model's storage (fp32/bf16/fp16 params, or the fp8 `_data` of FP8 params);
    grads: same shapes, fp32/bf16/fp16; exp_avgs/exp_avg_sqs: fp32 or bf16; masters: fp32 or
    None; fp8_meta: per tensor (scale, scale_inv, amax or None), or None; remainders: int16 or
    None; hp: fp32 [NUM_HP] on the params' device; weight_decay: whether wd is applied at all
    (hp[WD] holds its value). `cache` is the kernel's table cache (unused here).
    """
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


def weight_in_place(p, master, rem) -> torch.Tensor:
    """The fp32 weight to update: the master or fp32 param itself, else a fresh copy."""
    if rem is None and master is not None:
        return master
    if rem is None and p.dtype == torch.float32:
        return p
    return load_weight(p, master, rem)


__all__ = ["NUM_HP", "adam_step", "sqrt_rn", "load_weight", "weight_in_place", "store_weight",
           "split_remainder", "join_remainder"]
