"""Pure-PyTorch twins of `tritium.kernels.cross_entropy`: the CPU path and the test oracle.

Cross-entropy over the last dim of 2D logits x [T, Vl] (row stride any, last dim contiguous),
one target per row (int64 [T]). x may be one contiguous vocab slice of a larger vocabulary of
`vocab_size` classes starting at class `vocab_start` (vocab-parallel logits); a target outside
the slice contributes nothing locally. All math in fp32, whatever x's dtype:

  stats     m = max_c x_c, d = sum_c exp(x_c - m), x_t = x[target - vocab_start] (0 when the
            target is not in this slice), s = sum_c x_c              -> fp32 [4, T]
  lse       = m + log(d)  (for a vocab slice: after combining the slices' stats)
  loss      = lse - (1 - eps) x_t - eps s / vocab_size + z lse^2     (0 for ignored rows)
  grad      = (softmax_c (1 + 2 z lse) - eps / vocab_size - (1 - eps) [c == target]) * scale
            written in x's dtype (0 for ignored rows); `scale` is fp32 [1] (one scale) or [T]
            (one per row).
eps is the label smoothing (torch's definition: the target distribution is (1 - eps) one-hot +
eps uniform), z the z-loss weight (`lse_square_scale`, as Liger and flash-attention call it).

The kernel makes one online pass over the vocab in blocks for the stats and a second for the
gradient; the twin uses torch's full-row reductions, so the two agree to fp32 rounding (sums
in another order), not bit for bit. `grad` may be x itself (the gradient overwrites the
logits, as TE and Liger do).
"""
from __future__ import annotations

from typing import Optional

import torch


def _local_target(target: torch.Tensor, vocab_start: int, n: int):
    local = target - vocab_start
    inside = (local >= 0) & (local < n)
    return local.clamp(0, max(n - 1, 0)), inside


def ce_stats(x: torch.Tensor, target: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    """fp32 [4, T]: per row the max m, sum exp(x - m), the target's logit (0 when the target
    is not in this slice) and the sum of the logits."""
    xf = x.float()
    m = xf.amax(-1)
    d = torch.exp(xf - m[:, None]).sum(-1)
    local, inside = _local_target(target, vocab_start, x.shape[1])
    xt = torch.where(inside, xf.gather(1, local[:, None]).squeeze(1), torch.zeros_like(m))
    return torch.stack([m, d, xt, xf.sum(-1)])


def ce_grad(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
            scale: torch.Tensor, ignore_index: int, vocab_start: int, vocab_size: int,
            label_smoothing: float, lse_square_scale: float) -> None:
    """Write the gradient of the per-row loss times `scale` into `grad` (shaped like x, x's
    dtype; may be x)."""
    xf = x.float()
    p = torch.exp(xf - lse[:, None])
    g = p * (1.0 + 2.0 * lse_square_scale * lse)[:, None]
    if label_smoothing:
        g = g - label_smoothing / vocab_size
    local, inside = _local_target(target, vocab_start, x.shape[1])
    onehot = torch.zeros_like(g).scatter_(1, local[:, None], 1.0) * inside[:, None]
    g = g - (1.0 - label_smoothing) * onehot
    s = scale.float().expand(x.shape[0]) if scale.numel() == 1 else scale.float()
    s = torch.where(target == ignore_index, torch.zeros_like(s), s)
    grad.copy_((g * s[:, None]).to(grad.dtype))


def ce_loss(stats: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int,
            label_smoothing: float, lse_square_scale: float):
    """(loss [T], lse [T]) fp32 from (combined) stats; shared by kernel and twin paths."""
    m, d, xt, s = stats.unbind(0)
    lse = m + torch.log(d)
    loss = lse - (1.0 - label_smoothing) * xt
    if label_smoothing:
        loss = loss - label_smoothing / vocab_size * s
    if lse_square_scale:
        loss = loss + lse_square_scale * lse * lse
    return torch.where(target == ignore_index, torch.zeros_like(loss), loss), lse


def ce_fused(x: torch.Tensor, target: torch.Tensor, grad: Optional[torch.Tensor],
             scale: torch.Tensor, ignore_index: int, label_smoothing: float,
             lse_square_scale: float):
    """The whole vocabulary in x: (loss [T], lse [T]) fp32, and the gradient written into
    `grad` when it is not None (one launch in the kernel)."""
    v = x.shape[1]
    loss, lse = ce_loss(ce_stats(x, target), target, ignore_index, v, label_smoothing,
                        lse_square_scale)
    if grad is not None:
        ce_grad(x, target, lse, grad, scale, ignore_index, 0, v, label_smoothing,
                lse_square_scale)
    return loss, lse


__all__ = ["ce_stats", "ce_grad", "ce_loss", "ce_fused"]
