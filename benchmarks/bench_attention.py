"""DotProductAttention forward and forward+backward vs torch SDPA with the cuDNN backend forced
and with the flash backend forced, in the same run; DotProductAttention with auto, flash and
triton (tritium's Triton flash kernel, speed mode) backends.

Cases (bf16, bshd memory layout, the layout SDPA gets as q.transpose(1, 2)):
  B4 H32 S4096 D128 causal and no_mask; Llama-shaped GQA B4 H32 KV8 S4096 D128 causal
  (SDPA with enable_gqa=True). TFLOP/s count 4*B*H*S^2*D for the forward (half of it for
  causal) and 3.5x that for forward+backward, as in BASELINE.md. Each row's ratio is against
  "sdpa cudnn" of the same case. Target: tritium auto >= 0.95x of sdpa cudnn (eager, so the
  per-call Python of backend choice and layout handling counts). A per-call overhead row times a
  tiny problem to show that Python cost on its own.

    python benchmarks/bench_attention.py            # ~1 minute on an H100/H200
Needs CUDA; without it the script says so and exits with status 1.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, time_ms  # noqa: E402

import tritium.attention as A  # noqa: E402

CASES = [("causal", 32, 32), ("no_mask", 32, 32), ("causal", 32, 8)]
B, S, D = 4, 4096, 128


def _sdpa(backend, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    f = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v):
        with sdpa_kernel(kind):
            o = f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                  enable_gqa=gqa)
        return o.transpose(1, 2)
    return run


def _ours(mask, h, hk, backend="auto", d=D):
    mod = A.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd",
                                attn_mask_type=mask, backend=backend)
    return lambda q, k, v: mod(q, k, v)


def _time(rows, case, variant, fn, q, k, v, dout, flops):
    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).reshape(dout.shape).backward(dout)
    for mode, step, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fwd_bwd, 3.5)):
        try:
            step()
            ms = time_ms(step)
            rows.append({"case": f"{case} {mode}", "variant": variant, "ms": round(ms, 4),
                         "tflops": round(mult * flops / ms / 1e9, 1)})
        except Exception as exc:  # a backend that refuses: record it, go on
            rows.append({"case": f"{case} {mode}", "variant": variant, "error": repr(exc)})
        print(rows[-1], flush=True)


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: needs a CUDA GPU and torch sees none; nothing timed")
    rows = []
    for mask, h, hk in CASES:
        causal = mask == "causal"
        case = f"B{B} H{h} KV{hk} S{S} D{D} {mask}"
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda heads: torch.randn(B, S, heads, D, device="cuda", generator=g,  # noqa: E731
                                       dtype=torch.bfloat16).requires_grad_(True)
        q, k, v = mk(h), mk(hk), mk(hk)
        dout = torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16)
        flops = 4 * B * h * S * S * D * (0.5 if causal else 1.0)
        print(A.explain(q, k, v, qkv_format="bshd", attn_mask_type=mask), flush=True)
        variants = [("sdpa cudnn", _sdpa("cudnn", causal, hk != h)),
                    ("sdpa flash", _sdpa("flash", causal, hk != h)),
                    ("tritium auto", _ours(mask, h, hk)),
                    ("tritium flash", _ours(mask, h, hk, "flash")),
                    ("tritium triton", _ours(mask, h, hk, "triton"))]
        for variant, fn in variants:
            _time(rows, case, variant, fn, q, k, v, dout, flops)
        del q, k, v, dout
        torch.cuda.empty_cache()
    # per-call host overhead: a tiny problem, where launch + Python dominate
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    for variant, fn in (("sdpa cudnn", _sdpa("cudnn", True, False)),
                        ("tritium auto", _ours("causal", 4, 4, d=64))):
        _time(rows, "tiny B1 H4 S128 D64 causal (overhead)", variant, fn, q, q, q, dout,
              4 * 128 * 128 * 64 * 4 * 0.5)
    finish("attention", rows, baseline="sdpa cudnn")


if __name__ == "__main__":
    main()
