"""Pieces shared by the CP strategies: one attention block (fwd/bwd through the backends), the
log-sum-exp merge of partial outputs, accumulation dtypes, and the ring exchange.

A strategy splits local attention into blocks: (rows of the local q, rows of a KV tensor,
causal or not). For each block `Runner.fwd` calls `attention_forward` (backends.py) and returns
the partial (out_i, lse_i); `OutAcc.add` merges it into running buffers:
    lse = logaddexp(lse, lse_i)          (torch's stable form: max + log1p(exp(-|diff|)))
    out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)
The factors are computed in fp32 from the fp32 lses; `out` lives in the accumulation dtype.
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

    def fwd(self, q, k, v, blk: Block):
        """-> (out_i, lse_i, state). q is the (compute-dtype) local q, k/v the block's KV."""
        qs, ks, vs = q[:, blk.q], k[:, blk.kv], v[:, blk.kv]
        if self.p.kernel:
            out, lse = _flash_kernel()[0](qs, ks, vs, blk.causal, self.scale, self.p.split)
            return out, lse, (_FLASH, None, None)
        args = self._args(qs, ks, vs, blk.causal)
        backend = self.fp32_backend if qs.dtype == torch.float32 else self.backend
        out, lse, (be, aux) = attention_forward(qs, ks, vs, args, backend)
        if be.name == "torch":          # drop the reference's fp32 copy of out (not needed)
            aux = (aux[0], None)
        return out, lse, (be, aux, args)

    def bwd(self, dout, q, k, v, out, lse, blk: Block, state):
        """-> (dq_i, dk_i, dv_i) for the block, given the merged out and lse."""
        be, aux, args = state
        rows = blk.q
        if be == _FLASH:
            return _flash_kernel()[1](dout[:, rows], q[:, rows], k[:, blk.kv], v[:, blk.kv],
                                      out[:, rows], lse[:, :, rows], blk.causal, self.scale,
                                      self.p.split)
        return attention_backward(dout[:, rows], q[:, rows], k[:, blk.kv], v[:, blk.kv],
                                  out[:, rows], lse[:, :, rows], (be, aux), args)


class OutAcc:
    """Running (out, lse) of the local q rows: out [b, L, h, d_v] in acc dtype, lse fp32."""

    def __init__(self, q: torch.Tensor, d_v: int, acc_dtype: torch.dtype):
        b, s, h, _ = q.shape
        # no zero fill: a row's first add copies into it (every schedule here adds every row)
        self.out = torch.empty(b, s, h, d_v, dtype=acc_dtype, device=q.device)
        lse_dtype = torch.float64 if acc_dtype == torch.float64 else torch.float32
        self.lse = torch.full((b, h, s), float("-inf"), dtype=lse_dtype, device=q.device)
        self._fresh = torch.ones(s, dtype=torch.bool)  # host-side: rows not written yet

    def add(self, rows: slice, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        o, l = self.out[:, rows], self.lse[:, :, rows]
        if bool(self._fresh[rows].all()):
            o.copy_(out_i)
            l.copy_(lse_i)
        else:
            new = torch.logaddexp(l, lse_i)
            a = torch.exp(l - new).transpose(1, 2).unsqueeze(-1)
            b = torch.exp(lse_i - new).transpose(1, 2).unsqueeze(-1)
            if o.dtype == torch.float32 or o.dtype == torch.float64:
                o.mul_(a).addcmul_(out_i, b)     # out_i promoted inside, no temporary
            else:  # 16-bit accumulator: fp32 arithmetic, one rounding per step
                o.copy_(o.float() * a + out_i.float() * b)
            l.copy_(new)
        self._fresh[rows] = False


class Ring:
    """Send to the next rank of the CP group and receive from the previous one (async);
    reverse=True: send to the previous rank and receive from the next one."""

    def __init__(self, group, ranks: list, rank: int, reverse: bool = False):
        self.group, n = group, len(ranks)
        self.next, self.prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
        if reverse:
            self.next, self.prev = self.prev, self.next

    def exchange(self, tensors, tag: int = 0):
        """Post sends of `tensors` and receives of same-shaped ones -> (received, requests)."""
        import torch.distributed as dist
        recv = [torch.empty_like(t) for t in tensors]
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


class GradSum:
    """A running sum of `terms` partial gradients (dq, or a travelling dK/dV buffer) of one
    tensor, each covering some rows (dim 1), stored as cheaply as the precision allows.

    With fp32 accumulation the sum is formed in fp32 and rounded once to the output dtype. Two
    16-bit partials need no fp32 buffer for that: PyTorch adds 16-bit tensors in fp32 and rounds
    once, so `a + b` in bf16 is bit for bit `(a.float() + b.float()).to(bf16)`. So the first
    term is kept as it comes (zero-filled outside its rows), a 16-bit sum of two becomes fp32
    only when more terms follow, and the last add ends in the output dtype. At
    cp=2 (fast mode) that saves converting three buffers to fp32, three fp32 adds and three
    casts per backward, and the dK/dV buffer travels in 16 bits. Without fp32 accumulation the
    buffer stays in the partials' dtype and every add rounds (what TE does). Exact mode's fp32
    partials make fp32 buffers from the first term on.

    `add(buf, shape, rows, part, term)` (term counts from 1; buf None for the first) returns the
    new buffer, contiguous (it may be sent to another rank); after term `terms` it is the result
    in `out_dtype`. Every rank adds the same term at the same step, so travelling buffers have
    the same dtype on both ends."""

    def __init__(self, terms: int, precision: "Precision", out_dtype: torch.dtype):
        self.terms, self.out_dtype = terms, out_dtype
        self.fp32 = precision.acc_dtype(out_dtype) != out_dtype

    def add(self, buf, shape, rows: slice, part: torch.Tensor, term: int) -> torch.Tensor:
        last = term == self.terms
        if buf is None:
            dtype = part.dtype if self.fp32 and not last else self.out_dtype
            if rows == ALL:
                return contiguous(part.to(dtype, memory_format=torch.contiguous_format))
            buf = torch.zeros(shape, dtype=dtype, device=part.device)
            buf[:, rows] = part
            return buf
        if self.fp32 and buf.dtype != torch.float32 and not last:
            buf = buf.float()               # a third term follows: the sum goes to fp32
        if last and buf.dtype != self.out_dtype:
            if rows == ALL:                 # one add, rounded once, into the output dtype
                return torch.add(buf, part).to(self.out_dtype)
            buf[:, rows] += part
            return buf.to(self.out_dtype)
        buf[:, rows] += part
        return buf


__all__ = ["Block", "Precision", "Runner", "OutAcc", "Ring", "ALL", "GradSum"]
