"""Does what ran before change an eager step's time? (diagnostic for bench_linear.py)

    python scripts/bench_order.py [T K N]        (default 8192 4096 4096)

Times bf16 nn.Linear alone six times, then bf16 and tritium's FP8 Linear (delayed, eager)
alternately, with the harness of bench_linear.py (`measure_fwd_bwd`: do_bench median and
device time), three rounds each, in a fresh process; then runs torch.compile'd bf16 and torchao float8 (compiled) steps, as
bench_linear.py does before timing tritium, and times the two eager variants again.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from harness import measure_fwd_bwd  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402


def main(t=8192, k=4096, n=4096):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(t, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(t, n, device=dev, dtype=dt)
    base = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt)
    tl = te.Linear(k, n, bias=False, params_dtype=dt, device=dev)
    rec = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    eager = [("bf16", base, None), ("fp8", tl, lambda: te.fp8_autocast(fp8_recipe=rec))]

    def rounds(tag):
        for r in range(3):
            res = {name: measure_fwd_bwd(m, x, dy, ctx) for name, m, ctx in eager}
            print(f"{tag} round {r}: " + "  ".join(
                f"{name} {v['ms']:.3f} ms (gpu {v['gpu_ms']:.3f})" for name, v in res.items())
                + f"  ratio {res['bf16']['ms'] / res['fp8']['ms']:.3f}", flush=True)

    for r in range(6):   # bf16 alone first: does its time drift under sustained load?
        v = measure_fwd_bwd(base, x, dy)
        print(f"bf16 alone {r}: {v['ms']:.3f} ms (gpu {v['gpu_ms']:.3f})", flush=True)
    rounds("fresh")
    compiled = torch.compile(base)
    measure_fwd_bwd(compiled, x, dy)
    print("ran bf16 compiled", flush=True)
    rounds("after torch.compile")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        m = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt))
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        measure_fwd_bwd(torch.compile(m), x, dy)
        print("ran torchao compiled", flush=True)
        rounds("after torchao")
    except ImportError as exc:
        print("torchao missing:", exc)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
