"""Pieces shared by the CP strategies: one attention block (fwd/bwd through the backends), the
log-sum-exp merge of partial outputs, accumulation dtypes, and the ring exchange.

A strategy splits local attention into blocks: (rows of the local q, rows of a KV tensor,
causal or not). For each block `Runner.fwd` calls `attention_forward` (backends.py) and returns
the partial (out_i, lse_i); `OutAcc.add` merges it into running buffers:
    lse = logaddexp(lse, lse_i)          (torch's stable form: max + log1p(exp(-|diff|)))
    out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)
The factors are computed in fp32 from the fp32 lses; `out` lives in the accumulation dtype.
On Hopper with fp32 partials at the speed mode's products (mode "fp32_partials") a block whose
rows hold a partial already is merged by the flash kernel's epilogue itself
(`OutAcc.merge_block`, `kernels.flash_attention.flash_attention_fwd_merge`), the last one also
rounded to the output dtype there (`OutAcc.result`).
Backward calls `attention_backward` per block with the merged (out, lse) and the strategy adds
dq/dk/dv into buffers of the accumulation dtype.

Precision knobs (`Precision`):
  * fp32_accumulation (default on): out, dq, dk, dv buffers in fp32 (dk/dv also travel the
    ring in fp32), cast once at the end. Off: buffers in the input dtype, rounded every step
    (what TE does today for bf16; kept for measuring the difference).
  * exact: each block returns partial out/lse/dq/dk/dv in fp32, never rounded to 16 bits.
    On CUDA with fp16/bf16 inputs, head dim 64 or 128 (d_v == d_qk) and no dropout
    (`Precision.kernel`), the blocks run tritium's Triton flash attention
    (tritium/kernels/flash_attention.py), which reads the 16-bit q/k/v directly and returns
    fp32 partials; `Precision.split` picks its products: P / dS as a 16-bit head and tail
    (split, fp32-accurate: mode "exact") or rounded once to 16 bits (cuDNN's product precision:
    mode "fp32_partials"). Otherwise the blocks run on fp32 copies of q, k, v: the reference on
    CPU, the fp32 path of the mem-efficient kernel on CUDA (slow: 7-12x single-GPU cuDNN).
    Not exact ("fast"): blocks run in the input dtype on the fused backends; their bf16
    partials add one rounding per block.
The merged lse is always fp32. Rows without a visible key cannot occur with the causal /
no_mask schedules used here (every row sees its own diagonal or a whole block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..dot_product_attention import attention_backward, attention_forward, prepare

_FLASH = "tritium-flash"  # block state of the Triton kernel path

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    q: slice            # rows of the local q
    kv: slice           # rows of the KV tensor this block reads
    causal: bool        # top-left causal on the [q rows, kv rows] square


@dataclass(frozen=True)
class Precision:
    exact: bool = True
    fp32_accumulation: bool = True
    kernel: bool = False    # exact blocks on the Triton flash kernel (16-bit in, fp32 out)
    split: bool = True      # the kernel's P / dS products: head + tail (False: rounded once)

    def acc_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.fp32_accumulation and dtype != torch.float64 else dtype

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor a block computes on: an fp32 copy in exact mode (not for the kernel,
        which reads the 16-bit tensor itself)."""
        if self.exact and not self.kernel and x.dtype in (torch.bfloat16, torch.float16):
            return x.float()
        return x


def _flash_kernel():
    """(fwd, bwd) of the Triton flash attention: the launchers, or under torch.compile the
    `tritium::flash_attn_fwd/_bwd` custom ops (tritium/ops/attention.py, registered on this
    first import). The CP entry point is compile-disabled today, so only code that traces a
    Runner itself reaches the op branch."""
    if torch.compiler.is_compiling():
        from ...ops import attention as ops
        return ops.flash_attn_fwd, ops.flash_attn_bwd
    from ...kernels import flash_attention as FA
    return FA.flash_attention_fwd, FA.flash_attention_bwd


class Runner:
    """Runs blocks through the attention backends; keeps each block's backward state."""

    def __init__(self, scale: float, dropout: float, backend: str, precision: Precision):
        self.scale, self.dropout, self.backend, self.p = scale, dropout, backend, precision
        # fp32 blocks (exact mode) cannot run on cuDNN/flash: let the choice pick an fp32 one
        self.fp32_backend = backend if backend in ("torch", "efficient") else "auto"

    def _args(self, q, k, v, causal):
        _, _, _, args = prepare(q, k, v, qkv_format="bshd",
                                attn_mask_type="causal" if causal else "no_mask",
                                softmax_scale=self.scale, dropout_p=self.dropout,
                                where="context parallel attention")
        return args

    def fwd(self, q, k, v, blk: Block, acc: Optional["OutAcc"] = None, last: bool = False):
        """-> (out_i, lse_i, state). q is the (compute-dtype) local q, k/v the block's KV.
        With `acc` the flash kernel may merge the block into it itself (`OutAcc.merge_block`;
        then out_i and lse_i are None); `last`: no block follows."""
        qs, ks, vs = q[:, blk.q], k[:, blk.kv], v[:, blk.kv]
        if self.p.kernel:
            if (acc is not None and not self.p.split
                    and acc.merge_block(qs, ks, vs, blk, self.scale, last)):
                return None, None, (_FLASH, None, None)
            out, lse = _flash_kernel()[0](qs, ks, vs, blk.causal, self.scale, self.p.split)
            return out, lse, (_FLASH, None, None)
        args = self._args(qs, ks, vs, blk.causal)
        backend = self.fp32_backend if qs.dtype == torch.float32 else self.backend
        out, lse, (be, aux) = attention_forward(qs, ks, vs, args, backend)
        if be.name == "torch":          # drop the reference's fp32 copy of out (not needed)
            aux = (aux[0], None)
        return out, lse, (be, aux, args)

    def shared(self, dout, out, q) -> Optional[tuple]:
        """(delta, dq) over all local rows where the blocks run the flash kernel with fp32
        accumulation: delta = rowsum(dO * out) computed once for all blocks, and one zeroed
        fp32 dq that every block's kernel adds its rows into (no dq partial per block, no
        adds; the fused Hopper backward sums into it in place). None elsewhere."""
        if (not self.p.kernel or self.p.acc_dtype(q.dtype) != torch.float32
                or torch.compiler.is_compiling()):
            return None
        from ...kernels import flash_attention as FA
        return (FA.flash_attention_delta(out, dout),
                torch.zeros(q.shape, dtype=torch.float32, device=q.device))

    def bwd(self, dout, q, k, v, out, lse, blk: Block, state, shared=None):
        """-> (dq_i, dk_i, dv_i) for the block, given the merged out and lse. With `shared`
        (the kernel path) dq_i is the block's rows of the shared dq, the block's grads added."""
        be, aux, args = state
        rows = blk.q
        if be == _FLASH:
            extra = {} if shared is None else dict(delta=shared[0][:, :, rows],
                                                      dq_acc=shared[1][:, rows])
            return _flash_kernel()[1](dout[:, rows], q[:, rows], k[:, blk.kv], v[:, blk.kv],
                                      out[:, rows], lse[:, :, rows], blk.causal, self.scale,
                                      self.p.split, **extra)
        return attention_backward(dout[:, rows], q[:, rows], k[:, blk.kv], v[:, blk.kv],
                                  out[:, rows], lse[:, :, rows], (be, aux), args)


class OutAcc:
    """Running (out, lse) of the local q rows: out [b, L, h, d_v] in acc dtype, lse fp32.

    The first partial over all rows becomes the buffer (no copy when it is in the acc dtype,
    e.g. the flash kernel's fp32 partials); later ones merge in place. With a partial of the
    acc dtype the merge is one pass, `out.lerp_(out_i, b)` = out + b (out_i - out) with
    b = exp(lse_i - lse_new) (a = exp(lse - lse_new) = 1 - b up to rounding); a 16-bit partial
    into an fp32 buffer is promoted inside `addcmul_`."""

    def __init__(self, q: torch.Tensor, d_v: int, acc_dtype: torch.dtype):
        b, s, h, _ = q.shape
        self.shape, self.acc_dtype = (b, s, h, d_v), acc_dtype
        self.out = None
        self.out16, self.rounded = None, (0, 0)     # rows the last kernel merge rounded
        lse_dtype = torch.float64 if acc_dtype == torch.float64 else torch.float32
        self.lse = torch.full((b, h, s), float("-inf"), dtype=lse_dtype, device=q.device)
        self._fresh = torch.ones(s, dtype=torch.bool)  # host-side: rows not written yet

    def add(self, rows: slice, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        if self.out is None and rows == ALL:     # the first partial becomes the buffer
            self.out = out_i.to(self.acc_dtype, memory_format=torch.contiguous_format)
            self.lse.copy_(lse_i)
            self._fresh[:] = False
            return
        if self.out is None:    # no zero fill: every schedule here adds every row
            self.out = torch.empty(self.shape, dtype=self.acc_dtype, device=out_i.device)
        o, l = self.out[:, rows], self.lse[:, :, rows]
        if bool(self._fresh[rows].all()):
            o.copy_(out_i)
            l.copy_(lse_i)
        else:
            new = torch.logaddexp(l, lse_i)
            b = torch.exp(lse_i - new).transpose(1, 2).unsqueeze(-1)
            if o.dtype == out_i.dtype and o.dtype in (torch.float32, torch.float64):
                o.lerp_(out_i, b)       # b: the lse's dtype, o's
            elif o.dtype in (torch.float32, torch.float64):
                a = torch.exp(l - new).transpose(1, 2).unsqueeze(-1)
                o.mul_(a).addcmul_(out_i, b)     # out_i promoted inside, no temporary
            else:  # 16-bit accumulator: fp32 arithmetic, one rounding per step
                a = torch.exp(l - new).transpose(1, 2).unsqueeze(-1)
                o.copy_(o.float() * a + out_i.float() * b)
            l.copy_(new)
        self._fresh[rows] = False

    def merge_block(self, q, k, v, blk: Block, scale: float, last: bool) -> bool:
        """Merge a block (speed-mode products, fp32 partials) into the fp32 buffers inside the
        Hopper flash kernel's epilogue, where that kernel runs it and the block's rows already
        hold a partial: no partial tensors, no separate merge pass (and with `last` the merged
        rows also rounded to q's dtype for `result`). False: nothing done, `add` the block."""
        if (self.out is None or self.out.dtype != torch.float32
                or torch.compiler.is_compiling() or bool(self._fresh[blk.q].any())):
            return False
        from ...kernels import flash_attention as FA
        rows = span(blk.q, self.shape[1])
        out16 = torch.empty(self.shape, dtype=q.dtype, device=q.device) if last else None
        if not FA.flash_attention_fwd_merge(q, k, v, blk.causal, scale, self.out, self.lse,
                                            rows[0], out16):
            return False
        if last:
            self.out16, self.rounded = out16, rows
        return True

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The merged out in dtype (the last kernel merge's rounded rows kept, the rest cast)."""
        if self.out16 is None or self.out16.dtype != dtype:
            return self.out.to(dtype)
        a, b = self.rounded
        for lo, hi in ((0, a), (b, self.shape[1])):
            if hi > lo:
                self.out16[:, lo:hi] = self.out[:, lo:hi]
        return self.out16


class Ring:
    """Send to the next rank of the CP group and receive from the previous one (async);
    reverse=True: send to the previous rank and receive from the next one."""

    def __init__(self, group, ranks: list, rank: int, reverse: bool = False):
        self.group, n = group, len(ranks)
        self.next, self.prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
        if reverse:
            self.next, self.prev = self.prev, self.next

    def exchange(self, tensors, tag: int = 0, shapes=None):
        """Post sends of `tensors` and receives of same-dtype ones, of `shapes` (None or an
        entry None: the sent tensor's shape) -> (received, requests)."""
        import torch.distributed as dist
        shapes = shapes or [None] * len(tensors)
        recv = [torch.empty(shape or t.shape, dtype=t.dtype, device=t.device)
                for t, shape in zip(tensors, shapes)]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i)
                for i, t in enumerate(recv)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending):
        recv, reqs = pending
        for r in reqs:
            r.wait()
        return recv


def contiguous(x: Optional[torch.Tensor]):
    return x if x is None or x.is_contiguous() else x.contiguous()


def span(rows: slice, length: int) -> tuple:
    """(start, stop) of a row slice of a tensor of `length` rows."""
    start, stop, _ = rows.indices(length)
    return start, stop


class GradSum:
    """A running sum of `terms` partial gradients (dq, or a travelling dK/dV buffer) of one
    tensor of `length` rows (dim 1), each term covering a slice of the rows, stored as cheaply
    as the precision allows.

    A buffer is (tensor, (start, stop)): it holds only the rows its terms have covered so far
    (the smallest range that contains them), so a term over half the rows is neither
    zero-filled nor copied, and a travelling buffer sends only those rows (the receiver knows
    them from the schedule). An add that covers the buffer's rows adds the buffer into the new
    term (whose tensor it may reuse), one that lies inside them adds into the buffer.

    With fp32 accumulation the sum is formed in fp32 and rounded once to the output dtype. Two
    16-bit partials need no fp32 buffer for that: PyTorch adds 16-bit tensors in fp32 and rounds
    once, so `a + b` in bf16 is bit for bit `(a.float() + b.float()).to(bf16)`. So the first
    term is kept as it comes, a 16-bit sum of two becomes fp32 only when more terms follow, and
    the last add writes the output dtype directly (`torch.add(..., out=)`: one pass, rows
    covered by one side only are copied). At cp=2 (fast mode) that saves converting three
    buffers to fp32, three fp32 adds and three casts per backward, and the dK/dV buffer travels
    in 16 bits. Without fp32 accumulation the buffer stays in the output dtype and every add
    rounds (what TE does). Exact mode's fp32 partials make fp32 buffers from the first term on.

    `add(buf, part, rows, term)` (term counts from 1; buf None for the first) returns the new
    buffer, contiguous (it may be sent to another rank); after term `terms` its tensor is the
    whole result in `out_dtype`. Every rank adds the same term at the same step, so travelling
    buffers have the same dtype on both ends."""

    def __init__(self, terms: int, precision: "Precision", out_dtype: torch.dtype,
                 length: int):
        self.terms, self.out_dtype, self.length = terms, out_dtype, length
        self.acc = precision.acc_dtype(out_dtype)

    def add(self, buf, part: torch.Tensor, rows: slice, term: int) -> tuple:
        cover = span(rows, self.length)
        if term == self.terms:
            return self._finish(buf, part, cover), (0, self.length)
        if buf is None:     # kept as it comes (16-bit or fp32) when the sum is fp32
            keep = part if self.acc != self.out_dtype else part.to(self.acc)
            return contiguous(keep), cover
        have = buf[1]
        lo, hi = min(have[0], cover[0]), max(have[1], cover[1])
        if (lo, hi) == have:        # the term lies within the buffer's rows
            t, other, at = buf[0].to(self.acc), part, cover
        elif (lo, hi) == cover:     # the term covers them: the buffer goes into the term
            t, other, at = part.to(self.acc), buf[0], have
        else:                       # apart: a buffer over both
            t = torch.zeros(part.shape[0], hi - lo, *part.shape[2:], dtype=self.acc,
                            device=part.device)
            t[:, have[0] - lo:have[1] - lo] = buf[0]
            other, at = part, cover
        t[:, at[0] - lo:at[1] - lo] += other
        return contiguous(t), (lo, hi)

    def _finish(self, buf, part, cover) -> torch.Tensor:
        """The sum in out_dtype: rows both sides cover added and rounded once, the others
        copied (zero where neither does)."""
        out = torch.empty(part.shape[0], self.length, *part.shape[2:], dtype=self.out_dtype,
                          device=part.device)
        t, have = buf if buf is not None else (None, (0, 0))
        cuts = sorted({0, self.length, *have, *cover})
        for a, b in zip(cuts, cuts[1:]):
            dst = out[:, a:b]
            old = t[:, a - have[0]:b - have[0]] if have[0] <= a and b <= have[1] else None
            new = part[:, a - cover[0]:b - cover[0]] if cover[0] <= a and b <= cover[1] else None
            if old is not None and new is not None:
                torch.add(old, new, out=dst)
            elif old is not None or new is not None:
                dst.copy_(old if old is not None else new)
            else:
                dst.zero_()
        return out


__all__ = ["Block", "Precision", "Runner", "OutAcc", "Ring", "ALL", "GradSum", "span"]
