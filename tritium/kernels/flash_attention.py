"""Triton flash attention: 16-bit q/k/v in; fp32 partial results for the exact mode of
context-parallel attention (tritium/attention/cp/merge.py), or 16-bit results (the speed mode,
what an attention backend returns).

Twin: `tritium.ref.flash_attention` (same names and signatures, plain fp32 math). Contract:
  * q [b, s_q, h, d], k/v [b, s_kv, h_kv, d] (bshd, any strides, d a power of two <= 128, or
    256 for the forward alone, d_v == d_qk), h % h_kv == 0, query head i reads kv head
    i // (h // h_kv) (K/V are never repeated). fp16, bf16 or fp32.
  * causal = top-left (key j visible to query i iff j <= i), any s_q / s_kv; else no mask.
    `band` (lo, hi) instead: key j visible to query i iff lo <= j - i <= hi (sliding windows,
    bottom-right alignment: the attention layer's window (left, right) with its diagonal offset
    o is (o - left, o + right)); each row block visits only the key blocks the band reaches
    (masked where it cuts a block), each key block of the backward only the query blocks.
  * `varlen` (cu_q, cu_kv, max_s_q, max_s_kv): packed sequences (thd), q [t_q, h, d], k / v
    [t_kv, h_kv, d]; grid axis 1 runs (sequence, head), each program moves its pointers to its
    sequence's first rows (int32 cumulative lengths read on the device: no host sync) and
    exits past the sequence's end; masks and bands apply within each sequence; pointer loads
    (a TMA box would need per-sequence descriptors); lse [h, t_q].
  * forward -> out [b, s_q, h, d] in out_dtype (None = fp32, never rounded to 16 bits; or the
    input dtype, rounded once), lse fp32 [b, h, s_q] (natural log). backward(dout, q, k, v,
    out, lse) -> dq, dk, dv shaped like q, k, v in grad_dtype (same choice). The backward is
    FlashAttention-2's: P = exp(S - lse), D = rowsum(dO * out), dS = P * (dO v^T - D); it only
    needs an (out, lse) pair of the same softmax rows, so context parallelism passes the merged
    out/lse of the whole ring, not this block's own. GQA sums dk/dv over a group in fp32,
    inside one program.

On Hopper the speed mode runs `flash_attention_sm90` / `_sm90_bwd` (Gluon, warp-specialized:
forward, dK/dV, dQ; `_sm90_bwd_fused`, one backward kernel, but for causal GQA) where their
`applies()` holds (TMA-readable bshd or sbhd memory, d = 128, no band; 16-bit or fp32
outputs: the latter what CP's fp32_partials blocks take).
The kernels themselves (device code, `flash_attention_tiles`): precision (the SPLIT head / tail
products), tiling, the band and packed-sequence walks, the FP8 forward's P quantization.
This module is the host side: launch configs, operand checks and layouts, the launchers.

Launch options (`Cfg`, per kernel and (head dim, split) in GPU_CFG; benchmarks/
bench_flash_attention.py --sweep picks them on a GPU): tile sizes, warps, pipeline stages,
q/k/v/dO loaded through TMA descriptors of their [b, s, h * d] views (where the layout allows:
unit-stride d, packed heads, 16-byte aligned strides; pointer loads otherwise: their address
tiles cost registers, a 128 x 128 forward tile spills on sm90 without TMA), and
`tl.range(warp_specialize=True)` on the forward's unmasked loop (with TMA; Triton 3.6 compiles
it for sm90 at 8 warps, not at 4).
Deliberately not here: dropout, padding masks, packed sequences in the FP8 forward, autotuning
at run time (configs are fixed per shape class so launches stay cheap).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import flash_attention_sm90 as sm90, flash_attention_sm90_bwd as sm90_bwd
from . import flash_attention_sm90_bwd_fused as sm90_bwd_fused
from .cast import amax_into
from .flash_attention_tiles import LOG2E, _delta_kernel, _dkdv_kernel, _dq_kernel, _fwd_kernel


# --------------------------------------------------------------------------------------------
# launchers

_HEAD_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Cfg(NamedTuple):
    """One kernel's launch: tile sizes, warps, pipeline stages, q/k/v/dO loads through TMA
    descriptors, warp specialization of the forward's unmasked loop (fwd, with tma), dq by fp32
    atomic adds from the dk/dv kernel instead of the dq kernel (dkdv)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    ws: bool = False
    atomic_dq: bool = False


# per kernel, by (head dim, split), on the GPU; tuning code (benchmarks/bench_flash_attention.py
# --cfg / --sweep) may replace entries. D=128 from two sweeps on H100s (2026-11-28, B4 H32 S4096
# MHA, causal + no mask summed; the speed mode's first). split=False (the speed mode): forward
# 128 x 128 at 8 warps, 3 stages (3.21 -> 2.90 ms; 128 x 64, chosen before any timing by
# scripts/flash_regs.py: 169 registers); dk/dv 64 keys x 64 query rows at 4 warps, 2 stages
# (12.85 -> 9.85 ms with delta and dq; it spills 328 bytes, 128 keys x 32 rows 100); dq 128 x 64
# at 8 warps, 3 stages (4 stages: first in one sweep, 4% behind in the other); dq by atomic adds
# from dk/dv lost at every tile (12.6+ ms; 11.9-12.9 with one TMA bulk reduce-add per tile, so
# not the atomics' cost: the fused kernel's registers). Grouped launch orders (g heads' tiles
# interleaved, busiest first; g = 4 / 8 / 16) stayed within the runs' +-3% spread for every
# kernel in two sweeps: removed (commit 046d7e2 has them). Causal-only tiles (H200, 2026-11-28,
# a0bac81, reverted): per mask the forward's and dk/dv's causal bests are the no-mask ones; dq
# at 4 stages read 3.53 -> 3.28 ms of causal backward in one sweep, but the table after it
# measured causal fwd+bwd 4.64 / 4.82 ms (MHA / GQA-8) against 4.71 / 4.78 before: no gain.
# split=True: the tiles of a sweep of pointer loads (2026-11-22, one CP=2 rank's blocks at
# S=32768: 22.4 -> 19.7 ms), now with TMA loads, 1.02-1.07x faster on every case of the table
# (the CP=2 rank's fwd+bwd 19.32 -> 18.05 ms). Two rules: 8 warps need >= 128 rows in every
# product's output (BLOCK_M of the forward and dq, BLOCK_N of dk/dv: S^T is [BLOCK_N,
# BLOCK_M]), else Triton lays 8 warps along 64 rows and the second warpgroup repeats the
# first's wgmma; and pointer loads cost registers (address tiles; a 128 x 128 forward tile
# spills on sm90 without TMA). D=64: forward 128 x 128 161 registers, dk/dv 241, dq 123, none
# spilling (not yet swept). D=256 forward 128 x 64: 572 bytes spilled.
GPU_CFG = {
    "fwd": {(128, True): Cfg(64, 64, 4, 3, tma=True),
            (128, False): Cfg(128, 128, 8, 3, tma=True),
            (64, True): Cfg(128, 64, 4, 3), (64, False): Cfg(128, 128, 8, 3, tma=True),
            (256, True): Cfg(64, 32, 4, 2), (256, False): Cfg(128, 64, 8, 2, tma=True)},
    "dkdv": {(128, True): Cfg(64, 64, 4, 2, tma=True),
             (128, False): Cfg(64, 64, 4, 2, tma=True),
             (64, True): Cfg(64, 128, 8, 2), (64, False): Cfg(64, 128, 8, 2, tma=True)},
    "dq": {(128, True): Cfg(128, 64, 8, 4, tma=True), (128, False): Cfg(128, 64, 8, 3, tma=True),
           (64, True): Cfg(128, 64, 8, 2), (64, False): Cfg(128, 64, 8, 3, tma=True)},
}
# FP8 forward by (head dim, causal), from sweeps on H100s (B4 H32 S4096, V keys-contiguous):
# at D=128 128 x 128 tiles with 4 warps run 785 TFLOPS without a mask (2026-11-26; 128 x 64 at
# 8 warps, the bf16 speed mode's tiles: 572); causal runs 64 x 128 (three sweeps of 2026-11-28:
# 0.732 / 0.741 / 0.734 ms against 0.830 / 0.826 / 0.828 at 128 x 128; without a mask 128 x 128
# took 1.319 / 1.321 / 1.332 ms, 64 x 128 1.409 / 1.284 / 1.314). Grouped launch orders
# (within 3%), 2 stages, 8 warps, 4 stages: no gain; warp specialization at 4 warps does not
# compile (Triton 3.6's NVGPUWarpSpecialization pass fails). Every entry of a head dim keeps
# one block_n: the twin quantizes P at the key tile's running maxima (`fp8_block_n`). D=64:
# 128 x 128 (not swept causal).
GPU_CFG["fwd_fp8"] = {(128, True): Cfg(64, 128, 4, 3, tma=True),
                      (128, False): Cfg(128, 128, 4, 3, tma=True),
                      (64, True): Cfg(128, 128, 4, 3, tma=True),
                      (64, False): Cfg(128, 128, 4, 3, tma=True)}
# the interpreter: small tiles (tail masks exercised at s = 16..48); tests may set tma=True
INTERP_CFG = Cfg(16, 16, 4, 1)


def _cfg(kind: str, d: int, split: bool, device_is_cuda: bool) -> Cfg:
    if not device_is_cuda:
        return INTERP_CFG
    table = GPU_CFG[kind]
    return table.get((d, split)) or table[(128 if d > 64 else 64, split)]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = True) -> bool:
    """Can this kernel run these bshd tensors? (dtype, head dims, GQA ratio); backward=False:
    the forward alone (which also takes head dim 256)."""
    dims = _HEAD_DIMS if backward else _HEAD_DIMS + (256,)
    return (q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in dims and k.shape[-1] == q.shape[-1]
            and v.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0] == v.shape[0]
            and k.shape[1] == v.shape[1] and k.shape[2] == v.shape[2]
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def deterministic(q: torch.Tensor, split: bool) -> bool:
    """Is the backward for q's head dim and device bit-reproducible (no atomic dq)?"""
    return not _cfg("dkdv", q.shape[-1], split, q.is_cuda).atomic_dq


def _check(q, k, v, out_dtype, name, backward=True):
    if not supported(q, k, v, backward):
        dims = _HEAD_DIMS if backward else _HEAD_DIMS + (256,)
        raise ValueError(f"flash_attention: unsupported q{tuple(q.shape)} {q.dtype}, "
                         f"k{tuple(k.shape)} {k.dtype}, v{tuple(v.shape)} {v.dtype} (bshd, same "
                         f"dtype in {_DTYPES}, head dim in {dims}"
                         f"{'' if backward else ' (forward)'}, d_v == d_qk, h % h_kv == 0)")
    if out_dtype not in (None, torch.float32, q.dtype):
        raise ValueError(f"flash_attention: {name}={out_dtype} must be None, torch.float32 or "
                         f"the input dtype {q.dtype}")
    return out_dtype or torch.float32


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _srcs(cfg: Cfg, *tensors):
    """(q, k, v[, dout]) as the kernels read them: with cfg.tma and a TMA-compatible layout for
    all (unit-stride d, heads packed, 16-byte aligned base and strides), TMA descriptors of
    each's [b, s, h * d] view with [1, rows, d] boxes (q / dout: block_m rows, k / v: block_n);
    else the tensors themselves (pointer loads). -> (sources, tma)."""
    descs = []
    for i, x in enumerate(tensors):
        b, s, h, d = x.shape
        sb, ss, sh, sd = x.stride()
        esz = x.element_size()
        if not (cfg.tma and sd == 1 and (sh == d or h == 1) and (sb * esz) % 16 == 0
                and (ss * esz) % 16 == 0 and x.data_ptr() % 16 == 0):
            return tensors, False
        rows = cfg.block_n if i in (1, 2) else cfg.block_m
        descs.append(TensorDescriptor(x, [b, s, h * d], [sb, ss, 1], [1, rows, d]))
    return tuple(descs), True


def _band(band, causal: bool, s_q: int, s_kv: int):
    """(WINDOW, CAUSAL, band_lo, band_hi) for the kernels: a band (lo, hi), None sides
    unbounded, key j visible to query i iff lo <= j - i <= hi, causal folded in as hi <= 0."""
    if band is None:
        return False, bool(causal), 0, 0
    lo, hi = band
    reach = s_q + s_kv  # past every key: unbounded
    lo = -reach if lo is None else max(int(lo), -reach)
    hi = reach if hi is None else min(int(hi), reach)
    if causal:
        hi = min(hi, 0)
    return True, False, lo, hi


class _Layout(NamedTuple):
    """A call's sequences: `batch` dense ones of (s_q, s_kv) rows, or (varlen) cu_q / cu_kv's
    packed ones, s_q / s_kv their longest, the tensors [t, h, d] seen as [1, t, h, d]."""
    batch: int
    s_q: int
    s_kv: int
    cu_q: Optional[torch.Tensor]
    cu_kv: Optional[torch.Tensor]


def _layout(q, k, varlen) -> _Layout:
    if varlen is None:
        return _Layout(q.shape[0], q.shape[1], k.shape[1], None, None)
    cu_q, cu_kv, s_q, s_kv = varlen
    for name, cu, t in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_kv", cu_kv, k.shape[0])):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != cu_q.numel() \
                or cu.device != q.device:
            raise ValueError(f"flash_attention: {name} must be int32 [batch + 1] on {q.device} "
                             "(the same batch for q and kv)")
    return _Layout(cu_q.numel() - 1, int(s_q), int(s_kv), cu_q, cu_kv)


def _batched(varlen, *tensors):
    """thd tensors [t, h, d] as [1, t, h, d] (dense ones as they are)."""
    return tensors if varlen is None else tuple(x.unsqueeze(0) for x in tensors)


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, split: bool = True,
                        out_dtype: Optional[torch.dtype] = None, band: Optional[tuple] = None,
                        varlen: Optional[tuple] = None):
    """-> (out [b, s_q, h, d] in out_dtype (None: fp32), lse fp32 [b, h, s_q], natural log).
    band (lo, hi): key j visible to query i iff lo <= j - i <= hi (a None side unbounded; with
    causal also j <= i): sliding windows and bottom-right alignment; only its key blocks run.
    varlen (cu_q, cu_kv, max_s_q, max_s_kv): packed sequences (thd): q [t_q, h, d], k / v
    [t_kv, h_kv, d], int32 cumulative lengths; masks and bands apply within each sequence;
    -> out [t_q, h, d], lse [h, t_q]."""
    lay = _layout(q, k, varlen)
    q, k, v = _batched(varlen, q, k, v)
    out_dtype = _check(q, k, v, out_dtype, "out_dtype", backward=False)
    b, t_q, h, d = q.shape
    t_kv, h_kv = k.shape[1], k.shape[2]
    if not split and band is None and varlen is None and sm90.applies(q, k, v, out_dtype):
        return sm90.flash_attention_fwd(q, k, v, causal, scale, out_dtype)  # Hopper: Gluon
    window, causal, band_lo, band_hi = _band(band, causal, lay.s_q, lay.s_kv)
    out = torch.empty(b, t_q, h, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h, t_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or t_kv == 0 or lay.batch == 0:
        out, lse = out.zero_(), lse.fill_(float("-inf"))
    else:
        cfg = _cfg("fwd", d, split, q.is_cuda)
        srcs, tma = (q, k, v), False
        if varlen is None:
            srcs, tma = _srcs(cfg, q, k, v)
        grid = (triton.cdiv(lay.s_q, cfg.block_m), lay.batch * h)
        _fwd_kernel[grid](*srcs, out, lse, lse, lay.s_q, lay.s_kv, h, h // h_kv, scale * LOG2E,
                          *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
                          band_lo, band_hi, lay.cu_q if varlen else lse,
                          lay.cu_kv if varlen else lse, *_no_fp8_out(lse),
                          CAUSAL=causal, SPLIT=bool(split),
                          PREC=_prec(q.dtype), D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          TMA=tma, WS=cfg.ws and tma, WINDOW=window, VARLEN=varlen is not None,
                          num_warps=cfg.warps, num_stages=cfg.stages)
    return (out, lse) if varlen is None else (out[0], lse[0])


FP8_HEAD_DIMS = (64, 128)
FP8_DTYPES = (torch.float8_e4m3fn,)


def flash_attention_fwd_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float, out: torch.Tensor, lse: torch.Tensor, row0: int,
                              out16: Optional[torch.Tensor] = None) -> bool:
    """The speed mode's fp32 partial of q's rows against k / v merged in place into a running
    fp32 (out, lse) at rows row0.. by the Hopper kernel's epilogue (a CP rank's steps; twin:
    `tritium.ref.flash_attention.flash_attention_fwd_merge`): True where that kernel runs this
    call; False where it does not, and nothing is written (the caller merges itself)."""
    if not sm90.applies(q, k, v, torch.float32):
        return False
    sm90.flash_attention_fwd_merge(q, k, v, causal, scale, out, lse, row0, out16)
    return True


def fp8_block_n(d: int, device_is_cuda: bool) -> int:
    """The FP8 forward's key tile (the twin's block_n) for head dim d (one for both masks)."""
    return _fp8_cfg(d, False, device_is_cuda).block_n


def _fp8_cfg(d: int, causal: bool, device_is_cuda: bool) -> Cfg:
    if not device_is_cuda:
        return INTERP_CFG
    cfg = GPU_CFG["fwd_fp8"][(d, causal)]
    if cfg.block_n != GPU_CFG["fwd_fp8"][(d, not causal)].block_n:
        raise ValueError(f"GPU_CFG['fwd_fp8'] at head dim {d}: causal and no-mask entries must "
                         "share block_n (the twin's P quantization follows the key tile)")
    return cfg


def fp8_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can the FP8 forward run these bshd E4M3 tensors? (head dim 64/128, GQA ratio)"""
    return (q.dim() == k.dim() == v.dim() == 4 and q.dtype in FP8_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[-1] in FP8_HEAD_DIMS
            and k.shape[-1] == q.shape[-1] == v.shape[-1] and q.shape[0] == k.shape[0]
            and k.shape == v.shape and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def _no_fp8_out(dummy: torch.Tensor) -> tuple:
    """The forward kernel's E4M3-output arguments (pointer, 4 strides, scale, amax) where it
    writes none (O8=False: never read)."""
    return (dummy, 0, 0, 0, 0, dummy, dummy)


class FP8Out(NamedTuple):
    """The FP8 forward's E4M3 output (fp8_mha): `scale` fp32 [1] (out is multiplied by it,
    saturated to +-448 and rounded once from fp32), `amax` fp32 [1] or None (max|out|
    max-recorded there: each program writes its own max, one small launch reduces them),
    `seq_first`: the E4M3 out's memory is [s, b, h, d] (an sbhd caller's [s, b, h * d] without
    a copy), `keep_hp`: out_dtype's out is written too (the backward's)."""
    scale: torch.Tensor
    amax: Optional[torch.Tensor]
    seq_first: bool = False
    keep_hp: bool = True


def flash_attention_fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            descale: torch.Tensor, causal: bool, scale: float,
                            out_dtype: Optional[torch.dtype] = None,
                            block_n: Optional[int] = None, band: Optional[tuple] = None,
                            fp8_out: Optional[FP8Out] = None):
    """E4M3 q/k/v (bshd, any strides), descale fp32 [3] (q, k, v) -> (out [b, s_q, h, d] in
    out_dtype (None: fp32; or bf16 / fp16), lse fp32 [b, h, s_q]). block_n: the key tile
    (None: `fp8_block_n`); the twin takes the same to quantize P at the same running maxima.
    band: as `flash_attention_fwd`'s (the key blocks the band skips hold no visible key, so P
    is quantized at the same running maxima as the twin's walk over every block).
    fp8_out (`FP8Out`): -> (out or None (keep_hp=False), lse, out8 E4M3 [b, s_q, h, d])."""
    if not fp8_supported(q, k, v):
        raise ValueError(f"flash_attention_fp8_fwd: unsupported q{tuple(q.shape)} {q.dtype}, "
                         f"k{tuple(k.shape)} {k.dtype}, v{tuple(v.shape)} {v.dtype} (bshd E4M3, "
                         f"head dim in {FP8_HEAD_DIMS}, h % h_kv == 0)")
    if (not isinstance(descale, torch.Tensor) or descale.shape != (3,)
            or descale.dtype != torch.float32 or descale.device != q.device):
        raise ValueError("flash_attention_fp8_fwd: descale must be a float32 [3] tensor (q, k, "
                         f"v dequant scales) on {q.device}")
    if out_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"flash_attention_fp8_fwd: out_dtype={out_dtype} must be None, float32, "
                         "bfloat16 or float16")
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    window, causal, band_lo, band_hi = _band(band, causal, s_q, s_kv)
    keep_hp = fp8_out is None or fp8_out.keep_hp
    out = (torch.empty(b, s_q, h, d, dtype=out_dtype or torch.float32, device=q.device)
           if keep_hp else torch.empty_strided((b, s_q, h, d), (0, 0, 0, 0), device=q.device))
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    out8 = None
    if fp8_out is not None:
        for name, t in (("scale", fp8_out.scale), ("amax", fp8_out.amax)):
            if t is not None and (t.numel() != 1 or t.dtype != torch.float32
                                  or t.device != q.device):
                raise ValueError(f"flash_attention_fp8_fwd: fp8_out.{name} must be a float32 "
                                 f"one-element tensor on {q.device}")
        out8 = (torch.empty(s_q, b, h, d, dtype=torch.float8_e4m3fn, device=q.device)
                .transpose(0, 1) if fp8_out.seq_first else
                torch.empty(b, s_q, h, d, dtype=torch.float8_e4m3fn, device=q.device))
    if b * s_q * h * d == 0 or s_kv == 0:
        out.zero_(), lse.fill_(float("-inf"))
        if out8 is not None:
            out8.zero_()
    else:
        cfg = _fp8_cfg(d, causal, q.is_cuda)
        if block_n is not None:
            cfg = cfg._replace(block_n=int(block_n))
        if v.stride(1) != 1 and s_kv > 1:   # P @ V wants V's keys contiguous: one copy here
            v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        (q_src, k_src), tma = _srcs(cfg, q, k)
        v_src = _value_src(cfg, v) if tma else None
        if v_src is None:
            q_src, k_src, v_src, tma = q, k, v, False
        grid = (triton.cdiv(s_q, cfg.block_m), b * h)
        # the amax: one partial max per program, reduced below (one atomic per program on one
        # address cost 0.04-0.055 ms of a 0.78 ms causal call, B4 H32 S4096, H200)
        partial = (torch.empty(grid[0] * grid[1], dtype=torch.float32, device=q.device)
                   if fp8_out is not None and fp8_out.amax is not None else None)
        o8 = (out8, *out8.stride(), fp8_out.scale, lse if partial is None else partial) \
            if out8 is not None else _no_fp8_out(lse)
        _fwd_kernel[grid](q_src, k_src, v_src, out, lse, descale, s_q, s_kv, h, h // h_kv,
                          scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                          *lse.stride(), band_lo, band_hi, lse, lse, *o8, CAUSAL=causal,
                          SPLIT=False, PREC="tf32", D=d, WINDOW=window,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, WS=cfg.ws and tma,
                          FP8=True, VT=True, O8=out8 is not None, O8_AMAX=partial is not None,
                          O_HP=keep_hp, num_warps=cfg.warps, num_stages=cfg.stages)
        if partial is not None:
            amax_into(partial, fp8_out.amax)
    if fp8_out is None:
        return out, lse
    return (out if keep_hp else None), lse, out8


def _value_src(cfg: Cfg, v: torch.Tensor):
    """A TMA descriptor of sequence-contiguous V's [b, h, d, s] view with [1, 1, d, block_n]
    boxes, or None where TMA cannot read it (16-byte aligned base and strides)."""
    b, s, h, d = v.shape
    sb, ss, sh, sd = v.stride()
    esz = v.element_size()
    if ss != 1 or v.data_ptr() % 16 or any((x * esz) % 16 for x in (sb, sh, sd)):
        return None
    return TensorDescriptor(v, [b, h, d, s], [sb, sh, sd, 1], [1, 1, d, cfg.block_n])


def flash_attention_delta(out: torch.Tensor, dout: torch.Tensor,
                          block_m: int = 64) -> torch.Tensor:
    """delta = rowsum(dout * out) in fp32 [b, h, s_q] (out, dout bshd [b, s_q, h, d], any float
    dtypes): what the backward computes first, for a caller that runs several backward blocks
    on the same rows (a CP rank's blocks) and passes its rows to each (`delta=`). block_m: rows
    per program."""
    b, s_q, h, d = out.shape
    if dout.shape != out.shape or d not in _HEAD_DIMS:
        raise ValueError(f"flash_attention_delta: out{tuple(out.shape)} and dout"
                         f"{tuple(dout.shape)} must be the same bshd shape, head dim in "
                         f"{_HEAD_DIMS}")
    delta = torch.empty(b, h, s_q, dtype=torch.float32, device=out.device)
    if delta.numel():
        _delta_kernel[(triton.cdiv(s_q, block_m), b * h)](
            out, dout, delta, s_q, h, *out.stride(), *dout.stride(), D=d, BLOCK_M=block_m,
            num_warps=4 if out.is_cuda else 1)
    return delta


def _check_shared(q, lse, delta, dq_acc):
    """The backward's optional precomputed delta (like lse) and fp32 dq accumulator (like q)."""
    if delta is not None and (delta.shape != lse.shape or delta.dtype != torch.float32
                              or delta.device != q.device):
        raise ValueError(f"flash_attention_bwd: delta must be fp32 shaped like lse "
                         f"{tuple(lse.shape)} on {q.device} (flash_attention_delta of these "
                         f"rows), got {tuple(delta.shape)} {delta.dtype}")
    if dq_acc is not None and (dq_acc.shape != q.shape or dq_acc.dtype != torch.float32
                               or dq_acc.device != q.device):
        raise ValueError(f"flash_attention_bwd: dq_acc must be an fp32 tensor shaped like q "
                         f"{tuple(q.shape)} on {q.device}, got {tuple(dq_acc.shape)} "
                         f"{dq_acc.dtype}")


def _added(dq_acc, grads):
    """grads with dq added into dq_acc (a path whose kernels do not accumulate themselves)."""
    if dq_acc is None:
        return grads
    return (dq_acc.add_(grads[0]), *grads[1:])


def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                        split: bool = True, grad_dtype: Optional[torch.dtype] = None,
                        band: Optional[tuple] = None, varlen: Optional[tuple] = None,
                        delta: Optional[torch.Tensor] = None,
                        dq_acc: Optional[torch.Tensor] = None):
    """-> (dq, dk, dv) in grad_dtype (None: fp32), shaped like q, k, v. out (any float dtype)
    and lse (fp32 [b, h, s_q]; varlen: [h, t_q]) may be any pair for the same softmax rows
    (e.g. a CP ring's merged ones). band, varlen: as the forward's. For a caller that runs
    several blocks on the same query rows (a CP rank): delta, rowsum(dout * out) of these rows
    (`flash_attention_delta`, shaped like lse), is not computed again; dq is added into dq_acc
    (fp32, shaped like q, a row view of a larger buffer is fine) and dq_acc is returned as dq:
    the fused Hopper backward sums into it directly (no zeroed dq of its own, no add)."""
    _check_shared(q, lse, delta, dq_acc)
    lay = _layout(q, k, varlen)
    dout, q, k, v, out = _batched(varlen, dout, q, k, v, out)
    if varlen is not None:
        lse = lse.unsqueeze(0)
        delta = None if delta is None else delta.unsqueeze(0)
    grad_dtype = _check(q, k, v, grad_dtype, "grad_dtype")
    b, t_q, h, h_kv = *q.shape[:3], k.shape[2]
    window, causal, band_lo, band_hi = _band(band, causal, lay.s_q, lay.s_kv)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, h, t_q):
        raise ValueError("flash_attention_bwd: dout/out must be shaped like q and lse "
                         f"{'[h, t_q]' if varlen else '[b, h, s_q]'}")
    if not split and band is None and varlen is None:
        lse = lse.contiguous()      # e.g. a CP block's rows of the merged lse: a small copy
        if sm90_bwd.applies_bwd(q, k, v, out, dout, lse, grad_dtype):   # Hopper: Gluon
            # one kernel (its dq summed by atomics) but for causal GQA, where two kernels win
            if (sm90_bwd_fused.AVAILABLE and (not causal or h == h_kv)
                    and not torch.are_deterministic_algorithms_enabled()):
                return sm90_bwd_fused.flash_attention_bwd(dout, q, k, v, out, lse, causal,
                                                          scale, grad_dtype, delta, dq_acc)
            return _added(dq_acc, sm90_bwd.flash_attention_bwd(dout, q, k, v, out, lse, causal,
                                                               scale, grad_dtype))
    return _added(dq_acc, _triton_bwd(dout, q, k, v, out, lse, causal, scale, split,
                                      grad_dtype, delta, lay, varlen, band_lo, band_hi,
                                      window))


def _triton_bwd(dout, q, k, v, out, lse, causal, scale, split, grad_dtype, delta, lay, varlen,
                band_lo, band_hi, window):
    """flash_attention_bwd's Triton kernels (batched tensors; delta None: computed here)."""
    b, t_q, h, d = q.shape
    t_kv, h_kv = k.shape[1], k.shape[2]
    dev, f32 = q.device, torch.float32
    cuda = q.is_cuda
    dq_cfg, dkdv_cfg = _cfg("dq", d, split, cuda), _cfg("dkdv", d, split, cuda)
    atomic = dkdv_cfg.atomic_dq  # dq summed in fp32 over the key blocks: zeroed first
    dq = torch.empty(b, t_q, h, d, dtype=f32 if atomic else grad_dtype, device=dev)
    dk = torch.empty(b, t_kv, h_kv, d, dtype=grad_dtype, device=dev)
    dv = torch.empty(b, t_kv, h_kv, d, dtype=grad_dtype, device=dev)
    unbatch = (lambda *g: g) if varlen is None else (lambda *g: tuple(x[0] for x in g))
    if atomic or dq.numel() == 0 or dk.numel() == 0 or lay.batch == 0 or varlen is not None:
        dq.zero_()  # varlen: a row block past its sequence's end writes nothing
    if dq.numel() == 0 or dk.numel() == 0 or lay.batch == 0:
        return unbatch(dq.to(grad_dtype), dk.zero_(), dv.zero_())
    if varlen is not None:
        dk.zero_()
        dv.zero_()
    lse = lse.to(f32)
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    delta = (flash_attention_delta(out, dout, dq_cfg.block_m) if delta is None
             else delta.contiguous())
    cu_q, cu_kv = (lay.cu_q, lay.cu_kv) if varlen is not None else (delta, delta)
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), band_lo,
              band_hi, cu_q, cu_kv, t_q)
    flags = dict(CAUSAL=causal, SPLIT=bool(split), PREC=_prec(q.dtype), D=d, WINDOW=window,
                 VARLEN=varlen is not None)

    cfg = dkdv_cfg
    srcs, tma = ((q, k, v, dout), False) if varlen is not None else _srcs(cfg, q, k, v, dout)
    _dkdv_kernel[(triton.cdiv(lay.s_kv, cfg.block_n), lay.batch * h_kv)](
        *srcs, lse, delta, dk, dv, dq, lay.s_q, lay.s_kv, h_kv, h // h_kv,
        scale * LOG2E, scale, *common, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        TMA=tma, ATOMIC_DQ=atomic, num_warps=cfg.warps, num_stages=cfg.stages)
    if atomic:
        return unbatch(dq.to(grad_dtype), dk, dv)

    cfg = dq_cfg
    srcs, tma = ((q, k, v, dout), False) if varlen is not None else _srcs(cfg, q, k, v, dout)
    _dq_kernel[(triton.cdiv(lay.s_q, cfg.block_m), lay.batch * h)](
        *srcs, lse, delta, dq, lay.s_q, lay.s_kv, h, h // h_kv, scale * LOG2E, scale,
        *common, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return unbatch(dq, dk, dv)


def flops(b: int, s_q: int, s_kv: int, h: int, d: int, causal: bool, backward: bool = False):
    """Useful matmul FLOPs (2 per multiply-add; causal counts the visible half)."""
    f = 4.0 * b * h * s_q * s_kv * d * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


__all__ = ["flash_attention_fwd", "flash_attention_fwd_merge", "flash_attention_bwd",
           "flash_attention_delta", "flash_attention_fp8_fwd", "fp8_supported", "fp8_block_n",
           "FP8Out", "supported", "deterministic", "flops", "Cfg", "GPU_CFG"]
