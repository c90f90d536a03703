"""Llama-3-8B trained with FSDP2 over all GPUs: tritium FP8 with FP8 all-gather vs bf16 and torchao.

    torchrun --nproc-per-node=2 benchmarks/bench_fsdp.py --batch 1          # 2 x H200
    torchrun --nproc-per-node=2 benchmarks/bench_fsdp.py --tiny --device cpu   # dry run (gloo)
    torchrun --nproc-per-node=8 benchmarks/bench_fsdp.py --tp 2 \
        --variants bf16,tritium-fp8-ag,tritium-fp8-delayed-ag           # FSDP2 x TP=2, 8 GPUs

Model: HF LlamaForCausalLM with Llama-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads,
ffn 14336, vocab 128256), built on the meta device, sharded with fully_shard per decoder layer
and at the root (MixedPrecisionPolicy bf16 params, fp32 gradient reduction), materialized shard
by shard (examples/train_fsdp.py: build()). FusedAdam with fp32 master weights, sequence 4096,
`--batch` sequences per GPU (on 2 H200s at micro-batch 4: 67 GiB per GPU in bf16 and in FP8, 6
fit easily), every decoder layer recomputed in backward (--no-recompute to keep activations),
the learning rate warmed up linearly over --lr-warmup steps, the loss through
linear_cross_entropy for every variant and the grad norm clipped at 1.0 (examples/train_fsdp.py
train_step). Data: real text (the demo's corpus,
bytes as tokens), the same batches for every variant. Variants, one run, one after another:
  * bf16:              the converted model (tritium TransformerLayers) in bf16: the baseline;
  * hf-bf16:           HF's own layers in bf16 (torch SDPA), for reference;
  * tritium-fp8-ag:    the converted model under fp8_autocast(Float8CurrentScaling), its bf16
                       weights all-gathered as FP8 (enable_fp8_all_gather, scales precomputed in
                       one all-reduce after each step);
  * tritium-fp8-delayed-ag: the same under fp8_autocast(DelayedScaling) (activation and gradient
                       scales from the amax history), weights gathered as FP8 with delayed scales;
  * tritium-fp8-delayed-ag-fp8-lm-head: the same with the lm_head GEMMs of the fused loss in FP8
                       too (convert_llama(fp8_lm_head=True); every other variant, torchao's
                       included, keeps the lm_head in bf16 as torchtitan does);
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
--diagnose VARIANTS: per rank, wall vs host ms per step, device syncs, allocator retries and
the collectives of a step (diagnose_variant; docs/distributed.md says how to read it). --layers N
builds N decoder layers of the 8B shape (fewer GPUs, quicker runs).
Reported per variant: ms per step and tokens/s (all GPUs and per GPU, after --warmup steps),
peak memory per GPU, bytes all-gathered per step per GPU, the loss curve (first / last, and the
mean of the last 10 steps relative to bf16's) and, on GPUs, the NCCL time per step that no
compute kernel hides, per collective (all_gather_exposed_ms, reduce_scatter_exposed_ms, ...:
rank 0, two more profiled steps after the timed ones; --no-comm-profile skips them). Rows go
through benchmarks/harness.py finish().
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from harness import device_syncs, finish, kernel_summary, loss_tail  # noqa: E402
import train_fsdp as T  # noqa: E402

VARIANTS = ("bf16", "hf-bf16", "tritium-fp8-ag", "tritium-fp8-delayed-ag",
            "tritium-fp8-delayed-ag-fp8-lm-head", "tritium-fp8-delayed-ag-current-weights",
            "tritium-fp8-params", "torchao-float8")


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
    lm_head = False
    if args.tp > 1 and name in ("hf-bf16", "torchao-float8"):
        raise ValueError(f"{name} runs HF's own layers, which are not tensor-parallel here: "
                         "it is a 1D (--tp 1) peer")
    if name == "hf-bf16":
        convert = False
    elif name == "tritium-fp8-ag":
        rcp = gather = recipe.Float8CurrentScaling()
    elif name == "tritium-fp8-delayed-ag":
        rcp = gather = recipe.DelayedScaling()
    elif name == "tritium-fp8-delayed-ag-fp8-lm-head":
        rcp = gather = recipe.DelayedScaling()
        lm_head = True
    elif name == "tritium-fp8-delayed-ag-current-weights":
        rcp, gather = recipe.DelayedScaling(), recipe.Float8CurrentScaling()
    elif name == "tritium-fp8-params":
        rcp = params = recipe.DelayedScaling()
    elif name == "torchao-float8":
        convert, prepare = False, _torchao_prepare
    model, _ = T.build(args.config, device, fp8_all_gather=gather, recompute=args.recompute,
                       convert=convert, prepare=prepare, seed=args.seed, mesh=args.mesh,
                       fp8_params=params, fp8_lm_head=lm_head)
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
    else:
        row["tokens_per_s_per_gpu"] = round(tps / world, 1)
    if device.type == "cuda" and args.comm_profile:
        try:   # a diagnostic: its failure must not cost the timed row
            row.update(_exposed_comm(model, opt, rcp, after, args, device))
        except Exception as exc:
            row["comm_profile_error"] = repr(exc)[:300]
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _exposed_comm(model, opt, rcp, after, args, device, steps: int = 2) -> dict:
    """NCCL time per step that no compute kernel hides, in all and per collective (ms, this
    rank): `steps` more steps after the timed ones, under torch.profiler (CUDA kernels only).
    Keys: nccl_ms, nccl_exposed_ms, all_gather_exposed_ms, reduce_scatter_exposed_ms, ..."""
    from torch.profiler import ProfilerActivity, profile
    data = T.batches(args.seq_len, args.batch, steps, device, seed=args.seed + 1, mesh=args.mesh)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        T.train(model, opt, data, rcp=rcp, after_step=after, log=None, warmup=0,
                dp=dist.get_world_size() // args.tp)
        torch.cuda.synchronize()
    ks = kernel_summary(prof, steps)
    out = {"nccl_ms": round(ks.nccl, 1), "nccl_exposed_ms": round(ks.nccl_exposed, 1)}
    for kind, ms in ks.exposed_by_kind.items():   # AllGather -> all_gather_exposed_ms
        out[re.sub(r"(?<!^)([A-Z])", r"_\1", kind).lower() + "_exposed_ms"] = round(ms, 1)
    return out


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
    ks = kernel_summary(prof, steps, top)
    ranked = ks.ranked
    print(f"{name}: wall {wall:.1f} ms/step (profiled); compute kernels busy "
          f"{ks.busy:.1f} ms/step; NCCL kernels {ks.nccl:.1f} ms/step, {ks.nccl_exposed:.1f} "
          "of it beside no compute")
    for k, ms in ranked:
        print(f"  {ms:8.2f} ms  {k[:120]}")
    if args.profile_stacks:
        try:
            _print_call_sites(prof, [k for k, _ in ranked[:12]], steps)
        except Exception as exc:  # a diagnostic: report and go on
            print("call sites:", repr(exc))


def diagnose_variant(name: str, args, device, steps: int = 3) -> None:
    """Why a variant is slower than its kernels: `name` for --warmup steps, then on EVERY rank
    (rank 0 prints each rank's line, so an asymmetry shows):
      * wall ms per step over `steps` steps;
      * host ms per step: one step enqueued while the GPU is held busy (torch.cuda._sleep), so
        it measures the Python and launches alone ("waited" if the host still caught up with
        the device: a sync inside the step); HF's packed-sequence check (a device sync per
        forward, masking_utils.find_packed_sequence_indices) is skipped for this step only.
        host >= wall: the step is bound by the host, and collectives then absorb the ranks'
        host jitter (long NCCL kernels in a profile are waits, not transfers);
      * device syncs of one step: CUDA's sync debug mode (call sites), and on any device the
        host-syncing tensor methods tritium's own code calls (CollectiveLog.syncs);
      * allocator retries and cudaFree calls during the timed steps (each a device sync, when
        memory runs short) and peak memory;
      * the collectives of one step by kind, group size and dtype (count, MiB), and whether
        every rank issued the same sequence (a mismatch would hang or serialize NCCL)."""
    import time
    import transformers.masking_utils as masking
    args.steps = args.warmup + steps + 2
    model, opt, rcp, after = _setup_variant(name, args, device)
    data = list(T.batches(args.seq_len, args.batch, args.steps, device, seed=args.seed,
                          mesh=args.mesh))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run = lambda x, y: T.train_step(model, opt, x, y, rcp=rcp, after_step=after)  # noqa: E731
    for x, y in data[:args.warmup]:
        run(x, y)
    sync()
    dist.barrier()
    mem0 = torch.cuda.memory_stats() if cuda else {}
    t0 = time.perf_counter()
    for x, y in data[args.warmup:args.warmup + steps]:
        run(x, y)
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    mem1 = torch.cuda.memory_stats() if cuda else {}
    row = {"wall": wall, "host": None, "waited": None, "cuda_syncs": [],
           "retries": mem1.get("num_alloc_retries", 0) - mem0.get("num_alloc_retries", 0),
           "frees": mem1.get("num_device_free", 0) - mem0.get("num_device_free", 0),
           "peak_gib": mem1.get("allocated_bytes.all.peak", 0) / 2**30}
    packed = masking.find_packed_sequence_indices
    x, y = data[-2]
    dist.barrier()
    if cuda:   # hold the GPU for about 10 walls (at ~2 GHz): the step's kernels queue behind
        torch.cuda._sleep(int(2e7 * wall))
        held = torch.cuda.Event()
        held.record()
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        t0 = time.perf_counter()
        run(x, y)
        row["host"] = (time.perf_counter() - t0) * 1e3
    finally:
        masking.find_packed_sequence_indices = packed
    row["waited"] = cuda and held.query()
    sync()
    dist.barrier()

    x, y = data[-1]

    def step():   # a sync debug warning: where the step called it (harness.device_syncs)
        run(x, y)
        sync()
    with T.CollectiveLog() as log:
        log.on = True
        try:
            syncs = device_syncs(step)
        finally:
            log.on = False
    row["cuda_syncs"] = [f"at {site}" for site, n in syncs.items() for _ in range(n)]
    row.update(syncs=log.syncs, log=log.log, summary=log.summary())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() != 0:
        return
    for r, d in enumerate(rows):
        host = "n/a" if d["host"] is None else f"{d['host']:.1f}" + (
            " (waited for the device: a sync)" if d["waited"] else "")
        print(f"{name} rank {r}: wall {d['wall']:.1f} ms/step | host {host} ms/step | "
              f"alloc retries {d['retries']}, cudaFree {d['frees']}, peak {d['peak_gib']:.1f} "
              f"GiB | device syncs {len(d['cuda_syncs'])}, tritium host syncs {len(d['syncs'])}")
        for site in sorted(set(d["cuda_syncs"] + d["syncs"])):
            print(f"    sync: {site[:160]}")
    print(f"{name} collectives per step (rank 0), identical sequence on every rank: "
          f"{all(d['log'] == rows[0]['log'] for d in rows)}")
    for (kind, size, dtype), (count, total) in sorted(rows[0]["summary"].items()):
        print(f"    {kind:15s} group of {size}  {dtype:9s} x{count:<5d} {total / 2**20:10.2f} MiB")


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
    p.add_argument("--layers", type=int, help="decoder layers (default: the config's 32); "
                   "fewer fit fewer GPUs, e.g. for --diagnose on 2 GPUs at dp 1 x tp 2")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup", type=int, default=10,
                   help="steps of linear learning-rate warm-up (0: none; results before "
                        "2026-11-27 used none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-recompute", dest="recompute", action="store_false")
    p.add_argument("--no-comm-profile", dest="comm_profile", action="store_false",
                   help="skip the 2 profiled steps after each variant's timed ones (CUDA) that "
                        "measure the all-gather / reduce-scatter time no compute hides")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", choices=["auto", "cpu"], default="auto")
    p.add_argument("--verbose", action="store_true", help="one progress line per step")
    p.add_argument("--profile", metavar="VARIANT", help="profile one variant (CUDA): kernels, "
                   "compute-busy time and NCCL time per step; writes no result")
    p.add_argument("--profile-stacks", action="store_true",
                   help="with --profile: the Python call sites of the top kernels")
    p.add_argument("--diagnose", metavar="VARIANTS", help="comma-separated variants: wall vs "
                   "host ms per step, device syncs, allocator retries and the collectives of "
                   "a step, on every rank (see diagnose_variant); writes no result")
    args = p.parse_args(argv)
    args.config = "tiny" if args.tiny else "llama3-8b"
    if args.layers:
        T.CONFIGS[args.config] = dict(T.CONFIGS[args.config], num_hidden_layers=args.layers)
    if args.tiny:
        args.seq_len, args.steps, args.warmup = min(args.seq_len, 128), min(args.steps, 6), 2
    device = T.setup(args.device)
    try:
        args.mesh = T.make_mesh(device, args.tp)
    except ValueError as e:
        p.error(str(e))
    if args.profile or args.diagnose:
        for name in (args.diagnose.split(",") if args.diagnose else ()):
            if name not in VARIANTS:
                p.error(f"--diagnose: unknown {name!r}; choose from {', '.join(VARIANTS)}")
        if args.profile:
            profile_variant(args.profile, args, device)
        for name in (args.diagnose.split(",") if args.diagnose else ()):
            diagnose_variant(name, args, device)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
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
        row["case"] = (f"{args.config}{f'-L{args.layers}' if args.layers else ''}"
                       f"-s{args.seq_len}-b{args.batch}x{dist.get_world_size()}"
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
            r["loss_last10_vs_bf16"] = round(loss_tail(r["losses"]) / loss_tail(base["losses"]), 4)
            if base.get("tokens_per_s"):
                r["tokens_per_s_vs_bf16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    finish("fsdp", rows, baseline="bf16", gpus=dist.get_world_size())


if __name__ == "__main__":
    raise SystemExit(main())
