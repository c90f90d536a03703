"""Block-scaled FP8 (Float8BlockScaling) on Hopper: the GEMM, the casts and a Linear step.

1. GEMM, case "gemm MxKxN" for the three GEMMs of a Linear T8192 4096->14336 (fprop M=8192
   K=4096 N=14336; dgrad M=8192 K=14336 N=4096; wgrad M=14336 K=8192 N=4096): the block-scaled
   Triton GEMM (`tritium.kernels.block_gemm`, x in 1x128 tiles, the weight in 128x128 blocks
   for fprop/dgrad, both 1x128 for wgrad; bf16 out) at its default config and a small sweep of
   tile configs, against the tensorwise FP8 GEMM `torch._scaled_mm` (cuBLASLt; baseline: fast
   accumulation; its split-accumulation mode is a row too). Written as bench
   "block_scaling_gemm" with the casts below. TFLOP/s = 2*M*N*K / time. Target:
   the block GEMM at >= 85% of the tensorwise one at fprop (DESIGN.md section 13: DeepGEMM
   reports 1350+ FP8 TFLOP/s on H800 for such GEMMs; the tensorwise GEMM measures 1190-1356 on
   an H200).
2. Casts: x [8192, 4096] bf16 -> 1x128 rowwise + columnwise in one pass; w [14336, 4096] ->
   128x128 (GB/s over bytes read and written).
3. Linear fwd+bwd, T8192 4096->14336, bf16, no bias: tritium under Float8BlockScaling and under
   Float8CurrentScaling against bf16 nn.Linear (baseline), bench "block_scaling_linear".
   Target: block >= 1.4x bf16.

`--tiny`: a CPU smoke run of the same code paths on small shapes (the twins, timed with
perf_counter; no speed meaning; JSON to $OUT or a temporary folder, never results/), so CI can
check that the script runs. `--skip-sweep`: default GEMM configs only.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, measure_fwd_bwd, settle_gpu, time_ms  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402
from tritium.fp8 import block as block_ops  # noqa: E402

E4M3 = torch.float8_e4m3fn
TENSORWISE = "tensorwise fp8 (fast accum)"  # the GEMM rows' baseline
# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages, programs per SM); all free of register
# spills for sm_90a (ptxas), in both weight-scale layouts.
SWEEP = [(64, 128, 8, 4, 3, 2), (64, 128, 8, 4, 2, 2), (64, 128, 8, 4, 4, 1),
         (128, 128, 8, 8, 3, 1), (64, 256, 8, 8, 3, 1)]
# (SUB, num_warps) of the block cast kernel
CAST_SWEEP = [(32, 4), (64, 4), (64, 8), (128, 8)]


def _timer(tiny: bool):
    if not tiny:
        return time_ms

    def cpu_ms(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3
    return cpu_ms


def _row(rows, case, variant, ms, **extra):
    rows.append({"bench": "block_scaling", "case": case, "variant": variant,
                 "ms": round(ms, 4), **extra})


def bench_gemms(rows, tiny: bool, dev: str):
    timer = _timer(tiny)
    t, k, n = (256, 256, 384) if tiny else (8192, 4096, 14336)
    shapes = {"fprop": (t, k, n, True), "dgrad": (t, n, k, True), "wgrad": (n, t, k, False)}
    for name, (m, kk, nn, w2d) in shapes.items():
        case = f"gemm {name} {m}x{kk}x{nn}"
        flops = 2 * m * kk * nn
        a_hp = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
        b_hp = torch.randn(nn, kk, device=dev, dtype=torch.bfloat16) * 0.02
        aq = block_ops.quantize_blocks(a_hp, E4M3)
        bq = block_ops.quantize_blocks(b_hp, E4M3, block_2d=w2d)
        a8, b8 = a_hp.to(E4M3), b_hp.float().mul(20).to(E4M3)
        one = torch.ones((), device=dev)
        if tiny:
            from tritium.ref.gemm import fp8_gemm_tn
            ms = timer(lambda: fp8_gemm_tn(a8, b8, one, one, torch.bfloat16))
            _row(rows, case, TENSORWISE, ms, tflops=round(flops / ms / 1e9, 1))
        else:
            for fast in (True, False):
                def tensorwise(fast=fast):
                    return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                ms = timer(tensorwise)
                _row(rows, case, TENSORWISE if fast else "tensorwise fp8 (split accum)", ms,
                     tflops=round(flops / ms / 1e9, 1))

        def block(config=None, persistent=True):
            if tiny:
                return block_ops.block_gemm_tn(aq.data, bq.data, aq.scale_inv, bq.scale_inv,
                                               torch.bfloat16, b_block_2d=w2d)
            from tritium.kernels.block_gemm import block_gemm_tn
            return block_gemm_tn(aq.data, bq.data, aq.scale_inv, bq.scale_inv, torch.bfloat16,
                                 b_block_2d=w2d, config=config, persistent=persistent)
        ms = timer(block)
        _row(rows, case, "block fp8 (default)", ms, tflops=round(flops / ms / 1e9, 1))
        if tiny:
            continue
        if block_ops._cublas_block_ok(aq.data, bq.data, aq.scale_inv, bq.scale_inv, w2d):
            ms = timer(lambda: block_ops.cublas_block_gemm_tn(
                aq.data, bq.data, aq.scale_inv, bq.scale_inv, torch.bfloat16, b_block_2d=w2d))
            _row(rows, case, "block fp8 cublas", ms, tflops=round(flops / ms / 1e9, 1))
            if name == "wgrad":  # the same product with the operands swapped: dW^T = x^T dy
                ms = timer(lambda: block_ops.cublas_block_gemm_tn(
                    bq.data, aq.data, bq.scale_inv, aq.scale_inv, torch.bfloat16))
                _row(rows, case, "block fp8 cublas, operands swapped", ms,
                     tflops=round(flops / ms / 1e9, 1))
        for config in SWEEP:
            for persistent in (True, False):
                label = f"block fp8 {config}{'' if persistent else ' grid'}"
                try:
                    ms = timer(lambda: block(config, persistent))
                    _row(rows, case, label, ms, tflops=round(flops / ms / 1e9, 1))
                except Exception as exc:  # a config that does not fit (shared memory, regs)
                    rows.append({"bench": "block_scaling", "case": case, "variant": label,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})


def bench_casts(rows, tiny: bool, dev: str):
    timer = _timer(tiny)
    for name, (m, k), kwargs in (
            ("cast x 1x128 row+col", (256, 256) if tiny else (8192, 4096),
             dict(rowwise=True, columnwise=True)),
            ("cast w 128x128", (384, 256) if tiny else (14336, 4096),
             dict(block_2d=True, rowwise=True, columnwise=True))):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ms = timer(lambda: block_ops.quantize_blocks(x, E4M3, **kwargs))
        moved = m * k * (2 + 2)  # bf16 read, fp8 written twice
        _row(rows, f"{name} {m}x{k}", "tritium", ms, gbps=round(moved / ms / 1e6, 1))
        if tiny:
            continue
        from tritium.kernels import block_cast as kcast
        for config in CAST_SWEEP:  # (SUB, num_warps) of the cast kernel
            ms = timer(lambda: kcast.quantize_blocks(x, E4M3, config=config, **kwargs))
            _row(rows, f"{name} {m}x{k}", f"tritium {config}", ms,
                 gbps=round(moved / ms / 1e6, 1))


def bench_linear(rows, tiny: bool, dev: str):
    t, k, n = (64, 256, 384) if tiny else (8192, 4096, 14336)
    case = f"linear fwd+bwd T{t} {k}->{n}"
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    ours = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        ours.weight.copy_(base.weight)
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
    variants = [("bf16 nn.Linear", base, None),
                ("tritium Float8BlockScaling", ours,
                 lambda: te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling())),
                ("tritium Float8CurrentScaling", ours,
                 lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()))]
    if not tiny:
        settle_gpu()
    for label, module, ctx in variants:
        if tiny:
            def step(module=module, ctx=ctx):
                x.grad = None
                if ctx is None:
                    y = module(x)
                else:
                    with ctx():
                        y = module(x)
                y.backward(dy)
            _row(rows, case, label, _timer(True)(step))
        else:
            _row(rows, case, label, **measure_fwd_bwd(module, x, dy, ctx))
        rows[-1]["tflops"] = round(6 * t * k * n / rows[-1]["ms"] / 1e9, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on small shapes")
    parser.add_argument("--skip-sweep", action="store_true", help="GEMM default configs only")
    args = parser.parse_args()
    if args.skip_sweep:
        SWEEP.clear()
    dev = "cpu" if args.tiny else "cuda"
    if args.tiny and not os.environ.get("OUT"):   # a smoke run's rows stay out of results/
        os.environ["OUT"] = tempfile.mkdtemp(prefix="bench_block_scaling_")
    suffix = "_tiny" if args.tiny else ""
    rows: list[dict] = []
    bench_gemms(rows, args.tiny, dev)
    bench_casts(rows, args.tiny, dev)
    finish("block_scaling_gemm" + suffix, rows, TENSORWISE)
    rows = []
    bench_linear(rows, args.tiny, dev)
    finish("block_scaling_linear" + suffix, rows, "bf16 nn.Linear")


if __name__ == "__main__":
    main()
