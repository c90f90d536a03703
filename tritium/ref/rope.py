"""Pure-PyTorch twins of `tritium.kernels.rope`: the CPU path and the test oracle.

Rotary position embedding on a 4D view x [N1, N2, H, D] (sbhd: N1 = s, N2 = b; bshd: N1 = b,
N2 = s; thd: [t, 1, h, d]), any strides. Token (n1, n2) sits at table row pos[n1, n2] (int32,
any strides, stride 0 for broadcasting); the functional layer builds pos (formats, packed
sequences, context-parallel chunks, start offsets) and the tables cos = torch.cos(freqs),
sin = torch.sin(freqs) (fp32 [P, R], R = rot_dim even, R <= D). Kernel and twin take the same
tables, so neither evaluates a transcendental and they agree bit for bit.

Math, fp32, one rounding to x.dtype at the end; the first R features rotate, the rest pass
through bit for bit (-0.0 and NaN payloads included):
  forward   y = x * cos + rot(x) * sin
  backward  dx = dy * cos + rot_t(dy * sin)        (the transpose of the forward)
with the partner p(d) of feature d and its sign s(d):
  non-interleaved (GPT-NeoX / Llama halves)  p(d) = d +- R/2, s = -1 on the first half
      rot(x) = (-x2, x1), rot_t(u) = (u2, -u1)
  interleaved (GPT-J pairs)                  p(d) = d ^ 1,    s = -1 on even d
      rot(x)[2i, 2i+1] = (-x[2i+1], x[2i]), rot_t(u)[2i, 2i+1] = (u[2i+1], -u[2i])
rot(x)[d] = s(d) x[p(d)] and rot_t(u)[d] = -s(d) u[p(d)]: sign flips are exact, so every value
is two rounded products and one rounded sum, in this order, in both implementations. For TE's
own tables (each frequency twice) sin[p(d)] == sin[d] and the backward is the forward rotation
with -sin; for arbitrary tables it stays the exact transpose.

Outputs are fresh contiguous tensors shaped like x. Not done here: in-place application, a
gradient for freqs (TE returns none either), double backward.
"""
from __future__ import annotations

import torch


def _rot(u: torch.Tensor, interleaved: bool, transpose: bool) -> torch.Tensor:
    """rot(u) (transpose=False) or rot_t(u) along the last dim (even length)."""
    if interleaved:
        a, b = u[..., 0::2], u[..., 1::2]
        pair = (b, -a) if transpose else (-b, a)
        return torch.stack(pair, dim=-1).flatten(-2)
    a, b = u.chunk(2, dim=-1)
    return torch.cat((b, -a) if transpose else (-b, a), dim=-1)


def _tables(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor):
    """cos, sin rows of every token, shaped [N1, N2, 1, R] to broadcast over heads."""
    idx = pos.long()
    return cos[idx].unsqueeze(2), sin[idx].unsqueeze(2)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> int:
    if x.dim() != 4:
        raise ValueError(f"rope kernels take a 4D view [N1, N2, H, D], got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32:
        raise ValueError("cos and sin must be fp32 tables of one shape [P, rot_dim], got "
                         f"{cos.dtype}{tuple(cos.shape)} and {sin.dtype}{tuple(sin.shape)}")
    rot = cos.shape[1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rot_dim {rot} must be even and <= head dim {x.shape[-1]}")
    if tuple(pos.shape) != tuple(x.shape[:2]):
        raise ValueError(f"pos must be {tuple(x.shape[:2])}, got {tuple(pos.shape)}")
    return rot


def _apply(x, cos, sin, pos, interleaved, transpose):
    rot = _check(x, cos, sin, pos)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    c, s = _tables(cos, sin, pos)
    xr = x[..., :rot].float()
    if transpose:
        y = xr * c + _rot(xr * s, interleaved, transpose=True)
    else:
        y = xr * c + _rot(xr, interleaved, transpose=False) * s
    out[..., :rot] = y
    out[..., rot:] = x[..., rot:]
    return out


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """y = x * cos + rot(x) * sin on the first rot_dim features of x [N1, N2, H, D]; the rest
    copied. cos/sin: fp32 [P, rot_dim]; pos: int [N1, N2] rows of the tables."""
    return _apply(x, cos, sin, pos, interleaved, transpose=False)


def rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """dx = dy * cos + rot_t(dy * sin) (the transpose of rope_fwd), same layout rules."""
    return _apply(dy, cos, sin, pos, interleaved, transpose=True)


__all__ = ["rope_fwd", "rope_bwd"]
