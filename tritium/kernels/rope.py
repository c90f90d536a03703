"""Triton rotary position embedding, forward and backward in one kernel.

Twin: `tritium.ref.rope` (same names and signatures; the math and the layout contract are
written down there). Both take the same fp32 cos/sin tables, so no transcendental is evaluated
here, and the kernel is compiled with `enable_fp_fusion=False` (no FMA contraction, ptxas
--fmad=false): each value is two IEEE-rounded products and one rounded sum, in the twin's order,
then one rounding to x.dtype. Kernel == twin bit for bit, on the GPU and in the interpreter.

Layout. x is a 4D view [N1, N2, H, D] with any strides (q/k views into a fused QKV output, a
transposed tensor, the [t, 1, h, d] view of thd): the four strides are kernel arguments and
Triton specializes a unit stride, so a view costs no copy and a contiguous last dim still gets
vector loads. The output is a fresh contiguous tensor shaped like x. Rows are (n1, n2, h)
triples, a tile is [BLOCK_R rows, BLOCK_D >= D features] (about 4096 elements on the GPU); each
row's token position comes from pos (int32 [N1, N2], any strides, 0 to broadcast) and indexes
the cos/sin rows, which the H rows of a token share (L1/L2 hits; the tables are small).

The partner feature p(d) (d +- R/2, or d ^ 1 interleaved) is a second load of the same row,
served from L1: DRAM traffic stays one read and one write per element. The backward is the same
kernel with TRANSPOSE: the sin entry of the partner and the opposite sign.

Not done here: in-place updates, fusing q and k (or the QKV split) into one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr,
                 R, N2, H, D, ROT,
                 sx1, sx2, sxh, sxd, sp1, sp2,
                 INTERLEAVED: tl.constexpr, TRANSPOSE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rmask = rows < R
    h = rows % H
    tok = rows // H
    n2 = tok % N2
    n1 = tok // N2
    base = n1 * sx1 + n2 * sx2 + h * sxh
    pos = tl.load(pos_ptr + n1 * sp1 + n2 * sp2, mask=rmask, other=0).to(tl.int64)

    half = ROT // 2
    if INTERLEAVED:
        partner = d ^ 1
        first = (d % 2) == 0
    else:
        first = d < half
        partner = tl.where(first, d + half, d - half)
    in_rot = d < ROT
    mask = rmask[:, None] & (d < D)[None, :]
    rmask2 = rmask[:, None] & in_rot[None, :]

    x = tl.load(x_ptr + base[:, None] + d[None, :] * sxd, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(x_ptr + base[:, None] + partner[None, :] * sxd, mask=rmask2,
                 other=0.0).to(tl.float32)
    trow = pos[:, None] * ROT
    c = tl.load(cos_ptr + trow + d[None, :], mask=rmask2, other=0.0)
    # sign flips as products with -1.0 (exact, and -(+0.0) is -0.0; Triton's unary minus is
    # 0 - x, which gives +0.0 and would differ from the twin's torch negation)
    sgn = tl.where(first, -1.0, 1.0)[None, :]
    if TRANSPOSE:
        # dx[d] = dy[d] cos[d] - s(d) (dy[p] sin[p]); s(d) = -1 on the first of each pair
        s = tl.load(sin_ptr + trow + partner[None, :], mask=rmask2, other=0.0)
        r = (xp * s) * -sgn
    else:
        # y[d] = x[d] cos[d] + s(d) x[p] sin[d]
        s = tl.load(sin_ptr + trow + d[None, :], mask=rmask2, other=0.0)
        r = (xp * sgn) * s
    y = xf * c + r
    out = tl.where(in_rot[None, :], y.to(y_ptr.dtype.element_ty), x)
    tl.store(y_ptr + rows[:, None] * D + d[None, :], out, mask=mask)


_launch = Launcher(_rope_kernel)


def _tile(rows: int, d: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): ~4096 elements per tile on the GPU; 2-row tiles in the
    interpreter so that tiny tests cross tile edges."""
    bd = max(next_pow2(d), 2)
    if interpret:
        return 2, bd, 1
    br = max(1, min(4096 // bd, next_pow2(rows)))
    return br, bd, 8 if br * bd >= 4096 else 4


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


def _run(x, cos, sin, pos, interleaved, transpose):
    rot = _check(x, cos, sin, pos)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    n1, n2, h, d = x.shape
    rows = n1 * n2 * h
    cos, sin = cos.contiguous(), sin.contiguous()
    br, bd, warps = _tile(rows, d, not x.is_cuda)
    _launch((-(-rows // br),), x, cos, sin, pos, y,
            rows, n2, h, d, rot, *x.stride(), *pos.stride(),
            INTERLEAVED=bool(interleaved), TRANSPOSE=transpose,
            BLOCK_R=br, BLOCK_D=bd, num_warps=warps, enable_fp_fusion=False)
    return y


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """See `tritium.ref.rope.rope_fwd`."""
    return _run(x, cos, sin, pos, interleaved, False)


def rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """See `tritium.ref.rope.rope_bwd`."""
    return _run(dy, cos, sin, pos, interleaved, True)


__all__ = ["rope_fwd", "rope_bwd"]
