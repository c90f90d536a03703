"""Triton multi-tensor SGD step (torch.optim.SGD semantics, with master weights and bf16/fp16/
FP8 param writes). Twin: `tritium.ref.sgd` (the op order is stated there; bit for bit equal).

Built on the multi-tensor machinery of `tritium.kernels.adam` (tables of addresses, chunks,
vectorized unmasked steps, weight load/store helpers): the table's exp_avg column holds the
momentum buffer. One launch per bucket; a bucket's buffers are all new (FIRST: buf = d) or all
existing. Deliberately not here: remainders (FusedSGD keeps full masters).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..fp8.formats import FP8_MAX
from ._launch import Launcher
from .adam import (TL_DTYPE, _G, _M, _chunk, _fp8_scale_inv, _ld, _load_weight, _one, _ptr,
                   _st, _store_weight, block_config, build_tables, on_device)


@triton.jit
def _sgd_block(row, start, left, lr, mom, omd, wd, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
               HAS_MASTER: tl.constexpr, FP8_MAX: tl.constexpr, DECAY: tl.constexpr,
               DECAY_AFTER: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               FIRST: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
               EVEN: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < left
    d = _ld(_ptr(row, _G, start, G_DTYPE, ALIGNED), offs, mask, EVEN).to(tl.float32)
    w = _load_weight(row, start, offs, mask, P_DTYPE, HAS_MASTER, False, ALIGNED, EVEN)
    if DECAY:
        d = d + w * wd
    if MOMENTUM:
        buf_ptr = _ptr(row, _M, start, tl.float32, ALIGNED)
        if FIRST:
            buf = d
        else:
            buf = _ld(buf_ptr, offs, mask, EVEN) * mom + d * omd
        _st(buf_ptr, offs, buf, mask, EVEN)
        if NESTEROV:
            d = d + buf * mom
        else:
            d = buf
    if DECAY_AFTER:
        d = d + w * wd
    w = w - d * lr
    _store_weight(row, start, offs, mask, w, P_DTYPE, HAS_MASTER, False, FP8_MAX, ALIGNED, EVEN)


@triton.jit
def _sgd_kernel(table_ptr, chunks_ptr, hp_ptr,
                P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                FP8_MAX: tl.constexpr, DECAY: tl.constexpr, DECAY_AFTER: tl.constexpr,
                MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr,
                ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, start, left = _chunk(table_ptr, chunks_ptr, CHUNK)
    lr = tl.load(hp_ptr + 0)
    mom = tl.load(hp_ptr + 1)
    omd = tl.load(hp_ptr + 2)
    wd = tl.load(hp_ptr + 3)
    for i in range(0, CHUNK, BLOCK):
        if left - i >= BLOCK:
            _sgd_block(row, start + i, left - i, lr, mom, omd, wd, P_DTYPE, G_DTYPE, HAS_MASTER,
                       FP8_MAX, DECAY, DECAY_AFTER, MOMENTUM, NESTEROV, FIRST, ALIGNED, BLOCK,
                       True)
        elif left - i > 0:
            _sgd_block(row, start + i, left - i, lr, mom, omd, wd, P_DTYPE, G_DTYPE, HAS_MASTER,
                       FP8_MAX, DECAY, DECAY_AFTER, MOMENTUM, NESTEROV, FIRST, ALIGNED, BLOCK,
                       False)
    _fp8_scale_inv(row, start, FP8_MAX)


_launch_sgd = Launcher(_sgd_kernel)


def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             momentum_buffers: Optional[Sequence[torch.Tensor]],
             masters: Optional[Sequence[torch.Tensor]], fp8_meta: Optional[Sequence],
             hp: torch.Tensor, *, weight_decay: bool, wd_after_momentum: bool, nesterov: bool,
             first: bool, cache: Optional[dict] = None) -> None:
    """See `tritium.ref.sgd.sgd_step`."""
    if not params:
        return
    chunk, block, warps = block_config(not params[0].is_cuda)
    if momentum_buffers is not None and any(b.dtype != torch.float32 for b in momentum_buffers):
        raise ValueError("momentum buffers must be float32")
    tables = build_tables(cache, chunk, params, grads, momentum_buffers, None, masters, fp8_meta)
    if tables is None:
        return
    table, chunks, n_chunks, aligned = tables
    p_dtype = _one({p.dtype for p in params}, "param")
    with on_device(params[0]):
        _launch_sgd(
            (n_chunks,), table, chunks, hp,
            P_DTYPE=TL_DTYPE[p_dtype], G_DTYPE=TL_DTYPE[_one({g.dtype for g in grads}, "grad")],
            HAS_MASTER=masters is not None,
            FP8_MAX=FP8_MAX[p_dtype] if fp8_meta is not None else 0.0,
            DECAY=bool(weight_decay and not wd_after_momentum),
            DECAY_AFTER=bool(weight_decay and wd_after_momentum),
            MOMENTUM=momentum_buffers is not None, NESTEROV=bool(nesterov), FIRST=bool(first),
            ALIGNED=aligned, CHUNK=chunk, BLOCK=block, num_warps=warps, enable_fp_fusion=False)


__all__ = ["sgd_step"]
