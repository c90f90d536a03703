"""tritium's Triton flash attention (tritium/kernels/flash_attention.py: 16-bit q/k/v in, fp32
out/lse/dq/dk/dv out; the block kernel of context-parallel exact mode) vs SDPA cuDNN, one GPU.

Cases: B1 H12 D128 bf16 causal at S=8192 and 32768, plus "cp2 rank S=32768": the blocks one rank
computes in a cp=2 causal p2p ring at S=32768 (local L=16384: a causal [L, L] block and a no-mask
[L/2, L] or [L, L/2] block; timed as the sum of both) -- the number to compare with single-GPU
cuDNN at S=32768 (exact mode is faster than one GPU when it is below that row's cuDNN time).
Variants: "sdpa cudnn" (baseline), "tritium flash split" (the default, what CP exact runs),
"tritium flash nosplit" (P/dS rounded once to bf16: the price of the split). TFLOP/s count
useful FLOPs (causal half; fwd+bwd = 3.5x fwd).

    python benchmarks/bench_flash_attention.py                 # the table (JSON to $OUT)
    python benchmarks/bench_flash_attention.py --sweep         # block configs at S=8192
    python benchmarks/bench_flash_attention.py --cfg fwd=128,128,8,3 --cfg dkdv=32,128,4,3
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, time_ms  # noqa: E402

from tritium.kernels import flash_attention as FA  # noqa: E402

B, H, D = 1, 12, 128


def _sdpa(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


def _tensors(s_q, s_kv, g):
    mk = lambda s: torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=g)
    return mk(s_q), mk(s_kv), mk(s_kv), mk(s_q)


def _steps(blocks, variant):
    """blocks: [(q, k, v, dout, causal)] -> (fwd, fwd_bwd) callables over all blocks."""
    scale = 1 / math.sqrt(D)
    if variant == "sdpa cudnn":
        leaves = [[t.detach().requires_grad_() for t in blk[:3]] + list(blk[3:]) for blk in blocks]

        def fwd():
            with torch.no_grad():
                for q, k, v, _, c in leaves:
                    _sdpa(q, k, v, c)

        def fwd_bwd():
            for q, k, v, do, c in leaves:
                for t in (q, k, v):
                    t.grad = None
                _sdpa(q, k, v, c).backward(do)
        return fwd, fwd_bwd
    split = variant.endswith(" split")

    def fwd():
        for q, k, v, _, c in blocks:
            FA.flash_attention_fwd(q, k, v, c, scale, split=split)

    def fwd_bwd():
        for q, k, v, do, c in blocks:
            out, lse = FA.flash_attention_fwd(q, k, v, c, scale, split=split)
            FA.flash_attention_bwd(do, q, k, v, out, lse, c, scale, split=split)
    return fwd, fwd_bwd


def _cases(seqs, g):
    for s in seqs:
        yield f"B{B} H{H} S{s} D{D} causal", [(*_tensors(s, s, g), True)], FA.flops(B, s, s, H, D, True)
    s = 32768
    L = s // 2
    q, k, v, do = _tensors(L, L, g)
    # ring step 1 on rank 0: second half of q vs all KV; rank 1: all q vs the first half of KV
    # (same FLOPs); timed as rank 0's blocks
    blocks = [(q, k, v, do, True), (q[:, L // 2:], k, v, do[:, L // 2:], False)]
    fl = FA.flops(B, L, L, H, D, True) + FA.flops(B, L // 2, L, H, D, False)
    yield f"cp2 rank S{s} D{D} causal", blocks, fl


def _run(rows, variants, seqs):
    g = torch.Generator(device="cuda").manual_seed(0)
    for case, blocks, flops in _cases(seqs, g):
        for variant in variants:
            fwd, fwd_bwd = _steps(blocks, variant)
            for mode, step, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fwd_bwd, 3.5)):
                try:
                    step()
                    ms = time_ms(step)
                    rows.append({"case": f"{case} {mode}", "variant": variant,
                                 "ms": round(ms, 4), "tflops": round(mult * flops / ms / 1e9, 1)})
                except Exception as exc:  # record and go on
                    rows.append({"case": f"{case} {mode}", "variant": variant,
                                 "error": repr(exc)})
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()


def _set_cfg(spec: str):
    kind, _, vals = spec.partition("=")
    cfg = tuple(int(x) for x in vals.split(","))
    assert kind in FA.GPU_CFG and len(cfg) == 4, spec
    FA.GPU_CFG[kind][D] = cfg


SWEEP = {  # around the D=128 defaults (the first entry of each list)
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 3),
            (128, 64, 8, 3), (128, 128, 8, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2),
             (64, 128, 8, 2)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 3),
           (128, 64, 8, 2)],
}


def sweep():
    """Each kernel's candidate configs at S=8192 causal (the others at their defaults)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = _tensors(8192, 8192, g)
    scale = 1 / math.sqrt(D)
    out, lse = FA.flash_attention_fwd(q, k, v, True, scale)
    for kind, cands in SWEEP.items():
        keep = FA.GPU_CFG[kind][D]
        for cfg in cands:
            FA.GPU_CFG[kind][D] = cfg
            step = ((lambda: FA.flash_attention_fwd(q, k, v, True, scale)) if kind == "fwd" else
                    (lambda: FA.flash_attention_bwd(do, q, k, v, out, lse, True, scale)))
            try:
                step()
                print(f"{kind} {cfg}: {time_ms(step):.3f} ms "
                      f"({'fwd' if kind == 'fwd' else 'delta+dkdv+dq'})", flush=True)
            except Exception as exc:
                print(f"{kind} {cfg}: ERROR {exc!r}"[:200], flush=True)
        FA.GPU_CFG[kind][D] = keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--cfg", action="append", default=[],
                    help="kind=BLOCK_M,BLOCK_N,warps,stages (kind: fwd, dkdv, dq), for D=128")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_flash_attention: needs a CUDA GPU; nothing timed")
    for spec in args.cfg:
        _set_cfg(spec)
    if args.sweep:
        return sweep()
    rows = []
    _run(rows, ["sdpa cudnn", "tritium flash split", "tritium flash nosplit"], args.seq)
    finish("flash_attention", rows, baseline="sdpa cudnn")


if __name__ == "__main__":
    main()
