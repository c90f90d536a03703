"""Linear fwd+bwd: tritium FP8 (eager) vs bf16 nn.Linear, torch.compile and torchao float8.

Shapes (T tokens, in -> out) from the baseline: 8192 4096->4096, 8192 4096->14336,
16384 8192->8192; bf16 activations and weights, no bias. TFLOP/s counts 6*T*in*out. Every
variant runs forward and backward with a fresh upstream gradient; grads are reset between
calls. Peak memory is the increase over the resident tensors during one fwd+bwd, twice:
`peak_mb` with the input already resident (bf16 then saves nothing new for backward), and
`peak_mb_in_network` with the input made inside the step by a previous op (`x * 1.0`), as in a
network, where bf16 keeps its input alive for backward and FP8 keeps only its fp8 transpose.
The "(CUDA graph)" row replays the FP8 Linear through `tritium.make_graphed_callables`: its
time is the GPU's alone, where the eager rows of a small shape can be bound by the host.

Timing at the GPU's sustained clock: for each shape every variant first compiles, warms up and
has its device time and peak memory measured; then `settle_gpu` runs 3 s of bf16 GEMMs (an
H100 under GEMM load hits its power cap and lowers its clock within a second), and every
variant is timed once per round, in turn, for ROUNDS rounds; `ms` is the median over the
rounds (`ms_rounds` lists them). Timed in one pass with bf16 first, bf16 ran on an idle GPU's boost
clock that no later variant, and no training job, gets (benchmarks/RESULTS.md). `--single`
keeps that old single pass, for comparison.

Autograd threading: PyTorch's engine runs the backward of CUDA tensors on its own device thread,
so an autograd Function written in Python (tritium's, TE's) pays a hand-off to that thread and
runs its backward there with cold caches: ~0.2 ms per step on a slow host, where the FP8 step
at 8192x4096->4096 is bound by host time. Every variant is timed with PyTorch's default (the
case named by its shape, the headline); bf16, tritium and torchao compiled are timed again with
`torch.autograd.set_multithreading_enabled(False)` (the backward on the calling thread), each
against bf16 under that same setting (the case with " | backward on calling thread").
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import statistics  # noqa: E402

from harness import finish, fwd_bwd_step, measure_fwd_bwd, settle_gpu, time_ms  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402

SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (16384, 8192, 8192)]
ROUNDS = 5


def _variants(t, k, n):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt)
    yield "bf16 nn.Linear", base, None
    yield "bf16 nn.Linear compiled", torch.compile(base), None
    tl = te.Linear(k, n, bias=False, params_dtype=dt, device=dev)
    delayed = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    yield "tritium fp8 delayed (eager)", tl, lambda: te.fp8_autocast(fp8_recipe=delayed)
    current = recipe.Float8CurrentScaling()
    yield "tritium fp8 current (eager)", tl, lambda: te.fp8_autocast(fp8_recipe=current)
    # the same step replayed as CUDA graphs: no host time per op, what the GPU alone gives
    tg = te.Linear(k, n, bias=False, params_dtype=dt, device=dev)
    sample = torch.randn(t, k, device=dev, dtype=dt, requires_grad=True)
    graphed = te.make_graphed_callables(tg, (sample,), fp8_enabled=True, fp8_recipe=delayed)
    yield "tritium fp8 delayed (CUDA graph)", graphed, lambda: te.fp8_autocast(fp8_recipe=delayed)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        for name in ("tensorwise", "rowwise"):
            m = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt))
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(name))
            if name == "tensorwise":
                yield f"torchao {name} eager", m, None
            yield f"torchao {name} compiled", torch.compile(m), None
    except Exception as exc:  # peer missing: record, don't crash
        yield "torchao", exc, None


SAME_THREAD = " | backward on calling thread"
SAME_THREAD_VARIANTS = ("bf16 nn.Linear", "tritium fp8 delayed (eager)",
                        "tritium fp8 current (eager)", "torchao tensorwise compiled")


def _on_calling_thread(step):
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


def _time_shape(case, variants, x, dy, rounds, settle):
    """Rows of one shape. First every variant compiles, warms up and has its device time and
    peak memory measured (measure_fwd_bwd); then, after settling the GPU when `settle`, the
    variants are timed in turn, `rounds` times (`ms_rounds`), the SAME_THREAD_VARIANTS also
    with the backward on the calling thread (case + SAME_THREAD)."""
    rows, steps = [], []
    for variant, module, ctx in variants:
        if isinstance(module, Exception):
            rows.append({"case": case, "variant": variant, "error": repr(module)})
            continue
        try:
            res = measure_fwd_bwd(module, x, dy, ctx, in_network=True)
        except Exception as exc:
            rows.append({"case": case, "variant": variant, "error": repr(exc)})
            continue
        rows.append({"case": case, "variant": variant, "ms_rounds": [],
                     "gpu_ms": res["gpu_ms"], "peak_mb": res["peak_mb"],
                     "peak_mb_in_network": res["peak_mb_in_network"]})
        step = fwd_bwd_step(module, x, dy, ctx)[0]
        steps.append((rows[-1], step))
        if variant in SAME_THREAD_VARIANTS:
            rows.append({"case": case + SAME_THREAD, "variant": variant, "ms_rounds": []})
            steps.append((rows[-1], _on_calling_thread(step)))
    if settle:
        settle_gpu()
    for _ in range(rounds):
        for row, step in steps:
            row["ms_rounds"].append(round(time_ms(step), 4))
    return sorted(rows, key=lambda r: SAME_THREAD in r["case"])  # stable: headline rows first


def main(argv):
    """argv: optional T K N triples to run instead of SHAPES (e.g. `8192 4096 4096`);
    `--single`: one timing per variant in one pass, no settling (the old method, for
    comparison; all variants still compile before any is timed)."""
    single = "--single" in argv
    dims = [int(a) for a in argv if a != "--single"]
    shapes = [tuple(dims[i:i + 3]) for i in range(0, len(dims), 3)] if dims else SHAPES
    rows = []
    for t, k, n in shapes:
        case = f"T{t} {k}->{n}"
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        variants = list(_variants(t, k, n))
        for row in _time_shape(case, variants, x, dy, 1 if single else ROUNDS, not single):
            if "ms_rounds" in row:
                row["ms"] = round(statistics.median(row["ms_rounds"]), 4)
                row["tflops"] = round(6 * t * k * n / row["ms"] / 1e9, 1)
            rows.append(row)
            print(row, flush=True)
        del x, dy, variants
        torch.cuda.empty_cache()
    finish("linear", rows, baseline="bf16 nn.Linear")


if __name__ == "__main__":
    main(sys.argv[1:])
