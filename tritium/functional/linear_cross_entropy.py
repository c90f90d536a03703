"""`linear_cross_entropy`: lm_head GEMM + cross-entropy that never materializes the full logits.

loss = cross_entropy(hidden @ weight.T (+ bias), target), hidden [..., H], weight [V, H], target
[...] (class ids, ignore_index skipped), reduction "mean" (over non-ignored tokens, torch's),
"sum" or "none" (fp32 per token, shaped like target). label_smoothing is torch's; the z-loss
adds lse_square_scale * lse^2 per token (Liger's and flash-attention's name and definition).

How. The tokens go through in chunks of C rows, C chosen so that one chunk of logits takes at
most `chunk_bytes` (256 MiB: 1024 tokens of a 128256-class vocabulary in bf16), a multiple of
128 where that leaves at least 128 rows (the GEMMs' row tile: 1040 rows would run 9 tiles of
128 where 8 are full, 12% more FP8 lm_head fprop time on an H100), else of 16. Per chunk:
logits = h_c @ W^T in the inputs' dtype (what an HF lm_head produces), then the cross-entropy
kernel computes the loss with an fp32 log-sum-exp and overwrites the logits with their gradient
in the same launch; dh_c = dlogits @ W goes straight into the hidden gradient,
dW += dlogits^T @ h_c (in `accum_dtype`, default the weight's dtype, as Liger; fp32 costs a
[V, H] fp32 buffer and is more precise), dbias += column sums (fp32). So the gradients are done
when the forward returns (the backward only multiplies them by grad_output), and memory holds
one chunk of logits instead of T x V. With reduction="none" the per-token grad_output is not
known in the forward: the forward keeps only the per-token lse and the backward recomputes the
logits chunk by chunk (one more lm_head GEMM).

Vocab-parallel (`tp_group`, Megatron's column-parallel lm_head): weight (and bias) are this
rank's contiguous slice of V / tp rows, hidden and target are the same on every rank. The loss
is the unsharded one (`ce_chunk`: two small all-reduces per chunk), dW stays local, dh is
all-reduced (SUM) once at the end. The result is the same on every rank.

FP8 (`fp8=True`, and only inside an enabled fp8_autocast): the three GEMMs of each chunk run in
FP8, in the autocast recipe's formats (HYBRID: h and W E4M3, dlogits E5M2), the logits GEMM
with fast accumulation, dgrad and wgrad precise, through `fp8_gemm_tn` and the FP8 casts. Scales
(the function owns no state, so no delayed scaling whatever the recipe): W and all of h are cast
once per call, each with the scale of its measured amax (current scaling); dlogits with one
scale for the call from a bound instead of a measurement: |softmax - target| <= 1 elementwise,
so |dlogits| <= the loss's gradient scale (1 / valid tokens for "mean", 1 for "sum", max|g| in
the recompute of "none"), which needs no amax pass over the chunk. With one scale, the dl^T of
consecutive chunks go into one buffer (`WGRAD_GROUP_BYTES`, as many chunks as take the bytes of
one bf16 logits chunk) and the wgrad GEMM runs once per group, adding into dW in its epilogue
(`accumulate`: one rounding per group): on an H100 each such GEMM's read-modify-write of the
[V, H] dW cost ~0.4 ms per 1024-row chunk at V = 128256 (benchmarks/RESULTS.md). The z-loss
(lse_square_scale > 0) has no such bound: there each chunk's dlogits take the scale of their own
amax and the wgrad runs per chunk. FP8 chunks are whole 16-row tiles (the chunk size is rounded
up to a multiple of 16). The loss is still computed in fp32 from the (FP8-GEMM, 16-bit) logits.
Needs H and V_local divisible by 16. Accuracy: docs/numerics.md.

Not done here: softcapping, class weights, sequence-parallel hidden (gather it first).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..fp8.autocast import get_fp8_recipe, is_fp8_enabled
from ..fp8.cast import cast_transpose, quantize_2d
from .cross_entropy import ce_chunk, ce_grad_only, check_common, group_size, valid_count
from .fused_cast import pad16
from .gemm import fp8_gemm_tn

CHUNK_BYTES = 256 << 20
# the FP8 head's weight gradient: the chunks whose dl^T (1 byte per logit) fit these bytes go
# through one GEMM (fewer read-modify-writes of dW)
WGRAD_GROUP_BYTES = CHUNK_BYTES
REDUCTIONS = ("mean", "sum", "none")
_CURRENT = (0.0, False)  # current scaling: amax_epsilon 0, scales not rounded to powers of 2


class _Options(NamedTuple):
    ignore_index: int
    reduction: str
    label_smoothing: float
    lse_square_scale: float
    tp_group: object
    recipe: object  # the fp8_autocast recipe when the FP8 lm_head runs, else None
    chunk_size: Optional[int]
    accum_dtype: Optional[torch.dtype]


def chunk_rows(tokens: int, vocab: int, itemsize: int, chunk_size: Optional[int]) -> int:
    if chunk_size is not None:
        return max(int(chunk_size), 1)
    c = CHUNK_BYTES // max(vocab * itemsize, 1)
    return c // 128 * 128 if c >= 128 else max(16, c // 16 * 16)


class _FP8Head:
    """The FP8 GEMMs of one call (module docstring): the weight and all hidden rows cast once;
    per chunk the logits GEMM and the logits gradient's cast and dgrad; the wgrad per chunk, or
    per group of chunks where the gradient's scale comes from a bound (one scale for the call)."""

    def __init__(self, weight: torch.Tensor, h2d: torch.Tensor, recipe, need_dgrad: bool,
                 need_wgrad: bool, dl_bound: Optional[torch.Tensor], chunk: int):
        v, h = weight.shape
        if v % 16 or h % 16:
            raise ValueError(f"linear_cross_entropy(fp8=True) needs the (local) vocabulary and "
                             f"hidden size divisible by 16, got weight {tuple(weight.shape)}; pad "
                             "the vocabulary (e.g. resize_token_embeddings(pad_to_multiple_of=16))")
        self.fwd, self.bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        self.w, self.w_t, self.w_si = quantize_2d(weight.detach(), self.fwd, scale=None,
                                                  amax=None, current=_CURRENT, pad_rows_to=16,
                                                  write_transpose=need_dgrad)
        self.h, self.h_t, self.h_si = quantize_2d(h2d.detach(), self.fwd, scale=None, amax=None,
                                                  current=_CURRENT, pad_rows_to=16,
                                                  write_transpose=need_wgrad)
        self.dl_bound = dl_bound
        # the gathered transposes of dl: as many chunks as take the bytes of one bf16 chunk
        self.group = None  # (casts into a given buffer are eager only: ops/cast.py)
        if dl_bound is not None and need_wgrad and not torch.compiler.is_compiling():
            cols = max(WGRAD_GROUP_BYTES // max(v, 1), chunk) // chunk * chunk
            cols = min(cols, pad16(h2d.shape[0]))
            self.group = torch.empty(v, cols, dtype=self.bwd, device=weight.device)
            self.dl_si = torch.empty(1, dtype=torch.float32, device=weight.device)
        self.first = self.filled = 0  # the group's first hidden row, and its columns in use

    def logits(self, s: int, e: int, dtype: torch.dtype, bias) -> torch.Tensor:
        out = fp8_gemm_tn(self.h[s:s + pad16(e - s)], self.w, self.h_si, self.w_si, dtype,
                          fast_accum=True)[:e - s]
        return out if bias is None else out.add_(bias)

    def grads(self, dl: torch.Tensor, s: int, dh_out, dw: Optional[torch.Tensor]) -> None:
        if dh_out is None and dw is None:  # only the bias's gradient (_chunk_grads)
            return
        rows = pad16(dl.shape[0])
        if self.group is not None and dw is not None:
            if self.filled + rows > self.group.shape[1]:
                self.flush(dw)
            if self.filled == 0:
                self.first = s
            block = self.group[:, self.filled:self.filled + rows]
            dq = torch.empty(rows, dl.shape[1], dtype=self.bwd, device=dl.device) \
                if dh_out is not None else None
            dq, dt, dsi = cast_transpose(dl, None, self.dl_bound, self.bwd, pad_rows_to=16,
                                         write_data=dq is not None, write_transpose=True,
                                         current=_CURRENT, out=(dq, block, self.dl_si))
            self.filled += rows
        else:  # the bound as the amax, or (z-loss) the chunk's measured one
            writes = dict(pad_rows_to=16, write_data=dh_out is not None,
                          write_transpose=dw is not None)
            dq, dt, dsi = quantize_2d(dl, self.bwd, scale=None, amax=None, current=_CURRENT,
                                      **writes) if self.dl_bound is None else \
                cast_transpose(dl, None, self.dl_bound, self.bwd, current=_CURRENT, **writes)
            if dw is not None:  # dW += dl^T h, added inside the GEMM (functional/gemm.py)
                fp8_gemm_tn(dt, self.h_t[:, s:s + rows], dsi, self.h_si, dw.dtype, out=dw,
                            accumulate=True)
        if dh_out is not None:
            if dq.shape[0] == dh_out.shape[0]:  # no padding rows: written in place
                fp8_gemm_tn(dq, self.w_t, dsi, self.w_si, dh_out.dtype, out=dh_out)
            else:
                dh_out.copy_(fp8_gemm_tn(dq, self.w_t, dsi, self.w_si, dh_out.dtype)[:dl.shape[0]])

    def flush(self, dw: Optional[torch.Tensor]) -> None:
        """dW += the gathered chunks' dl^T h, one GEMM over their rows."""
        if self.filled and dw is not None:
            fp8_gemm_tn(self.group[:, :self.filled],
                        self.h_t[:, self.first:self.first + self.filled], self.dl_si, self.h_si,
                        dw.dtype, out=dw, accumulate=True)
        self.filled = 0


def _chunk_grads(plan, dl, s, h, weight, dh_out, dw, db) -> None:
    """dh_out = dl @ W, dw += dl^T @ h, db += column sums of dl (any may be None); dl is the
    chunk of rows s.. (the FP8 head adds grouped chunks to dw at its flush)."""
    if db is not None:
        db.add_(dl.float().sum(0))
    if plan is not None:
        plan.grads(dl, s, dh_out, dw)
        return
    if dh_out is not None:
        torch.mm(dl, weight, out=dh_out)
    if dw is not None:
        if dw.dtype == dl.dtype:
            dw.addmm_(dl.t(), h)
        else:
            dw.add_(dl.t() @ h)


def _logits(plan, h, s, weight, bias):
    if plan is not None:
        return plan.logits(s, s + h.shape[0], h.dtype, bias)
    return torch.nn.functional.linear(h, weight, bias)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2d, weight, bias, target, cfg: _Options):
        ignore, reduction, eps, z, group, recipe, chunk_size, accum_dtype = cfg
        t_len = h2d.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads_now = reduction != "none" and (need_h or need_w or need_b)
        n = valid_count(target, ignore)
        scale = 1.0 / n.clamp(min=1.0) if reduction == "mean" else \
            torch.ones(1, device=h2d.device)
        c = chunk_rows(t_len, weight.shape[0], h2d.element_size(), chunk_size)
        plan = None
        if recipe is not None:  # chunks of whole 16-row FP8 tiles
            c = pad16(c)
            plan = _FP8Head(weight, h2d, recipe, need_h and grads_now, need_w and grads_now,
                            scale.reshape(1).float() if z == 0.0 else None, c)
        dh = torch.empty_like(h2d) if grads_now and need_h else None
        dw = torch.zeros(weight.shape, dtype=accum_dtype or weight.dtype, device=weight.device) \
            if grads_now and need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if grads_now and need_b else None
        loss = torch.empty(t_len, dtype=torch.float32, device=h2d.device)
        lse = torch.empty_like(loss)
        for s in range(0, t_len, c):
            e = min(s + c, t_len)
            h = h2d[s:e]
            logits = _logits(plan, h, s, weight, bias)
            loss[s:e], lse[s:e] = ce_chunk(logits, target[s:e], logits if grads_now else None,
                                           scale, ignore, eps, z, group)
            if grads_now:
                _chunk_grads(plan, logits, s, h, weight, None if dh is None else dh[s:e], dw,
                             db)
            del logits
        if plan is not None:
            plan.flush(dw)
        if dh is not None and group_size(group) > 1:
            dist.all_reduce(dh, group=group)
        ctx.cfg, ctx.grads_now = cfg, grads_now
        ctx.grads = (dh, dw, db)
        ctx.w_dtype = weight.dtype
        if reduction == "none" and (need_h or need_w or need_b):
            ctx.save_for_backward(h2d, weight, bias, target, lse)
        if reduction == "mean":
            return loss.sum() / n.reshape(())   # a new tensor, not a view: FSDP2 warns on view outputs
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads_now:
            dh, dw, db = ctx.grads
            if dh is None and dw is None and db is None:
                raise RuntimeError("linear_cross_entropy: backward through the same graph "
                                   "twice; its gradients are consumed by the first backward")
            ctx.grads = (None, None, None)
            g = grad_output.float()
            out = [None if t is None else t.mul_(g) for t in (dh, dw, db)]
            if out[1] is not None:
                out[1] = out[1].to(ctx.w_dtype)
            if out[2] is not None:
                out[2] = out[2].to(ctx.w_dtype)
            return out[0], out[1], out[2], None, None
        return _recompute_backward(ctx, grad_output) + (None, None)


def _recompute_backward(ctx, grad_output):
    """reduction="none": the per-token gradients, recomputing the logits chunk by chunk."""
    h2d, weight, bias, target, lse = ctx.saved_tensors
    ignore, _, eps, z, group, recipe, chunk_size, accum_dtype = ctx.cfg
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    g = grad_output.reshape(-1).float().contiguous()
    t_len = h2d.shape[0]
    c = chunk_rows(t_len, weight.shape[0], h2d.element_size(), chunk_size)
    plan = None
    if recipe is not None:  # the gradient's bound: max |g| (|softmax - target| <= 1)
        c = pad16(c)
        plan = _FP8Head(weight, h2d, recipe, need_h, need_w,
                        g.abs().max().reshape(1) if z == 0.0 else None, c)
    dh = torch.empty_like(h2d) if need_h else None
    dw = torch.zeros(weight.shape, dtype=accum_dtype or weight.dtype, device=weight.device) \
        if need_w else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
        if need_b else None
    for s in range(0, t_len, c):
        e = min(s + c, t_len)
        h = h2d[s:e]
        logits = _logits(plan, h, s, weight, bias)
        ce_grad_only(logits, target[s:e], lse[s:e], logits, g[s:e], ignore, eps, z, group)
        _chunk_grads(plan, logits, s, h, weight, None if dh is None else dh[s:e], dw, db)
        del logits
    if plan is not None:
        plan.flush(dw)
    if dh is not None and group_size(group) > 1:
        dist.all_reduce(dh, group=group)
    return (dh, None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(weight.dtype))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                         bias: Optional[torch.Tensor] = None, *, tp_group=None,
                         fp8: bool = False, chunk_size: Optional[int] = None,
                         accum_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T + bias` against `target` without materializing the
    logits (see the module docstring). Returns fp32: a scalar ("mean", "sum") or one loss per
    token shaped like target ("none")."""
    name = "linear_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: expected hidden [..., H] and weight [V, H], got "
                         f"{tuple(getattr(hidden, 'shape', ()))} and "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16,
                                                            torch.float16):
        raise TypeError(f"{name}: hidden and weight must share one dtype of float32, bfloat16 "
                        f"or float16, got {hidden.dtype} and {weight.dtype}; cast one of them")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"{name}: bias must be [{weight.shape[0]}] of dtype {weight.dtype}, got "
                         f"{bias.dtype}{tuple(bias.shape)}")
    if hidden.device != weight.device or target.device != hidden.device:
        raise ValueError(f"{name}: hidden, weight and target must be on one device, got "
                         f"{hidden.device}, {weight.device}, {target.device}")
    check_common(name, target, hidden.shape[:-1], label_smoothing, lse_square_scale)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"{name}: chunk_size must be a positive number of tokens, got "
                         f"{chunk_size}")
    recipe = None
    if fp8 and is_fp8_enabled():
        recipe = get_fp8_recipe()
    h2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    t1 = target.reshape(-1).to(torch.int64).contiguous()
    cfg = _Options(int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale),
                   tp_group, recipe, chunk_size, accum_dtype)
    loss = _LinearCrossEntropy.apply(h2d, weight, bias, t1, cfg)
    return loss.reshape(target.shape) if reduction == "none" else loss


__all__ = ["linear_cross_entropy", "chunk_rows", "CHUNK_BYTES"]
