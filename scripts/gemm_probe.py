"""Probe the Triton FP8 GEMM against torch._scaled_mm on the GPU (one call, JSON to $OUT).

A. host cost per call (tiny GEMMs, no sync inside the loop): _scaled_mm, the Triton kernel,
   torch.empty, one fp8 cast launch;
B. device time of the Linear's GEMM shapes (fprop fast accumulation; dgrad/wgrad precise) for
   a few tile configs, grid = tiles and persistent, next to _scaled_mm, with the max difference;
D. the FP8 Linear fwd+bwd step with each GEMM choice next to bf16 nn.Linear, under both
   autograd threading modes (settled clock, alternating rounds, median). (A part C of the
   first run, a shorter version of D, is in results/...-gemm_probe.json.)
Usage: python3 scripts/gemm_probe.py [A] [B] [D]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from harness import fwd_bwd_step, settle_gpu, time_ms  # noqa: E402

import tritium as te  # noqa: E402
from tritium import _env, recipe  # noqa: E402
from tritium.kernels import gemm as kg  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
OUT = os.environ.get("OUT", ".")
rows = []


def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def operands(m, n, k, da, db):
    a = (torch.randn(m, k, device="cuda") * 2).to(da)
    b = (torch.randn(n, k, device="cuda") * 2).to(db)
    one = torch.ones(1, device="cuda")
    return a, b, one * 0.5, one * 0.25


def cublas(a, b, sa, sb, fast, out=None):
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                            use_fast_accum=fast, out=out)


def part_a():
    a, b, sa, sb = operands(64, 64, 64, E4, E4)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    from tritium.fp8.cast import quantize_2d
    scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    cases = {
        "_scaled_mm": lambda: cublas(a, b, sa, sb, True),
        "_scaled_mm out=": lambda: cublas(a, b, sa, sb, True, out),
        "triton gemm": lambda: kg.fp8_gemm_tn(a, b, sa, sb, torch.bfloat16, None, True),
        "triton gemm out=": lambda: kg.fp8_gemm_tn(a, b, sa, sb, torch.bfloat16, None, True, out),
        "torch.empty": lambda: torch.empty(64, 64, device="cuda", dtype=torch.bfloat16),
        "fp8 cast (quantize_2d)": lambda: quantize_2d(x, E4, scale=scale, amax=amax,
                                                      current=None, pad_rows_to=16),
    }
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            best.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        emit({"part": "A", "case": name, "host_us_per_call": round(min(best), 2),
              "median_us": round(statistics.median(best), 2)})


FAST_CONFIGS = [(128, 256, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4),
                (256, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 4)]
PRECISE_CONFIGS = [(128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4), (128, 256, 128, 8, 8, 3),
                   (256, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 5), (128, 256, 64, 8, 8, 4)]
# (label, M, N, K, a dtype, b dtype, fast)
SHAPES = [("4096 fprop", 8192, 4096, 4096, E4, E4, True),
          ("4096 dgrad", 8192, 4096, 4096, E5, E4, False),
          ("4096 wgrad", 4096, 4096, 8192, E5, E4, False),
          ("14336 fprop", 8192, 14336, 4096, E4, E4, True),
          ("14336 dgrad block", 2048, 4096, 14336, E5, E4, False),
          ("14336 wgrad block", 3584, 4096, 8192, E5, E4, False),
          ("16384x8192 fprop", 16384, 8192, 8192, E4, E4, True),
          ("16384x8192 dgrad", 16384, 8192, 8192, E5, E4, False),
          ("16384x8192 wgrad", 8192, 8192, 16384, E5, E4, False)]


def part_b():
    for label, m, n, k, da, db, fast in SHAPES:
        a, b, sa, sb = operands(m, n, k, da, db)
        flops = 2 * m * n * k
        ref = cublas(a, b, sa, sb, fast).float()
        ms = time_ms(lambda: cublas(a, b, sa, sb, fast))
        emit({"part": "B", "shape": label, "impl": "cublas", "ms": round(ms, 4),
              "tflops": round(flops / ms / 1e9, 1)})
        for cfg in (FAST_CONFIGS if fast else PRECISE_CONFIGS):
            for persistent in (False, True):
                fn = lambda: kg.fp8_gemm_tn(a, b, sa, sb, torch.bfloat16, None, fast,  # noqa
                                            config=cfg, persistent=persistent)
                try:
                    res = fn().float()
                    ms = time_ms(fn)
                except Exception as exc:
                    emit({"part": "B", "shape": label, "config": cfg, "error": repr(exc)[:200]})
                    break
                diff = ((res - ref).abs().max() / ref.abs().max()).item()
                emit({"part": "B", "shape": label, "impl": "triton", "config": cfg,
                      "persistent": persistent, "ms": round(ms, 4),
                      "tflops": round(flops / ms / 1e9, 1), "max_rel_diff_vs_cublas": diff})
        del a, b
        torch.cuda.empty_cache()


def part_d(t=8192, k=4096, n=4096, rounds=12):
    """Alternating rounds (noise-robust A/B): the FP8 step with each TRITIUM_FP8_GEMM choice
    (cublas: all three GEMMs on cuBLASLt; auto: Triton fprop; triton: all three on Triton),
    each with the autograd engine's device thread (default) and with backward on the calling
    thread (set_multithreading_enabled(False)); bf16 alike."""
    dt = torch.bfloat16
    delayed = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    x = torch.randn(t, k, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=dt)
    base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dt)
    lin = te.Linear(k, n, bias=False, params_dtype=dt, device="cuda")
    fp8 = fwd_bwd_step(lin, x, dy, lambda: te.fp8_autocast(fp8_recipe=delayed))[0]
    variants = [("bf16", None, fwd_bwd_step(base, x, dy)[0])] + \
        [(f"fp8 {gemm}", gemm, fp8) for gemm in ("cublas", "auto", "triton")]
    times = {(name, mt): [] for name, _, _ in variants for mt in (True, False)}
    settle_gpu()
    for _ in range(rounds):
        for mt in (True, False):
            with torch.autograd.set_multithreading_enabled(mt):
                for name, gemm, step in variants:
                    if gemm is not None:
                        os.environ["TRITIUM_FP8_GEMM"] = gemm
                        _env.reload()
                    step(); step()
                    times[(name, mt)].append(time_ms(step, warmup=5, rep=40))
    os.environ.pop("TRITIUM_FP8_GEMM", None)
    _env.reload()
    for mt in (True, False):
        base_ms = statistics.median(times[("bf16", mt)])
        for name, _, _ in variants:
            ts = times[(name, mt)]
            med = statistics.median(ts)
            emit({"part": "D", "case": f"T{t} {k}->{n}", "variant": name,
                  "autograd_threads": mt, "ms": round(med, 4),
                  "q1_q3": [round(statistics.quantiles(ts, n=4)[i], 4) for i in (0, 2)],
                  "speedup_vs_bf16_same_threading": round(base_ms / med, 3)})


if __name__ == "__main__":
    parts = sys.argv[1:] or ["A", "B", "D"]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for p in parts:
        {"A": part_a, "B": part_b, "D": part_d}[p]()
    with open(os.path.join(OUT, "gemm_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
