"""Llama-3-8B trained with FSDP2 over all GPUs: tritium FP8 with FP8 all-gather vs bf16 and torchao.

    torchrun --nproc-per-node=2 benchmarks/bench_fsdp.py --batch 1          # 2 x H200
    torchrun --nproc-per-node=2 benchmarks/bench_fsdp.py --tiny --device cpu   # dry run (gloo)
    torchrun --nproc-per-node=8 benchmarks/bench_fsdp.py --tp 2 \
        --variants bf16,tritium-fp8-ag,tritium-fp8-delayed-ag           # FSDP2 x TP=2, 8 GPUs

Model: HF LlamaForCausalLM with Llama-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads,
ffn 14336, vocab 128256), built on the meta device, sharded with fully_shard per decoder layer
and at the root (MixedPrecisionPolicy bf16 params, fp32 gradient reduction), materialized shard
by shard (examples/train_fsdp.py: build()). FusedAdam with fp32 master weights, sequence 4096,
`--batch` sequences per GPU (on an H200, 4 fit with recompute: 95 GiB in FP8), every decoder layer
recomputed in backward (--no-recompute to keep activations), the learning rate warmed up
linearly over --lr-warmup steps. Data: real text (the demo's corpus,
bytes as tokens), the same batches for every variant. Variants, one run, one after another:
  * bf16:              the converted model (tritium TransformerLayers) in bf16: the baseline;
  * hf-bf16:           HF's own layers in bf16 (torch SDPA), for reference;
  * tritium-fp8-ag:    the converted model under fp8_autocast(Float8CurrentScaling), its bf16
                       weights all-gathered as FP8 (enable_fp8_all_gather, scales precomputed in
                       one all-reduce after each step);
  * tritium-fp8-delayed-ag: the same under fp8_autocast(DelayedScaling) (activation and gradient
                       scales from the amax history), weights gathered as FP8 with delayed scales;
  * tritium-fp8-delayed-ag-current-weights: delayed scaling of activations and gradients, the
                       weights gathered with current scales (precomputed after each step);
  * tritium-fp8-params: the decoder layers' GEMM weights are FP8 params (fp8_model_init,
                       DelayedScaling) built on the meta device: no weight cast in the step,
                       FSDP2 gathers their fp8 bytes, 1 byte per weight element per GPU;
  * torchao-float8:    HF's layers through torchao float8 tensorwise (convert_to_float8_training,
                       enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp),
                       torch.compile per decoder layer.
--tp N: FSDP2 x tensor parallelism on a 2D mesh (world / N, N) ("dp", "tp"), the decoder layers
tensor- and sequence-parallel over "tp" (examples/train_fsdp.py: make_mesh); `--batch` is then
per dp rank (the N TP ranks of a dp group share it) and the case name ends in -tp{N}. hf-bf16
and torchao-float8 are the 1D peers: with N > 1 they give a row with an error.
--profile VARIANT: that variant's kernels under torch.profiler (compute-busy vs wall, NCCL time).
Reported per variant: ms per step and tokens/s (all GPUs, after --warmup steps), peak memory per
GPU, bytes all-gathered per step per GPU, and the loss curve (first / last, and the mean of the
last 10 steps relative to bf16's). Rows go through benchmarks/harness.py finish().
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from harness import finish  # noqa: E402
import train_fsdp as T  # noqa: E402

VARIANTS = ("bf16", "hf-bf16", "tritium-fp8-ag", "tritium-fp8-delayed-ag",
            "tritium-fp8-delayed-ag-current-weights", "tritium-fp8-params", "torchao-float8")


def _torchao_prepare(model):
    """Before fully_shard: torchao's float8 tensorwise linears with FP8 all-gather, compiled
    per decoder layer (torchtitan's order)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)
    for layer in model.model.layers:
        layer.compile()


def _setup_variant(name: str, args, device):
    """(model, optimizer, fp8 recipe or None, after-step hook or None) for a variant."""
    import tritium as te
    from tritium import recipe
    rcp, after, prepare, convert, gather, params = None, None, None, True, None, None
    if args.tp > 1 and name in ("hf-bf16", "torchao-float8"):
        raise ValueError(f"{name} runs HF's own layers, which are not tensor-parallel here: "
                         "it is a 1D (--tp 1) peer")
    if name == "hf-bf16":
        convert = False
    elif name == "tritium-fp8-ag":
        rcp = gather = recipe.Float8CurrentScaling()
    elif name == "tritium-fp8-delayed-ag":
        rcp = gather = recipe.DelayedScaling()
    elif name == "tritium-fp8-delayed-ag-current-weights":
        rcp, gather = recipe.DelayedScaling(), recipe.Float8CurrentScaling()
    elif name == "tritium-fp8-params":
        rcp = params = recipe.DelayedScaling()
    elif name == "torchao-float8":
        convert, prepare = False, _torchao_prepare
    model, _ = T.build(args.config, device, fp8_all_gather=gather, recompute=args.recompute,
                       convert=convert, prepare=prepare, seed=args.seed, mesh=args.mesh,
                       fp8_params=params)
    if name == "torchao-float8":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        after = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    opt = te.optimizers.FusedAdam(model.parameters(), lr=args.lr, master_weights=True)
    if args.lr_warmup:   # linear warm-up, as every Llama recipe has (torchtitan's default: 200)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.lr_warmup))
        hooks = [h for h in (after, warm.step) if h is not None]
        after = lambda: [h() for h in hooks]  # noqa: E731
    return model, opt, rcp, after


def run_variant(name: str, args, device) -> dict:
    model, opt, rcp, after = _setup_variant(name, args, device)
    data = T.batches(args.seq_len, args.batch, args.steps, device, seed=args.seed,
                     mesh=args.mesh)
    log = print if args.verbose else None
    dp = dist.get_world_size() // args.tp
    steps = T.train(model, opt, data, rcp=rcp, after_step=after, log=log, warmup=args.warmup,
                    dp=dp)
    timed = [s for s in steps if s["tokens_per_s"]]
    tps = timed[-1]["tokens_per_s"] if timed else None
    world = dist.get_world_size()
    row = {"bench": "fsdp", "variant": name, "world": world, "tp": args.tp,
           "batch_per_gpu": args.batch, "seq_len": args.seq_len, "recompute": args.recompute,
           "lr_warmup": args.lr_warmup,
           "tokens_per_s": None if tps is None else round(tps, 1),
           "ms": None if tps is None else round(1e3 * args.batch * args.seq_len * dp / tps, 2),
           "peak_gib_per_gpu": None if steps[-1]["peak_gib"] is None
           else round(max(s["peak_gib"] for s in steps), 2),
           "all_gather_gib_per_step": round(steps[-1]["all_gather_bytes"] / 2**30, 4),
           "losses": [round(s["loss"], 5) for s in steps]}
    if row["ms"] is None:
        del row["ms"]
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_variant(name: str, args, device, steps: int = 2, top: int = 25) -> None:
    """`name` for --warmup steps, then `steps` steps under torch.profiler (every rank runs them;
    rank 0 prints): wall ms per step, the time the GPU ran compute kernels (the union of their
    intervals: the rest of the wall is exposed communication or host), NCCL kernel time, and the
    top kernels by time."""
    import time
    from torch.profiler import ProfilerActivity, profile
    args.steps = args.warmup + steps
    model, opt, rcp, after = _setup_variant(name, args, device)
    data = list(T.batches(args.seq_len, args.batch, args.steps, device, seed=args.seed,
                          mesh=args.mesh))
    T.train(model, opt, data[:args.warmup], rcp=rcp, after_step=after, log=None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=args.profile_stacks) as prof:
        t0 = time.perf_counter()
        T.train(model, opt, data[args.warmup:], rcp=rcp, after_step=after, log=None)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    if dist.get_rank() != 0:
        return
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(ev, "is_user_annotation", False)]
    kernels, spans = {}, []
    for ev in events:
        kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time / 1e3 / steps
        if "nccl" not in ev.name.lower():
            spans.append((ev.time_range.start, ev.time_range.end))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):   # union of compute-kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    nccl = sum(ms for k, ms in kernels.items() if "nccl" in k.lower())
    print(f"{name}: wall {wall:.1f} ms/step (profiled); compute kernels busy "
          f"{busy / 1e3 / steps:.1f} ms/step; NCCL kernels {nccl:.1f} ms/step")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    for k, ms in ranked:
        print(f"  {ms:8.2f} ms  {k[:120]}")
    if args.profile_stacks:
        try:
            _print_call_sites(prof, [k for k, _ in ranked[:12]], steps)
        except Exception as exc:  # a diagnostic: report and go on
            print("call sites:", repr(exc))


def _print_call_sites(prof, names: list, steps: int, sites: int = 3) -> None:
    """For each kernel name, the Python call sites (innermost frames outside torch.nn's
    module machinery) of the ops that launched it, by GPU time."""
    skip = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "<built-in")
    found = {n: {} for n in names}
    for ev in prof.events():
        for k in getattr(ev, "kernels", None) or ():
            if k.name in found:
                frames = [f for f in (ev.stack or ()) if not any(x in f for x in skip)][:2]
                site = " <- ".join(frames) or ev.name
                found[k.name][site] = found[k.name].get(site, 0.0) + k.duration / 1e3 / steps
    for name in names:
        print(f"  {name[:90]}")
        for site, ms in sorted(found[name].items(), key=lambda kv: -kv[1])[:sites]:
            print(f"      {ms:8.2f} ms  {site[:150]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny config, short sequences: a dry run")
    p.add_argument("--batch", type=int, default=1, help="sequences per dp rank per step")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2D mesh dp x tp)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup", type=int, default=10,
                   help="steps of linear learning-rate warm-up (0: none; results before "
                        "2026-11-27 used none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-recompute", dest="recompute", action="store_false")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", choices=["auto", "cpu"], default="auto")
    p.add_argument("--verbose", action="store_true", help="one progress line per step")
    p.add_argument("--profile", metavar="VARIANT", help="profile one variant (CUDA): kernels, "
                   "compute-busy time and NCCL time per step; writes no result")
    p.add_argument("--profile-stacks", action="store_true",
                   help="with --profile: the Python call sites of the top kernels")
    args = p.parse_args(argv)
    args.config = "tiny" if args.tiny else "llama3-8b"
    if args.tiny:
        args.seq_len, args.steps, args.warmup = min(args.seq_len, 128), min(args.steps, 6), 2
    device = T.setup(args.device)
    try:
        args.mesh = T.make_mesh(device, args.tp)
    except ValueError as e:
        p.error(str(e))
    if args.profile:
        profile_variant(args.profile, args, device)
        dist.destroy_process_group()
        return 0
    rows = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            p.error(f"--variants: unknown {name!r}; choose from {', '.join(VARIANTS)}")
        try:
            row = run_variant(name, args, device)
        except Exception as e:  # a missing peer or an OOM: a row with the error, not a crash
            if dist.get_rank() == 0:
                traceback.print_exc()
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        row["case"] = (f"{args.config}-s{args.seq_len}-b{args.batch}x{dist.get_world_size()}"
                       + ("" if args.recompute else "-no-recompute")
                       + (f"-tp{args.tp}" if args.tp > 1 else ""))
        rows.append(row)
        if dist.get_rank() == 0:
            print({k: v for k, v in row.items() if k != "losses"}, flush=True)
            _write(rows)   # after every variant: a crash in a later one keeps these
    dist.destroy_process_group()
    return 0


def _write(rows: list) -> None:
    rows = [dict(r) for r in rows]
    base = next((r for r in rows if r["variant"] == "bf16" and "losses" in r), None)
    for r in rows:
        if base is not None and "losses" in r and "tokens_per_s" in r and r["tokens_per_s"]:
            tail = lambda x: sum(x["losses"][-10:]) / len(x["losses"][-10:])  # noqa: E731
            r["loss_last10_vs_bf16"] = round(tail(r) / tail(base), 4)
            if base.get("tokens_per_s"):
                r["tokens_per_s_vs_bf16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    finish("fsdp", rows, baseline="bf16", gpus=dist.get_world_size())


if __name__ == "__main__":
    raise SystemExit(main())
