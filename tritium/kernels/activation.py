"""Triton activation kernels, forward and backward: TE's plain and gated activations.

Twins: `tritium.ref.activation` (same names and signatures; the formulas, their order of
operations and the fp32 constants are written down there and followed here step by step, so the
two differ only at fp32 rounding level: exp in the last bit or two, and on the GPU the fast fp32
division and fused multiply-adds). Math in fp32, one rounding to x.dtype at the end.

Layout. x is [rows, F] (plain) or [rows, 2F] (gated: a = x[:, :F] through the activation,
b = x[:, F:] multiplies), its last dim contiguous, rows `stride_x` apart; dy likewise; outputs are
fresh contiguous tensors. One 1D grid over (row block, column block) tiles, the pair recovered by
a division (no 65535 limit on either axis). Each element is read once and written once: memory
bound, so a tile is a few thousand elements and column blocks are powers of two >= 16, which with
a row stride and F divisible by 16 (Triton specializes on that) gives 16-byte loads and stores.
A plain kind on contiguous tensors runs on the flat [1, numel] view instead, so any F (odd too)
gets full vectors; a gated kind with an odd F cannot have them (b starts mid-vector) and still
runs correctly with narrower accesses.

The fp8-writing variants (fc2's input in forward, fc1's output grad in backward) live in
`tritium.kernels.act_cast` and share `_fwd_values` / `_bwd_values` with these kernels, so they
compute the same bits. Not done here: double backward.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2

ACTIVATIONS = ("gelu", "qgelu", "relu", "srelu", "silu",
               "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "glu")
GATED = frozenset({"geglu", "qgeglu", "reglu", "sreglu", "swiglu", "glu"})

# the activation of x (plain) or of the first half a (gated), as a constexpr code
_GELU, _QGELU, _RELU, _SRELU, _SILU, _SIGMOID = (tl.constexpr(i) for i in range(6))
_CODE = {"gelu": 0, "qgelu": 1, "relu": 2, "srelu": 3, "silu": 4,
         "geglu": 0, "qgeglu": 1, "reglu": 2, "sreglu": 3, "swiglu": 4, "glu": 5}


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


# fp32-rounded constants, the same values as the twin's (see its design note)
_K2 = tl.constexpr(_f32(2.0 * (2.0 / torch.pi) ** 0.5))
_K2C = tl.constexpr(_f32(2.0 * (2.0 / torch.pi) ** 0.5 * 0.044715))
_K2C3 = tl.constexpr(_f32(3.0 * 2.0 * (2.0 / torch.pi) ** 0.5 * 0.044715))
_QG = tl.constexpr(_f32(1.702))


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _sigmoid2(z):
    """(s, 1 - s), 1 - s as e * s where z >= 0 (no cancellation where s is near 1)."""
    e = tl.exp(-z)
    s = 1.0 / (1.0 + e)
    return s, tl.where(z >= 0, e * s, 1.0 - s)


@triton.jit
def _gate(x, ACT: tl.constexpr):
    """z of the x * sigmoid(z) family (gelu, qgelu, silu)."""
    if ACT == _GELU:
        z = x * (_K2 + _K2C * (x * x))
    elif ACT == _QGELU:
        z = _QG * x
    else:
        z = x
    return z


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == _RELU:
        y = tl.where(x < 0, 0.0, x)
    elif ACT == _SRELU:
        r = tl.where(x < 0, 0.0, x)
        y = r * r
    elif ACT == _SIGMOID:
        y = _sigmoid(x)
    else:
        y = x * _sigmoid(_gate(x, ACT))
    return y


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x)), fp32."""
    if ACT == _RELU:
        y = tl.where(x < 0, 0.0, x)
        d = tl.where(x > 0, 1.0, 0.0)
    elif ACT == _SRELU:
        r = tl.where(x < 0, 0.0, x)
        y = r * r
        d = 2.0 * r
    elif ACT == _SIGMOID:
        y, sm = _sigmoid2(x)
        d = y * sm
    else:
        s, sm = _sigmoid2(_gate(x, ACT))
        t = x * sm
        if ACT == _GELU:
            t = t * (_K2 + _K2C3 * (x * x))
        elif ACT == _QGELU:
            t = t * _QG
        y = x * s
        d = s * (1.0 + t)
    return y, d


@triton.jit
def _tile_offsets(R, F, n_col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    pid_r = pid // n_col_blocks
    pid_c = pid - pid_r * n_col_blocks
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    return rows, cols, mask


@triton.jit
def _fwd_values(x_ptr, x_offs, F, mask, ACT: tl.constexpr, GATED: tl.constexpr):
    """act(a) (* b): the fp32 forward values of one tile (shared with kernels.act_cast)."""
    a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    y = _act(a, ACT)
    if GATED:
        b = tl.load(x_ptr + x_offs + F, mask=mask, other=0.0).to(tl.float32)
        y = y * b
    return y


@triton.jit
def _bwd_values(dy, x_ptr, x_offs, F, mask, ACT: tl.constexpr, GATED: tl.constexpr):
    """(d_a, d_b) of a gated tile, (dx, dx) of a plain one, fp32 (shared with kernels.act_cast)."""
    a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, ACT)
    if GATED:
        b = tl.load(x_ptr + x_offs + F, mask=mask, other=0.0).to(tl.float32)
        da = (dy * b) * dact
        db = dy * act
    else:
        da = dy * dact
        db = da
    return da, db


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, R, F, stride_x, n_col_blocks,
                ACT: tl.constexpr, GATED: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, mask = _tile_offsets(R, F, n_col_blocks, BLOCK_R, BLOCK_C)
    x_offs = rows[:, None] * stride_x + cols[None, :]
    y = _fwd_values(x_ptr, x_offs, F, mask, ACT, GATED)
    tl.store(y_ptr + rows[:, None] * F + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, dx_ptr, R, F, stride_dy, stride_x, n_col_blocks,
                ACT: tl.constexpr, GATED: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, mask = _tile_offsets(R, F, n_col_blocks, BLOCK_R, BLOCK_C)
    x_offs = rows[:, None] * stride_x + cols[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    da, db = _bwd_values(dy, x_ptr, x_offs, F, mask, ACT, GATED)
    out_ty = dx_ptr.dtype.element_ty
    if GATED:
        dx_offs = rows[:, None] * (2 * F) + cols[None, :]
        tl.store(dx_ptr + dx_offs, da.to(out_ty), mask=mask)
        tl.store(dx_ptr + dx_offs + F, db.to(out_ty), mask=mask)
    else:
        tl.store(dx_ptr + rows[:, None] * F + cols[None, :], da.to(out_ty), mask=mask)


_launch_fwd = Launcher(_fwd_kernel)
_launch_bwd = Launcher(_bwd_kernel)

_INT32_LIMIT = 2**31


def _tile(rows: int, cols: int, interpret: bool, elems: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): `elems` elements per tile on the GPU; tiny tiles in the
    interpreter (so that tests at tiny shapes cross row and column block edges)."""
    if interpret:
        return 2, min(next_pow2(cols), 32), 1
    bc = min(max(next_pow2(cols), 16), elems)
    br = min(max(elems // bc, 1), next_pow2(rows))
    return br, bc, 8 if br * bc >= 4096 else 4


def _check(x: torch.Tensor, kind: str) -> None:
    if kind not in _CODE:
        raise ValueError(f"unknown activation {kind!r}; valid: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2:
        raise ValueError(f"activation kernels take 2D tensors, got shape {tuple(x.shape)}")
    if kind in GATED and x.shape[1] % 2:
        raise ValueError(f"{kind} needs an even last dim (two halves), got {x.shape[1]}")


def _check_bwd(dy: torch.Tensor, x: torch.Tensor, kind: str) -> tuple:
    """`_check` of x, then dy's shape [rows, f] (f: half of x's width for a gated kind);
    returns (gated, rows, w, f)."""
    _check(x, kind)
    gated = kind in GATED
    rows, w = x.shape
    f = w // 2 if gated else w
    if tuple(dy.shape) != (rows, f):
        raise ValueError(f"dy must be [{rows}, {f}] for {kind} of x {tuple(x.shape)}, "
                         f"got {tuple(dy.shape)}")
    return gated, rows, w, f


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _flat(*ts: torch.Tensor) -> bool:
    """Plain kinds on contiguous tensors run on the [1, numel] view (full vectors for any F)."""
    return all(t.is_contiguous() for t in ts) and ts[0].numel() < _INT32_LIMIT


def activation_fwd(x: torch.Tensor, kind: str) -> torch.Tensor:
    """See `tritium.ref.activation.activation_fwd`."""
    _check(x, kind)
    gated = kind in GATED
    rows, f = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    y = torch.empty(rows, f, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x = _rows_view(x)
    r, c, stride = rows, f, x.stride(0)
    if not gated and _flat(x):
        r, c, stride = 1, x.numel(), x.numel()
    br, bc, warps = _tile(r, c, not x.is_cuda, 2048)
    ncb = -(-c // bc)
    _launch_fwd((-(-r // br) * ncb,), x, y, r, c, stride, ncb,
                ACT=_CODE[kind], GATED=gated, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return y


def activation_bwd(dy: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """See `tritium.ref.activation.activation_bwd`."""
    gated, rows, _, f = _check_bwd(dy, x, kind)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    x, dy = _rows_view(x), _rows_view(dy)
    r, c, sx, sdy = rows, f, x.stride(0), dy.stride(0)
    if not gated and _flat(x, dy):
        r, c, sx, sdy = 1, x.numel(), x.numel(), x.numel()
    br, bc, warps = _tile(r, c, not x.is_cuda, 1024 if gated else 2048)
    ncb = -(-c // bc)
    _launch_bwd((-(-r // br) * ncb,), dy, x, dx, r, c, sdy, sx, ncb,
                ACT=_CODE[kind], GATED=gated, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return dx


__all__ = ["ACTIVATIONS", "GATED", "activation_fwd", "activation_bwd"]
