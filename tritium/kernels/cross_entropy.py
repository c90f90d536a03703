"""Triton cross-entropy over a large vocabulary: online log-sum-exp, gradient in the same launch.

Twin: `tritium.ref.cross_entropy` (same names and signatures; the math is written down there).

One program per row of x [T, Vl] (row stride any, last dim contiguous). The first sweep reads the
row in BLOCK-wide pieces and keeps, in fp32, the running max m, the running sum of exp(x - m)
(rescaled by exp(m_old - m_new) when the max grows: the online softmax), the sum of the logits
(label smoothing) and picks the target's logit. The second sweep (GRAD) reads the row again and
writes (softmax (1 + 2 z lse) - eps / V - (1 - eps) onehot) * scale in x's dtype into `grad`,
which may be x itself (the logits are overwritten by their gradient, as TE and Liger do). So
the fused launch reads the logits twice and writes them once, and the full row never sits in
registers: V = 128256 costs no more registers than V = 4096.

Three entry points share the kernel (constexpr flags):
  ce_fused  the whole vocabulary is here: stats, loss and lse, then the gradient (one launch);
  ce_stats  vocab-parallel, first half: the per-row stats [4, T] that the caller all-reduces;
  ce_grad   vocab-parallel, second half: the gradient from the global lse.
Block: 4096 columns and 8 warps on the GPU (16 fp32 values per thread); 16 columns in the
interpreter, so tiny test vocabularies cross several blocks and a ragged tail.

Not done here: the loss of a vocab slice (the caller combines the slices' stats, see
`tritium.ref.cross_entropy.ce_loss`), soft targets, class weights, logit soft-capping.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher, next_pow2


@triton.jit
def _ce_kernel(x_ptr, t_ptr, lse_ptr, stats_ptr, loss_ptr, g_ptr, scale_ptr,
               T, V, sx, sg, s_scale, ignore_index, vocab_start, eps_over_v, one_minus_eps, z,
               STATS: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr,
               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sx
    tgt = tl.load(t_ptr + row)
    local = tgt - vocab_start
    inside = (local >= 0) & (local < V)
    cols0 = tl.arange(0, BLOCK)
    if STATS:
        m = tl.full([], float("-inf"), tl.float32)
        d = tl.full([], 0.0, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + cols0
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            s = s + tl.sum(tl.where(mask, x, 0.0), 0)
            m = m_new
        xt = tl.load(x_row + local, mask=inside, other=0.0).to(tl.float32)
        lse = m + tl.log(d)
        if LOSS:
            loss = lse - one_minus_eps * xt
            loss = loss - eps_over_v * s
            loss = loss + z * lse * lse
            loss = tl.where(tgt == ignore_index, 0.0, loss)
            tl.store(loss_ptr + row, loss)
            tl.store(lse_ptr + row, lse)
        else:
            tl.store(stats_ptr + row, m)
            tl.store(stats_ptr + T + row, d)
            tl.store(stats_ptr + 2 * T + row, xt)
            tl.store(stats_ptr + 3 * T + row, s)
    else:
        lse = tl.load(lse_ptr + row)
    if GRAD:
        sc = tl.load(scale_ptr + row * s_scale)
        sc = tl.where(tgt == ignore_index, 0.0, sc)
        zf = 1.0 + 2.0 * z * lse
        g_row = g_ptr + row * sg
        for off in range(0, V, BLOCK):
            cols = off + cols0
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * zf
            g = g - eps_over_v
            g = g - one_minus_eps * tl.where(cols == local, 1.0, 0.0)
            tl.store(g_row + cols, (g * sc).to(g_ptr.dtype.element_ty), mask=mask)


_launch = Launcher(_ce_kernel)


def _config(v: int, interpret: bool) -> tuple[int, int]:
    if interpret:
        return 16, 1
    return min(max(next_pow2(v), 16), 4096), 8


def _check(x: torch.Tensor, target: torch.Tensor, grad: Optional[torch.Tensor] = None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"cross-entropy kernels take 2D logits with a contiguous last dim, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if target.shape != (x.shape[0],) or target.dtype != torch.int64 or not target.is_contiguous():
        raise ValueError(f"target must be a contiguous int64 [{x.shape[0]}] tensor, got "
                         f"{target.dtype}{tuple(target.shape)}")
    if grad is not None and (grad.shape != x.shape or grad.stride(1) != 1):
        raise ValueError(f"grad must be shaped like x {tuple(x.shape)} with a contiguous last dim")


def _run(x, target, lse, stats, loss, grad, scale, ignore_index, vocab_start, vocab_size,
         label_smoothing, lse_square_scale, stats_on, loss_on):
    t, v = x.shape
    if t == 0:
        return
    block, warps = _config(v, not x.is_cuda)
    g = grad if grad is not None else x
    s_scale = 0 if scale is None or scale.numel() == 1 else 1
    dummy = lse if lse is not None else stats
    sc = scale if scale is not None else dummy
    _launch((t,), x, target, dummy, stats if stats is not None else dummy,
            loss if loss is not None else dummy, g, sc,
            t, v, x.stride(0), g.stride(0), s_scale, int(ignore_index), int(vocab_start),
            float(label_smoothing) / vocab_size, 1.0 - float(label_smoothing),
            float(lse_square_scale), STATS=stats_on, LOSS=loss_on, GRAD=grad is not None,
            BLOCK=block, num_warps=warps)


def ce_stats(x: torch.Tensor, target: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    """See `tritium.ref.cross_entropy.ce_stats`."""
    _check(x, target)
    stats = torch.empty(4, x.shape[0], dtype=torch.float32, device=x.device)
    _run(x, target, None, stats, None, None, None, -100, vocab_start, max(x.shape[1], 1), 0.0,
         0.0, True, False)
    return stats


def ce_grad(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
            scale: torch.Tensor, ignore_index: int, vocab_start: int, vocab_size: int,
            label_smoothing: float, lse_square_scale: float) -> None:
    """See `tritium.ref.cross_entropy.ce_grad`."""
    _check(x, target, grad)
    _run(x, target, lse.float().contiguous(), None, None, grad, scale.float().contiguous(),
         ignore_index, vocab_start, vocab_size, label_smoothing, lse_square_scale, False, False)


def ce_fused(x: torch.Tensor, target: torch.Tensor, grad: Optional[torch.Tensor],
             scale: torch.Tensor, ignore_index: int, label_smoothing: float,
             lse_square_scale: float):
    """See `tritium.ref.cross_entropy.ce_fused`."""
    _check(x, target, grad)
    t, v = x.shape
    loss = torch.empty(t, dtype=torch.float32, device=x.device)
    lse = torch.empty(t, dtype=torch.float32, device=x.device)
    _run(x, target, lse, None, loss, grad, scale.float().contiguous(), ignore_index, 0,
         max(v, 1), label_smoothing, lse_square_scale, True, True)
    return loss, lse


__all__ = ["ce_stats", "ce_grad", "ce_fused"]
