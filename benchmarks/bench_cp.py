"""Context-parallel attention on 2 GPUs (NCCL, 2 processes spawned here) vs one GPU.

B1 H12 D128 causal bf16, S = 8192 and 32768. Rows per S: "single GPU" (dot_product_attention
on the full sequence, auto backend = cuDNN on Hopper; the baseline), and CP=2 fwd+bwd of the
same S split over 2 GPUs: p2p fast (cuDNN blocks, fp32 merge/accumulation: the default on GPU),
p2p exact (fp32-accurate blocks on tritium's flash kernel, split products), p2p fp32 partials
(the same kernel with P / dS rounded once, fp32 partials), p2p fast with 16-bit accumulation,
all_gather fast, and fp32 partials once more on a process group with high-priority NCCL
streams. speedup_vs_single = single ms / CP ms (targets: >= 1.8 at 32768 for p2p fast and for
fp32 partials on the default group).
Timing: a fixed number of fwd+bwd iterations on every rank (do_bench picks its own count per
process, which would desynchronize the ranks' collectives), CUDA events per iteration, median,
the max over ranks. Each CP row also carries its error vs an fp64 reference, as the ratio to the
single-GPU error (max abs, and root mean square: worst of out/dq/dk/dv) and the fraction of
elements that differ from single-GPU beyond fp32 tolerance (tritium.attention.cp.accuracy),
measured at S=8192.

    python benchmarks/bench_cp.py            # ~2 minutes on 2 H100/H200; JSON via harness
    python benchmarks/bench_cp.py --profile  # p2p fast and fp32 partials (both groups) at
                                             # the largest S only: each rank's iteration
                                             # times, rank 0's kernels from torch.profiler
                                             # (where time goes), each rank's last step
Needs 2 GPUs; otherwise it says so and exits with status 0 (nothing timed, nothing failed).
"""
from __future__ import annotations

import os
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import cuda_profile, finish  # noqa: E402

B, H, D = 1, 12, 128
SEQS = (8192, 32768)
WARMUP, ITERS = 3, 10
# fp32 partials on a group whose NCCL streams have high priority (ProcessGroupNCCL.Options
# is_high_priority_stream; TORCH_NCCL_HIGH_PRIORITY=1 sets it for every group): NCCL's kernels
# take SMs as soon as one frees instead of after the attention kernel's queued blocks
HIGH_PRIORITY = "cp2 p2p fp32 partials, NCCL high priority"
# variant: (cp_comm_type, mode, fp32_accumulation)
VARIANTS = {"cp2 p2p fast": ("p2p", "fast", True), "cp2 p2p exact": ("p2p", "exact", True),
            "cp2 p2p fp32 partials": ("p2p", "fp32_partials", True),
            HIGH_PRIORITY: ("p2p", "fp32_partials", True),
            "cp2 p2p fast, bf16 acc": ("p2p", "fast", False),
            "cp2 all_gather fast": ("all_gather", "fast", True)}
ACC_CONFIGS = {"cp2 p2p fast": "fast, fp32 acc", "cp2 p2p exact": "exact, fp32 acc",
               "cp2 p2p fp32 partials": "fp32 partials, fp32 acc",
               "cp2 p2p fast, bf16 acc": "fast, 16-bit acc"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iteration_ms(fn, iters: int = ITERS, ahead: int = 0) -> tuple:
    """(ms of each of `iters` iterations of fn on this GPU (after WARMUP), their mean period:
    first start to last end / iters). ahead > 0: the host launches iteration i only
    after iteration i - ahead has ended on the GPU (at most `ahead` steps queued)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        if ahead and i >= ahead:
            ev[i - ahead][1].synchronize()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev], ev[0][0].elapsed_time(ev[-1][1]) / iters


def _median_ms(fn) -> float:
    """Median ms of fn on this GPU over ITERS iterations (after WARMUP)."""
    return statistics.median(_iteration_ms(fn)[0])


def _time(fn, group) -> float:
    """Median ms of fn on every rank of the group (same iteration count), max over ranks."""
    import torch.distributed as dist
    dist.barrier(group)
    ms = torch.tensor(_median_ms(fn), device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


def _step(attn, q, k, v, dout):
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def run():
        for x in leaves:
            x.grad = None
        attn(*leaves).backward(dout)
    return run


def _timeline(kernels, iters: int) -> str:
    """The last step's kernels in start order: start (ms from the step's first kernel),
    duration, name; kernels under 20 us are counted, not listed."""
    per = len(kernels) // iters
    step = kernels[-per:]
    t0, lines, small = step[0].time_range.start, [], 0
    starts = [kernels[i * per].time_range.start for i in range(iters)]
    ends = [max(e.time_range.end for e in kernels[i * per:(i + 1) * per]) for i in range(iters)]
    lines.append("  steps' first to last kernel: " + ", ".join(
        f"{(b - a) / 1e3:.3f}" for a, b in zip(starts, ends)) + " ms; from one step's first "
        "kernel to the next's: " + ", ".join(f"{(b - a) / 1e3:.3f}"
                                             for a, b in zip(starts, starts[1:])) + " ms")
    for e in step:
        dur = (e.time_range.end - e.time_range.start) / 1e3
        if dur < 0.02:
            small += 1
            continue
        lines.append(f"  {(e.time_range.start - t0) / 1e3:8.3f} {dur:7.3f}  {e.name[:60]}")
    return "\n".join(lines + [f"  (+{small} kernels under 20 us)"])


def _host_ms(fn, iters: int = 5) -> float:
    """The host's median ms per call of fn (launches only: no synchronize between calls)."""
    import time
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(ms)


def _profile(fn, iters: int = 3) -> tuple:
    """(rank's kernel table over `iters` fwd+bwd steps with their summed device time per step;
    the host's time per step and the last step's timeline)."""
    host = f"host: {_host_ms(fn):.3f} ms per step (launches only)"
    prof = cuda_profile(fn, iters)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / iters / 1e3
    spans = {True: [], False: []}       # NCCL kernels, everything else
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    for e in kernels:
        spans["nccl" in e.name.lower()].append((e.time_range.start, e.time_range.end))

    def union(iv):
        total, end = 0.0, float("-inf")
        for a, b in sorted(iv):
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total
    compute, nccl = union(spans[False]), union(spans[True])
    hidden = compute + nccl - union(spans[False] + spans[True])
    return (f"kernels+copies summed: {busy:.3f} ms per step; non-NCCL busy "
            f"{compute / iters / 1e3:.3f} ms, NCCL {nccl / iters / 1e3:.3f} ms of which "
            f"{hidden / iters / 1e3:.3f} ms run under other kernels\n"
            + events.table(sort_by="self_device_time_total", row_limit=25,
                           max_name_column_width=70)), f"{host}\n{_timeline(kernels, iters)}"


def _worker(rank, port, queue, profile_only=False):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    high_priority = dist.new_group([0, 1], pg_options=options)
    import tritium.attention as A
    from tritium.attention import cp
    from tritium.attention.cp import accuracy
    group, dev = dist.group.WORLD, torch.device("cuda", rank)
    rows = []
    seqs, variants = ((SEQS[-1:], ["cp2 p2p fast", "cp2 p2p fp32 partials", HIGH_PRIORITY])
                      if profile_only else (SEQS, list(VARIANTS)))
    try:
        for s in seqs:
            q, k, v, dout = accuracy.make_inputs(B, s, H, H, D, torch.bfloat16, dev, seed=s)
            dout = dout.reshape(B, s, H * D)
            case = f"B{B} H{H} D{D} S{s} causal bf16"
            if rank == 0:    # single-GPU time on rank 0 while rank 1 waits
                single = _step(lambda a, b, c: A.dot_product_attention(
                    a, b, c, qkv_format="bshd", attn_mask_type="causal"), q, k, v, dout)
                rows.append(dict(bench="cp", case=case, variant="single GPU",
                                 ms=round(_median_ms(single), 3)))
                del single
            dist.barrier()
            loc = [cp.shard(x, 2, rank, 1) for x in (q, k, v, dout)]
            for name in variants:
                comm, mode, acc = VARIANTS[name]
                g = high_priority if name == HIGH_PRIORITY else group
                fn = _step(lambda a, b, c, g=g: cp.context_parallel_attention(
                    a, b, c, g, qkv_format="bshd", attn_mask_type="causal",
                    cp_comm_type=comm, mode=mode, fp32_accumulation=acc), *loc)
                ms = _time(fn, g)
                rows.append(dict(bench="cp", case=case, variant=name, ms=round(ms, 3)))
                if profile_only:
                    for ahead in (0, 2):     # the host free / at most 2 steps ahead
                        ms_each, period = _iteration_ms(fn, 2 * ITERS, ahead)
                        print(f"rank {rank}, {name}, host "
                              + (f"at most {ahead} steps ahead" if ahead else "free")
                              + ": iterations (ms) " + " ".join(f"{x:.2f}" for x in ms_each)
                              + f"; mean period {period:.3f}", flush=True)
                    table, timeline = _profile(fn)
                    if rank == 0:
                        print(f"rank 0, {name}, {case}: {ms:.3f} ms per step\n{table}",
                              flush=True)
                    for r in range(2):      # each rank's last step, one after the other
                        if r == rank:
                            print(f"rank {rank}, {name}: last step's kernels (start ms, ms)\n"
                                  f"{timeline}", flush=True)
                        dist.barrier()
            del q, k, v, dout, loc
            torch.cuda.empty_cache()
        if profile_only:
            if rank == 0:
                queue.put((rows, []))
            return
        acc_rows = accuracy.measure(group, b=B, s=SEQS[0], h=H, hk=H, d=D, causal=True,
                                    device=dev, seed=7)
        if rank == 0:
            by = {r["config"]: r for r in acc_rows}
            for r in rows:
                label = ACC_CONFIGS.get(r["variant"])
                if label:
                    e = by[label]
                    r["err_ratio_vs_single"] = round(max(e[n]["ratio"] for n in accuracy.NAMES), 3)
                    r["err_rms_ratio_vs_single"] = round(
                        max(e[n]["rms_ratio"] for n in accuracy.NAMES), 4)
                    r["frac_off_single"] = round(max(e[n]["vs_single"] for n in accuracy.NAMES), 4)
            queue.put((rows, acc_rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    profile_only = "--profile" in argv
    if torch.cuda.device_count() < 2:
        print(f"bench_cp: needs 2 CUDA GPUs, found {torch.cuda.device_count()}; nothing timed")
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(_free_port(), queue, profile_only), nprocs=2, join=True,
                       start_method="spawn")
    rows, acc_rows = queue.get()
    if profile_only:
        print(rows)
        return 0
    from tritium.attention.cp.accuracy import table
    print(table(acc_rows, f"{torch.cuda.get_device_name(0)} cp=2, B{B} H{H} D{D} "
                          f"S{SEQS[0]} causal bf16: error vs fp64"))
    finish("cp", rows, baseline="single GPU", gpus=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
