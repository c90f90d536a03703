"""Host vs GPU time of one op call (GPU only): wall time per call without syncs (host-bound
calls show host time), and the CUDA kernel time per call from torch.profiler. Diagnostic only.

    python scripts/profile_ops.py
"""
from __future__ import annotations

import time

import torch

import tritium as te


def profile(name, fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            kernels[e.key[:60]] = e.device_time_total / iters / 1e3
    gpu = sum(kernels.values())
    print(f"{name:<40} host {host:.3f} ms/call  wall {wall:.3f}  gpu {gpu:.3f}")
    for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
        print(f"    {v:.4f} ms  {k}")


def main():
    q = torch.randn(4096, 2, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4096, 2, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(128)(4096).cuda()
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def rope_fwd():
        with torch.no_grad():
            te.apply_rotary_pos_emb(q, freqs, "sbhd")
            te.apply_rotary_pos_emb(k, freqs, "sbhd")

    def rope_fwd_bwd():
        torch.autograd.backward([te.apply_rotary_pos_emb(q, freqs, "sbhd"),
                                 te.apply_rotary_pos_emb(k, freqs, "sbhd")], [dq, dk])
    profile("rope q+k fwd", rope_fwd)
    profile("rope q+k fwd+bwd", rope_fwd_bwd)
    big = torch.randn(4096 * 4, 2, 32, 128, device="cuda", dtype=torch.bfloat16)
    freqs4 = te.RotaryPositionEmbedding(128)(4096 * 4).cuda()
    profile("rope q x4 fwd", lambda: te.apply_rotary_pos_emb(big, freqs4, "sbhd"))


if __name__ == "__main__":
    main()
