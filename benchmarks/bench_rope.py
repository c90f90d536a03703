"""Rotary position embedding of q and k, forward and forward+backward: tritium vs eager torch,
torch.compile and Liger.

Case: Llama-style GQA at s 4096, b 2: q [4096, 2, 32, 128] and k [4096, 2, 8, 128], bf16, freqs
[4096, 1, 1, 128] fp32 from `RotaryPositionEmbedding(128)` made once outside the timed step (as
a model does once per step for all layers). Variants:
  * torch copy              clone of q and k: the bandwidth reference (read + write, no math);
  * torch eager             HF's form q * cos + rotate_half(q) * sin with cos/sin [s, 1, 1, d]
                            bf16 tables made once outside the step (as HF does per forward);
  * torch.compile           the same function compiled;
  * tritium                 `apply_rotary_pos_emb(q, freqs)` and (k, freqs), contiguous sbhd
                            (includes the fp32 cos/sin of freqs, computed once per freqs tensor);
  * tritium fused-QKV views q and k as strided views of one [s, b, 48, 128] projection output
                            (no copy);
  * liger                   `LigerRopeFunction.apply(q, k, cos, sin)` on [b, h, s, d] views of
                            bshd tensors (its layout; in place; optional import).
GB/s counts the minimum traffic of a fused implementation: forward reads q, k and writes them
once; backward reads dq, dk and writes them once (bf16); `copy_frac` is GB/s over the copy's.
Needs CUDA; without it the script says so and exits. About 10-20 s of GPU time (plus compile).
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, peak_mem_mb, time_ms  # noqa: E402

S, B, HQ, HKV, D = 4096, 2, 32, 8, 128


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _eager(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _variants(freqs):
    """(variant, fn(q, k) -> (q_out, k_out), layout) with layout 'sbhd', 'qkv' or 'bhsd'."""
    from tritium.attention.rope import apply_rotary_pos_emb
    ang = freqs.reshape(S, 1, 1, D)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    yield "torch eager", lambda q, k: _eager(q, k, cos, sin), "sbhd"
    compiled = torch.compile(_eager)
    yield "torch.compile", lambda q, k: compiled(q, k, cos, sin), "sbhd"
    def ours(q, k):
        return apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
    yield "tritium", ours, "sbhd"
    yield "tritium fused-QKV views", ours, "qkv"
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        lc, ls = cos.reshape(1, S, D), sin.reshape(1, S, D)

        def liger(q, k):
            out = LigerRopeFunction.apply(q, k, lc, ls)  # (q, k) or (q, k, cos, sin) by version
            return out[0], out[1]
        yield "liger LigerRopeFunction", liger, "bhsd"
    except Exception as exc:  # peer missing: record, don't crash
        yield "liger LigerRopeFunction", exc, "bhsd"


def _inputs(layout):
    """Leaf q, k (requiring grad) and upstream grads in the variant's layout."""
    if layout == "qkv":
        qkv = torch.randn(S, B, HQ + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
        q, k = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HKV]
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        return q, k, torch.randn_like(q), torch.randn_like(k)
    if layout == "bhsd":  # [b, h, s, d] views of contiguous bshd tensors (Liger's convention)
        q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        return q, k, torch.randn_like(q.transpose(1, 2)).transpose(1, 2), \
            torch.randn_like(k.transpose(1, 2)).transpose(1, 2)
    q = torch.randn(S, B, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(S, B, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return q, k, torch.randn_like(q), torch.randn_like(k)


def _row(case, variant, ms, nbytes, copy_gbps=None, **extra):
    gbps = nbytes / ms / 1e6
    row = {"case": case, "variant": variant, "ms": round(ms, 4), "gbps": round(gbps)}
    if copy_gbps:
        row["copy_frac"] = round(gbps / copy_gbps, 3)
    return {**row, **extra}


def _bench():
    from tritium.attention.rope import RotaryPositionEmbedding
    freqs = RotaryPositionEmbedding(D)(S)
    elems = S * B * (HQ + HKV) * D
    q0, k0, _, _ = _inputs("sbhd")
    q0, k0 = q0.detach(), k0.detach()
    for with_bwd in (False, True):
        case = f"rope q{[S, B, HQ, D]}+k{[S, B, HKV, D]} bf16 {'fwd+bwd' if with_bwd else 'fwd'}"
        nbytes = (4 if with_bwd else 2) * elems * 2
        copy_ms = time_ms(lambda: (q0.clone(), k0.clone()))
        copy_gbps = 2 * elems * 2 / copy_ms / 1e6
        yield _row(case, "torch copy", copy_ms, 2 * elems * 2, copy_gbps)
        for variant, fn, layout in _variants(freqs):
            if isinstance(fn, Exception):
                yield {"case": case, "variant": variant, "error": repr(fn)}
                continue
            q, k, dq, dk = _inputs(layout)

            def step(fn=fn, q=q, k=k, dq=dq, dk=dk):
                if not with_bwd:
                    with torch.no_grad():
                        return fn(q, k)
                q.grad = k.grad = None
                yq, yk = fn(q, k)
                torch.autograd.backward([yq, yk], [dq, dk])
            try:
                step(); step()
                ms = time_ms(step)
                extra = {"peak_mb": round(peak_mem_mb(step), 1)} if with_bwd else {}
            except Exception as exc:
                yield {"case": case, "variant": variant, "error": repr(exc)}
                continue
            yield _row(case, variant, ms, nbytes, copy_gbps, **extra)
            del q, k, dq, dk
        torch.cuda.empty_cache()


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_rope: needs a CUDA GPU; none is available here")
    rows = []
    for row in _bench():
        rows.append(row)
        print(row, flush=True)
    finish("rope", rows, baseline="torch eager")


if __name__ == "__main__":
    main()
