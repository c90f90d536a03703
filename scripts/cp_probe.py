"""Usage: torchrun --nproc_per_node=N scripts/cp_probe.py [--seq 131072] [--no-trace]

Where a context-parallel step's time goes (GPUs, under torchrun; a diagnostic, not a bench).

1. Ring bandwidth: `Ring.exchange` of one K,V pair (bf16) and of one dK,dV pair (fp32) of the
   local shape at `--seq`, for every cp group size 2, 4, 8 dividing the world (groups of
   consecutive ranks, all running at once, as bench_cp_scale does): GB/s per rank, sent bytes.
2. One fwd+bwd of p2p CP attention at cp = world under torch.profiler: rank 0 and the last rank
   write chrome traces to $OUT, and every rank prints its compute-stream busy time, NCCL kernel
   time and the step's wall time.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_cp_scale import _groups, _step  # noqa: E402

from tritium.attention import cp  # noqa: E402
from tritium.attention.cp import accuracy  # noqa: E402
from tritium.attention.cp.merge import Ring  # noqa: E402


def _bandwidth(group, size, seq, heads, dim, device):
    r = dist.get_rank(group)
    local = seq // size
    out = {}
    for name, dtype in (("kv bf16", torch.bfloat16), ("dkv fp32", torch.float32)):
        pair = [torch.randn(1, local, heads, dim, device=device).to(dtype) for _ in range(2)]
        ring = Ring(group, dist.get_process_group_ranks(group), r)
        for _ in range(3):
            Ring.wait(ring.exchange(pair))
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 10
        a.record()
        for _ in range(iters):
            Ring.wait(ring.exchange(pair))
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / iters
        nbytes = sum(t.numel() * t.element_size() for t in pair)
        out[name] = (nbytes / 2**20, ms, nbytes / ms / 1e6)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--no-trace", action="store_true")
    args = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    groups = _groups(world, rank)
    for size, group in groups.items():
        res = _bandwidth(group, size, args.seq, args.heads, args.dim, device)
        if rank == 0:
            for name, (mib, ms, gbs) in res.items():
                print(f"bandwidth cp={size} {name:9s} {mib:7.0f} MiB  {ms:8.3f} ms  "
                      f"{gbs:6.1f} GB/s  env={env}", flush=True)
    if args.no_trace:
        dist.destroy_process_group()
        return 0
    q, k, v, dout = accuracy.make_inputs(1, args.seq, args.heads, args.heads, args.dim,
                                         torch.bfloat16, device, seed=1)
    dout = dout.reshape(1, args.seq, -1)
    group = dist.group.WORLD
    loc = [cp.shard(x, world, rank, 1) for x in (q, k, v, dout)]
    del q, k, v, dout
    step = _step(*loc, group, "p2p")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b)
    nccl = comp = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        if e.key.startswith("ncclDevKernel") or e.key.startswith("ncclKernel"):
            nccl += t
        elif getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            comp += t
    print(f"rank {rank}: step {wall:.2f} ms, GPU kernels (non-NCCL) {comp:.2f} ms, "
          f"NCCL kernels {nccl:.2f} ms", flush=True)
    if rank in (0, world - 1) and os.environ.get("OUT"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"cp_trace_S{args.seq}_rank{rank}.json"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
