"""A Llama-3-8B TransformerLayer at TP=2 with sequence parallelism: FP8 vs bf16 (NCCL).

Shape: hidden 4096, 32 heads, 8 KV groups (head dim 128), ffn 14336 SwiGLU, RMSNorm, no bias,
causal, RoPE, sbhd, B2 x S4096; each rank holds S/2 rows of the input and half the heads and
the ffn. Variants (one run, same layer weights): "bf16 tp2 sp" (the baseline: the layer in
bf16), "fp8 delayed tp2 sp" (fp8_autocast, DelayedScaling HYBRID, history 16, "max", amaxes
reduced over the TP group: the column GEMMs' inputs all-gathered in FP8) and "fp8 current tp2
sp" (Float8CurrentScaling); "bf16 tp2 sp graphed" and "fp8 delayed tp2 sp graphed": the same
layer (built again with the same weights) through te.make_graphed_callables, its collectives
captured with the kernels, one replay per forward and per backward (the eager step is bound by
the host at this size: ~8 ms of Python per FP8 step on an H200 host). Target (issue 18): fp8
delayed >= 1.4x bf16.
Timing: a fixed number of fwd+bwd steps on every rank (both ranks must run the same
collectives), CUDA events per step, median, the max over ranks; tokens/s = B*S / step time
(the two GPUs together). Peak memory per GPU (max over ranks).

    torchrun --nproc_per_node=2 benchmarks/bench_tp.py          # 2 GPUs, NCCL; JSON via harness
    torchrun --nproc_per_node=2 benchmarks/bench_tp.py --tiny   # CPU dry run on gloo (tiny
    python benchmarks/bench_tp.py --tiny                        # shapes; prints, writes nothing)
    torchrun --nproc_per_node=2 benchmarks/bench_tp.py --profile  # + kernels, host cProfile
    torchrun --nproc_per_node=2 benchmarks/bench_tp.py --trace [DIR]  # + Chrome traces ($OUT)
    torchrun --nproc_per_node=2 benchmarks/bench_tp.py --comm-host  # host us per collective
    torchrun --nproc_per_node=2 benchmarks/bench_tp.py --sm-carveout 16  # GEMMs leave 16 SMs
Without torchrun it spawns the 2 processes itself.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, kernel_summary, launch_env, print_table  # noqa: E402

FULL = dict(B=2, S=4096, H=4096, HEADS=32, GROUPS=8, FFN=14336, warmup=3, iters=10)
TINY = dict(B=2, S=32, H=64, HEADS=4, GROUPS=2, FFN=128, warmup=1, iters=2)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_times(step, cfg, cuda: bool) -> list[float]:
    for _ in range(cfg["warmup"]):
        step()
    times = []
    for _ in range(cfg["iters"]):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run(rank: int, world: int, opts: argparse.Namespace) -> None:
    """opts: main()'s parsed arguments (tiny, profile, trace, graphed)."""
    import tritium as te
    from tritium import recipe
    tiny = opts.tiny
    cfg = TINY if tiny else FULL
    cuda = not tiny
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    group = dist.group.WORLD
    b, s, h, d = cfg["B"], cfg["S"], cfg["H"], cfg["H"] // cfg["HEADS"]
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234 + rank)

    def new_layer():   # the same weights every time (the bench's seed)
        torch.manual_seed(0)
        return te.TransformerLayer(
            h, cfg["FFN"], cfg["HEADS"], num_gqa_groups=cfg["GROUPS"], hidden_dropout=0.0,
            attention_dropout=0.0, normalization="RMSNorm", activation="swiglu", bias=False,
            fuse_qkv_params=True, qkv_weight_interleaved=False, attn_input_format="sbhd",
            tp_group=group, sequence_parallel=True, set_parallel_mode=True,
            get_rng_state_tracker=lambda: tracker, params_dtype=dtype, device=dev)
    layer = new_layer()
    freqs = te.RotaryPositionEmbedding(d)(s).to(dev)
    x = torch.randn(s // world, b, h, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(s // world, b, h, device=dev, dtype=dtype)
    delayed = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                    amax_compute_algo="max")
    variants = [("bf16 tp2 sp", None, False), ("fp8 delayed tp2 sp", delayed, False),
                ("fp8 current tp2 sp", recipe.Float8CurrentScaling(), False),
                ("bf16 tp2 sp graphed", None, True), ("fp8 delayed tp2 sp graphed", delayed, True)]
    variants = [v for v in variants if opts.graphed or not v[2]]
    case = f"B{b} S{s} H{h} ffn{cfg['FFN']} tp{world} sp{_knobs(opts)}"
    rows = []
    for name, rcp, graphed in variants:
        run = layer
        if graphed:   # its own layer: make_graphed_callables replaces the module's forward
            fp8 = {} if rcp is None else dict(fp8_enabled=True, fp8_recipe=rcp, fp8_group=group)
            run = te.make_graphed_callables(new_layer(), (x,),
                                            sample_kwargs={"rotary_pos_emb": freqs}, **fp8)

        def step():
            x.grad = None
            for p in run.parameters():
                p.grad = None
            with te.fp8_autocast(enabled=rcp is not None, fp8_recipe=rcp, fp8_group=group):
                out = run(x, rotary_pos_emb=freqs)
            out.backward(dy)
        row = {"case": case, "variant": name}
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            ms = statistics.median(_step_times(step, cfg, cuda))
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
            stats = torch.tensor([ms, peak], dtype=torch.float64, device=dev)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
            ms, peak = stats.tolist()
            row.update(ms=round(ms, 4), ktok_per_s=round(b * s / ms, 1),
                       peak_mb_per_gpu=round(peak, 1))
        except Exception as exc:  # a failing variant becomes a row, the others still run
            row["error"] = repr(exc)[:400]
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
        if (opts.profile or opts.trace) and cuda:
            _profile(name, step, cfg, rank, opts.trace)
    if rank == 0:
        if tiny:  # finish() would write a result file: the dry run only prints
            base = rows[0].get("ms")
            for r in rows:
                if base and "ms" in r:
                    r["speedup_vs_bf16 tp2 sp"] = round(base / r["ms"], 3)
            print_table("tp (dry run, CPU gloo, tiny shapes)", rows, baseline="bf16 tp2 sp")
        else:
            finish("tp", rows, baseline="bf16 tp2 sp", gpus=2)
    del run, step   # the graphs (their captured collectives) go before the group does
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)


def _profile(name: str, step, cfg, rank: int, trace_dir=None, top: int = 20) -> None:
    """`iters` steps of a variant under torch.profiler (both ranks run them; rank 0 prints):
    wall per step, compute-busy time, NCCL kernel time, each rank's host time per step and the
    top kernels, then cProfile's table of one more step's host work. host >= wall: the step is
    bound by the host, and the collectives absorb the ranks' host jitter (long NCCL kernels are
    then waits, not transfers)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(cfg["iters"]):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / cfg["iters"]
    # host time: one step enqueued while the GPU is held busy (its kernels queue behind the
    # sleep), so it times the Python and the launches alone; "waited": a sync inside the step
    torch.cuda._sleep(int(2e7 * wall))
    held = torch.cuda.Event()
    held.record()
    t0 = time.perf_counter()
    step()
    host = (time.perf_counter() - t0) * 1e3
    waited = held.query()
    torch.cuda.synchronize()
    # where that host time goes: one more held step under cProfile (every rank runs it, for
    # its collectives); its table counts the C calls too (launches, _scaled_mm, NCCL, cuDNN)
    torch.cuda._sleep(int(2e7 * wall))
    calls = cProfile.Profile()
    calls.enable()
    step()
    calls.disable()
    torch.cuda.synchronize()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (round(host, 2), waited))
    if rank != 0:
        return
    ks = kernel_summary(prof, cfg["iters"], top)
    print(f"{name}: wall {wall:.2f} ms/step (profiled); compute kernels busy {ks.busy:.2f} "
          f"ms/step; NCCL kernels {ks.nccl:.2f} ms/step, {ks.nccl_exposed:.2f} of it beside no "
          f"compute; host ms/step by rank (waited for the device: a sync) {hosts}", flush=True)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"trace-tp-{name.replace(' ', '-')}.json")
        prof.export_chrome_trace(path)
        print(f"{name}: kernel trace of rank 0 -> {path}", flush=True)
    for k, ms in ks.ranked:
        print(f"  {ms:8.3f} ms  {k[:110]}", flush=True)
    print(f"{name}: the host's step under cProfile, rank 0, by own time:", flush=True)
    pstats.Stats(calls, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def comm_host(rank: int, world: int, cfg, cuda: bool) -> None:
    """--comm-host: the host time of one call of each collective the layer's step issues, at
    its sizes (us, median of 50 calls each enqueued while the GPU is held busy, so no call
    waits for the device): the eager step's collectives cost this much host time apiece.
    Environment variables of torch's NCCL process group (TORCH_NCCL_*) apply as set."""
    from tritium.distributed.tensor_parallel import (all_gather_dim0, all_reduce,
                                                     start_reduce_scatter_dim0)
    dev = "cuda" if cuda else "cpu"
    group = dist.group.WORLD
    rows = cfg["S"] // world * cfg["B"]
    x16 = torch.randn(rows, cfg["H"], device=dev).to(torch.bfloat16 if cuda else torch.float32)
    x8 = x16.to(torch.float8_e4m3fn)
    full16 = torch.randn(rows * world, cfg["H"], device=dev).to(x16.dtype)
    amaxes = torch.rand(64, device=dev)
    calls = [("all_gather fp8 (SP input)", lambda: all_gather_dim0(x8, group)),
             ("all_gather bf16 (SP input)", lambda: all_gather_dim0(x16, group)),
             ("reduce_scatter bf16 async (row output / dgrad)",
              lambda: start_reduce_scatter_dim0(full16, group)()),
             ("all_reduce 64 fp32 (amaxes)", lambda: all_reduce(amaxes, group)),
             ("all_reduce 4096 bf16 (a norm weight's grad)",
              lambda: all_reduce(x16[0].clone(), group))]
    lines = []
    for name, call in calls:
        for _ in range(5):
            call()
        times = []
        for _ in range(50):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e6))   # ~1 ms of GPU held busy: the call only enqueues
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()] if cuda else None)
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        lines.append(f"  {statistics.median(times):8.1f} us  {name}")
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        knobs = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_"))}
        print(f"host time per collective call (rank 0; env {knobs or 'default'}):", flush=True)
        print("\n".join(lines), flush=True)


def _knobs(opts: argparse.Namespace) -> str:
    """The run's settings that change how compute and communication share the GPU, as a
    suffix of the case name (none: ""), so that result files say what they measured."""
    knobs, env = [], launch_env()
    if opts.sm_carveout:
        knobs.append(f"cublas-sm-carveout {opts.sm_carveout}")
    if "CUDA_DEVICE_MAX_CONNECTIONS" in env:
        knobs.append(f"CUDA_DEVICE_MAX_CONNECTIONS={env['CUDA_DEVICE_MAX_CONNECTIONS']}")
    if env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") == "0":
        knobs.append("nccl flight recorder off")
    return "".join(f" | {k}" for k in knobs)


def _spawned(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _main_in_group(rank, world, opts)


def _main_in_group(rank: int, world: int, opts: argparse.Namespace) -> None:
    if not opts.tiny:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        if opts.sm_carveout:  # cuBLAS(Lt) GEMMs leave that many SMs to concurrent NCCL kernels
            torch._C._set_sm_carveout_experimental(opts.sm_carveout)
    dist.init_process_group("gloo" if opts.tiny else "nccl", rank=rank, world_size=world)
    try:
        if opts.comm_host:
            comm_host(rank, world, TINY if opts.tiny else FULL, not opts.tiny)
        else:
            run(rank, world, opts)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes on CPU over gloo: checks the script, times nothing real")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each variant, profile it (rank 0 prints its kernels)")
    ap.add_argument("--trace", metavar="DIR", nargs="?", const=os.environ.get("OUT", "."),
                    help="with --profile's output, rank 0's kernel trace of each variant as a "
                    "Chrome trace JSON file in DIR (default $OUT, else .)")
    ap.add_argument("--sm-carveout", type=int, default=0, metavar="N",
                    help="cuBLAS GEMMs (bf16, and FP8 dgrad/wgrad) use N SMs fewer, so that a "
                    "reduce-scatter started before wgrad runs beside it (torch's experimental "
                    "carveout; also try CUDA_DEVICE_MAX_CONNECTIONS=1); the case name says so")
    ap.add_argument("--comm-host", action="store_true",
                    help="only the host time of one call of each of the step's collectives")
    ap.add_argument("--no-graphed", dest="graphed", action="store_false",
                    help="the eager variants only")
    args = ap.parse_args()
    if not args.tiny and torch.cuda.device_count() < 2:
        print("bench_tp needs 2 GPUs (or --tiny for a CPU dry run)")
        return
    if "RANK" in os.environ:  # under torchrun
        _main_in_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    mp.spawn(_spawned, args=(2, _free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
