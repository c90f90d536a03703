"""Measure context-parallel attention against an fp64 reference, next to single-device attention.

Run on every rank of a CP group (gloo on CPU, NCCL on GPUs); rank 0 gets the rows. Every rank
draws the same full-sequence q, k, v, dout (one seed), shards them (layout.shard), runs
`context_parallel_attention` + backward in each configuration, and all_gathers out, dq, dk, dv
back to full sequences. Rank 0 also runs single-device `dot_product_attention` on the full
sequence (the same backend choice a non-CP model would get: the reference on CPU, cuDNN on
Hopper) and the fp64 reference (tritium.ref.attention on fp64 copies of the same 16-bit
values, one KV head group at a time to bound memory).

Per tensor (out, dq, dk, dv) and configuration: `max_abs` = max |x - ref64|; `rms` = the root
mean square of x - ref64; `frac_fp32` = fraction of elements outside fp32 tolerance of ref64
(|x - r| > 1e-5 + 1.3e-6 |r|, TE's fp32 tolerance); `ratio` = max_abs / the single-device
max_abs, `rms_ratio` likewise (the outputs are 16-bit, so their last rounding dominates both:
max_abs is one element's, which side of a rounding midpoint it fell on, and moved 0.8-1.6x
between seeds where two results are equally accurate; rms averages that out); `vs_single` =
fraction of elements where x and the single-device result differ beyond fp32 tolerance (the
metric of TE's fp32 accumulation PR: 41-62% for bf16 accumulation). Used by
tests/test_context_parallel.py, tests/gpu/test_gpu_context_parallel.py, scripts/cp_accuracy.py
and benchmarks/bench_cp.py.
"""
from __future__ import annotations

import torch

from ...ref import attention as ref_attention
from .. import masks as M
from ..dot_product_attention import dot_product_attention
from . import context_parallel_attention, gather_unshard, resolve_group, shard

NAMES = ("out", "dq", "dk", "dv")
FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5
# (label, cp_comm_type, mode, fp32_accumulation)
CONFIGS = (("exact, fp32 acc", "p2p", "exact", True),
           ("fp32 partials, fp32 acc", "p2p", "fp32_partials", True),
           ("fast, fp32 acc", "p2p", "fast", True),
           ("fast, 16-bit acc", "p2p", "fast", False),
           ("exact, 16-bit acc", "p2p", "exact", False),
           ("all_gather, exact, fp32 acc", "all_gather", "exact", True))


def make_inputs(b, s, h, hk, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=g) for n in (h, hk, hk, h))
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, dout))


def reference64(q, k, v, dout, causal, scale):
    """fp64 out, dq, dk, dv (bshd), one KV head at a time (its query heads with it)."""
    b, s, h, _ = q.shape
    hk, groups = k.shape[2], h // k.shape[2]
    mask = M.dense_mask(b, s, s, q.device, causal=causal, bottom_right=False, left=-1,
                        right=0 if causal else -1)
    res = [torch.empty(x.shape, dtype=torch.float64, device=x.device) for x in (q, q, k, v)]
    for j in range(hk):
        hq = slice(j * groups, (j + 1) * groups)
        qj, kj, vj, dj = (x.double() for x in (q[:, :, hq], k[:, :, j:j + 1], v[:, :, j:j + 1],
                                                 dout[:, :, hq]))
        out, lse, _ = ref_attention.attention_fwd(qj, kj, vj, mask, scale, out_dtype=None)
        dq, dk, dv = ref_attention.attention_bwd(dj, qj, kj, vj, out, lse, mask, scale)
        res[0][:, :, hq], res[1][:, :, hq] = out, dq
        res[2][:, :, j:j + 1], res[3][:, :, j:j + 1] = dk, dv
        del out, lse, dq, dk, dv
    return res


def _run(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    out = out.view(*out.shape[:-1], q.shape[2], -1)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def single_device(q, k, v, dout, causal, backend="auto"):
    mt = "causal" if causal else "no_mask"
    return _run(lambda a, b_, c: dot_product_attention(a, b_, c, qkv_format="bshd",
                                                       attn_mask_type=mt, backend=backend),
                q, k, v, dout)


def context_parallel(q, k, v, dout, causal, group, comm_type, mode, fp32_acc):
    """Full-sequence inputs in, full-sequence [out, dq, dk, dv] out (every rank)."""
    size, rank, _ = resolve_group(group)
    loc = [shard(x, size, rank, 1) for x in (q, k, v, dout)]
    mt = "causal" if causal else "no_mask"
    res = _run(lambda a, b_, c: context_parallel_attention(
        a, b_, c, group, qkv_format="bshd", attn_mask_type=mt, cp_comm_type=comm_type,
        mode=mode, fp32_accumulation=fp32_acc), *loc)
    return [gather_unshard(x.contiguous(), group, 1) for x in res]


def errors(got, ref64, single=None) -> dict:
    row = {}
    for name, x, r in zip(NAMES, got, ref64):
        diff = (x.double() - r).abs()
        row[name] = {"max_abs": float(diff.max()), "rms": float(diff.square().mean().sqrt()),
                     "frac_fp32": float((diff > FP32_ATOL + FP32_RTOL * r.abs()).double().mean())}
    if single is not None:
        for name, x, s in zip(NAMES, got, single):
            sd = s.double()
            off = (x.double() - sd).abs() > FP32_ATOL + FP32_RTOL * sd.abs()
            row[name]["vs_single"] = float(off.double().mean())
    return row


def measure(group, b=1, s=512, h=4, hk=2, d=64, causal=True, dtype=torch.bfloat16,
            device="cpu", seed=0, configs=CONFIGS):
    """Run on every rank; -> rows on rank 0 ({"config", "out": {...}, ...}), None elsewhere."""
    import torch.distributed as dist
    q, k, v, dout = make_inputs(b, s, h, hk, d, dtype, device, seed)
    results = [(label, context_parallel(q, k, v, dout, causal, group, comm, mode, acc))
               for label, comm, mode, acc in configs]
    if dist.get_rank(group) != 0:
        return None
    scale = d ** -0.5
    ref = reference64(q, k, v, dout, causal, scale)
    single = single_device(q, k, v, dout, causal)
    base = errors(single, ref)
    rows = [dict(config="single device", **base)]
    for label, got in results:
        row = errors(got, ref, single)
        for name in NAMES:
            for stat, ratio in (("max_abs", "ratio"), ("rms", "rms_ratio"),
                                ("frac_fp32", "frac_ratio")):
                row[name][ratio] = row[name][stat] / max(base[name][stat], 1e-30)
        rows.append(dict(config=label, **row))
    return rows


def table(rows, title="") -> str:
    """Markdown table: per tensor max abs error vs fp64, its and the rms error's ratios to
    single device (single device: its rms), frac outside fp32 tolerance, frac differing from
    single device."""
    head = ("| config | " + " | ".join(f"{n} max abs (x single, rms x single) | "
                                      f"{n} off fp32 / vs single"
                                      for n in NAMES) + " |")
    lines = ([f"**{title}**", ""] if title else []) + [head,
                                                        "|---" * (1 + 2 * len(NAMES)) + "|"]
    for r in rows:
        cells = []
        for n in NAMES:
            e = r[n]
            ratio = (f" (x{e['ratio']:.2f}, rms x{e['rms_ratio']:.3f})" if "ratio" in e
                     else f" (rms {e['rms']:.2e})")
            vs = f" / {e['vs_single'] * 100:.1f}%" if "vs_single" in e else ""
            cells += [f"{e['max_abs']:.2e}{ratio}", f"{e['frac_fp32'] * 100:.1f}%{vs}"]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["measure", "table", "reference64", "single_device", "context_parallel", "errors",
           "make_inputs", "CONFIGS", "NAMES"]
