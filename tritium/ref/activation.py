"""Pure-PyTorch twins of `tritium.kernels.activation`: the CPU path and the test oracle.

TE's activations, forward and backward, on 2D tensors: x is [rows, F] for a plain kind and
[rows, 2F] for a gated kind, dy is [rows, F]. A gated kind splits the last dim in two halves:
the FIRST half `a` goes through the activation, the SECOND half `b` multiplies,
y = act(a) * b (DESIGN.md section 5; the opposite of torch.nn.functional.glu), and its input
gradient is [d_a, d_b] concatenated along the last dim.

Numerics. Everything is computed in fp32 and rounded once, at the end, to x.dtype (fp32, bf16
or fp16). The formulas are written step by step exactly as the Triton kernel writes them, so
kernel and twin differ only where the two evaluate a primitive differently (exp in the last
bit or two; on the GPU also the fast fp32 division and fused multiply-adds), i.e. at fp32
rounding level:

  sigmoid(z) = s = 1 / (1 + e) with e = exp(-z)      (not torch.sigmoid: its own formula)
  1 - s = e * s where z >= 0, else 1 - s         (1 - s loses up to all its digits where s is
      near 1; torch's own silu/gelu backward do that, off by ~1e-5 in geglu's dx)
  x * sigmoid(z(x)) family:  silu z = x, qgelu z = 1.702 x,
      gelu (tanh approximation) z = 2u with u = sqrt(2/pi) (x + 0.044715 x^3), because
      0.5 x (1 + tanh(u)) == x sigmoid(2u); this form has no cancellation in 1 + tanh(u) for
      negative x, and 1 - tanh(u)^2 == 4 s (1 - s) gives the derivative without one either.
      z = x * (K2 + K2C * x^2), dz/dx = K2 + K2C3 * x^2 with K2 = 2 sqrt(2/pi), K2C = K2 * 0.044715,
      K2C3 = 3 * K2C, each rounded to fp32 once.
      d/dx [x s] = s * (1 + x * (1 - s) * dz/dx)  (evaluated as s * (1 + (x * (1 - s)) * dz/dx))
  relu(x) = x where x >= 0 (and NaN), else 0; d/dx = 1 where x > 0 else 0
  srelu(x) = relu(x) * relu(x); d/dx = 2 relu(x)
  glu's activation is sigmoid(a) itself; d/da = s * (1 - s)
  backward: plain dx = dy * act'(x); gated d_a = (dy * b) * act'(a), d_b = dy * act(a)
Special values follow torch's fp32 formulas: NaN propagates, act(-inf) of the sigmoid family is
NaN (-inf * 0), and gelu's derivative is NaN for |x| > ~1e19 (x^2 overflows), as torch's is.

Activation + FP8 cast (twins of `tritium.kernels.act_cast`): `activation_fwd_fp8` is
`activation_fwd` followed by `tritium.ref.cast.cast_transpose` of its (x.dtype-rounded) output
with fc2's input scale; `activation_bwd_fp8` is `activation_bwd` followed by the cast of its
(x.dtype-rounded) dx with fc1's grad scale, data and transpose. Both max-accumulate the amax of
the rounded values into `amax` (unless None), write scale_inv = 1/scale exactly and zero-pad the
rows to a multiple of 16: the unfused path, by construction.

Activation + Float8BlockScaling 1x128 casts (twin of `tritium.kernels.act_block_cast`):
`activation_fwd_blocks` is `activation_fwd`, zero rows to a multiple of 16 (as the block Linear
pads its input), then `tritium.ref.block_cast.quantize_blocks` rowwise (and columnwise);
`activation_bwd_blocks` is `activation_bwd`, the same padding, then `quantize_blocks` of d(x)
(fc1's grad_output blocks), returning d(x) too when asked (fc1's bias gradient).

Not done here: double backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from .block_cast import BlockQuantized, quantize_blocks
from .cast import cast_transpose

ACTIVATIONS = ("gelu", "qgelu", "relu", "srelu", "silu",
               "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "glu")
GATED = frozenset({"geglu", "qgeglu", "reglu", "sreglu", "swiglu", "glu"})

# kind -> the activation applied to x (plain) or to the first half a (gated)
BASE = {"gelu": "gelu", "qgelu": "qgelu", "relu": "relu", "srelu": "srelu", "silu": "silu",
        "geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
        "swiglu": "silu", "glu": "sigmoid"}


def _f32(v: float) -> float:
    """v rounded to fp32 (what a constant becomes inside an fp32 kernel)."""
    return torch.tensor(v, dtype=torch.float32).item()


_K2 = _f32(2.0 * (2.0 / torch.pi) ** 0.5)
_K2C = _f32(2.0 * (2.0 / torch.pi) ** 0.5 * 0.044715)
_K2C3 = _f32(3.0 * 2.0 * (2.0 / torch.pi) ** 0.5 * 0.044715)
_QGELU = _f32(1.702)


def _sigmoid(z: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def _sigmoid2(z: torch.Tensor):
    """(s, 1 - s) = (sigmoid(z), sigmoid(-z)); 1 - s as e * s where z >= 0 (no cancellation;
    e <= 1 there, while for z < 0 e can be inf and 1 - s is exact enough)."""
    e = torch.exp(-z)
    s = 1.0 / (1.0 + e)
    return s, torch.where(z >= 0, e * s, 1.0 - s)


def _gate(x: torch.Tensor, base: str):
    """(z, dz/dx) of the x * sigmoid(z) family, fp32."""
    if base == "silu":
        return x, None
    if base == "qgelu":
        return _QGELU * x, _QGELU
    x2 = x * x
    return x * (_K2 + _K2C * x2), _K2 + _K2C3 * x2


def _act(x: torch.Tensor, base: str) -> torch.Tensor:
    if base == "relu":
        return torch.where(x < 0, torch.zeros_like(x), x)
    if base == "srelu":
        r = torch.where(x < 0, torch.zeros_like(x), x)
        return r * r
    if base == "sigmoid":
        return _sigmoid(x)
    z, _ = _gate(x, base)
    return x * _sigmoid(z)


def _act_and_grad(x: torch.Tensor, base: str):
    """(act(x), act'(x)) in fp32."""
    if base in ("relu", "srelu"):
        r = torch.where(x < 0, torch.zeros_like(x), x)
        if base == "relu":
            return r, (x > 0).to(torch.float32)
        return r * r, 2.0 * r
    if base == "sigmoid":
        s, sm = _sigmoid2(x)
        return s, s * sm
    z, dz = _gate(x, base)
    s, sm = _sigmoid2(z)
    t = x * sm
    if dz is not None:
        t = t * dz
    return x * s, s * (1.0 + t)


def _check(x: torch.Tensor, kind: str) -> None:
    if kind not in BASE:
        raise ValueError(f"unknown activation {kind!r}; valid: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2:
        raise ValueError(f"activation kernels take 2D tensors, got shape {tuple(x.shape)}")
    if kind in GATED and x.shape[1] % 2:
        raise ValueError(f"{kind} needs an even last dim (two halves), got {x.shape[1]}")


def activation_fwd(x: torch.Tensor, kind: str) -> torch.Tensor:
    """y [rows, F] = act(x) (plain, x [rows, F]) or act(a) * b (gated, x = [a, b] [rows, 2F])."""
    _check(x, kind)
    base = BASE[kind]
    xf = x.float()
    if kind in GATED:
        a, b = xf.chunk(2, dim=-1)
        y = _act(a, base) * b
    else:
        y = _act(xf, base)
    return y.to(x.dtype)


def activation_bwd(dy: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """dx, shaped and typed like x: dy * act'(x), or [(dy * b) * act'(a), dy * act(a)]."""
    _check(x, kind)
    rows, f = x.shape[0], x.shape[1] // 2 if kind in GATED else x.shape[1]
    if tuple(dy.shape) != (rows, f):
        raise ValueError(f"dy must be [{rows}, {f}] for {kind} of x {tuple(x.shape)}, "
                         f"got {tuple(dy.shape)}")
    base = BASE[kind]
    xf, dyf = x.float(), dy.float()
    if kind in GATED:
        a, b = xf.chunk(2, dim=-1)
        act, dact = _act_and_grad(a, base)
        dx = torch.cat([(dyf * b) * dact, dyf * act], dim=-1)
    else:
        _, dact = _act_and_grad(xf, base)
        dx = dyf * dact
    return dx.to(x.dtype)


def activation_fwd_fp8(x: torch.Tensor, kind: str, scale: torch.Tensor,
                       amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                       write_data: bool = True, write_transpose: bool = False,
                       pad_rows_to: int = 16):
    """fp8 of activation_fwd(x, kind) -> (data [Rp, F] or None, data_t [F, Rp] or None,
    scale_inv [1])."""
    return cast_transpose(activation_fwd(x, kind), scale, amax, fp8_dtype,
                          pad_rows_to=pad_rows_to, write_data=write_data,
                          write_transpose=write_transpose)


def activation_fwd_blocks(x: torch.Tensor, kind: str, fp8_dtype: torch.dtype, *,
                          columnwise: bool = True, power_2_scale: bool = True,
                          amax_epsilon: float = 0.0, pad_rows_to: int = 16) -> BlockQuantized:
    """1x128 block fp8 of activation_fwd(x, kind), rows zero-padded to Rp -> BlockQuantized:
    data [Rp, F], scale_inv [ceil(F/128), Rp] and (columnwise) data_t [F, Rp], scale_inv_t
    [ceil(Rp/128), F]."""
    y = activation_fwd(x, kind)
    rows = y.shape[0]
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    if rows_p != rows:
        y = torch.cat([y, y.new_zeros(rows_p - rows, y.shape[1])])
    return quantize_blocks(y, fp8_dtype, rowwise=True, columnwise=columnwise,
                           power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)


def activation_bwd_blocks(dy: torch.Tensor, x: torch.Tensor, kind: str, fp8_dtype: torch.dtype,
                          *, columnwise: bool = True, write_hp: bool = False,
                          power_2_scale: bool = True, amax_epsilon: float = 0.0,
                          pad_rows_to: int = 16):
    """1x128 block fp8 of activation_bwd(dy, x, kind) (rows zero-padded to Rp) ->
    (dx [rows, W] or None, BlockQuantized: data [Rp, W], scale_inv [ceil(W/128), Rp] and
    (columnwise) data_t [W, Rp], scale_inv_t [ceil(Rp/128), W]); W = x.shape[1]."""
    dx = activation_bwd(dy, x, kind)
    rows, w = dx.shape
    rows_p = -(-rows // pad_rows_to) * pad_rows_to
    dxp = torch.cat([dx, dx.new_zeros(rows_p - rows, w)]) if rows_p != rows else dx
    bq = quantize_blocks(dxp, fp8_dtype, rowwise=True, columnwise=columnwise,
                         power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    return (dx if write_hp else None), bq


def activation_bwd_fp8(dy: torch.Tensor, x: torch.Tensor, kind: str, scale: torch.Tensor,
                       amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                       write_data: bool = True, write_transpose: bool = True,
                       write_hp: bool = False, pad_rows_to: int = 16):
    """fp8 of activation_bwd(dy, x, kind) -> (dx or None, data [Rp, W] or None,
    data_t [W, Rp] or None, scale_inv [1]); W = x.shape[1]."""
    dx = activation_bwd(dy, x, kind)
    data, data_t, scale_inv = cast_transpose(dx, scale, amax, fp8_dtype, pad_rows_to=pad_rows_to,
                                             write_data=write_data,
                                             write_transpose=write_transpose)
    return (dx if write_hp else None), data, data_t, scale_inv


__all__ = ["ACTIVATIONS", "GATED", "activation_fwd", "activation_bwd", "activation_fwd_fp8",
           "activation_bwd_fp8", "activation_fwd_blocks", "activation_bwd_blocks"]
