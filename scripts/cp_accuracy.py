"""Usage: python scripts/cp_accuracy.py [--gpu] [--no-cpu] [--seq S ...] [--json FILE]

Print the context-parallel accuracy table: bf16 CP attention vs an fp64 reference, next to
single-device bf16 attention (tritium.attention.cp.accuracy does the measuring).

    python scripts/cp_accuracy.py                  # CPU, gloo, CP = 2 and 4 (reference backend)
    python scripts/cp_accuracy.py --gpu            # + 2 GPUs, NCCL, B1 H12 D128 S=8192 causal
    python scripts/cp_accuracy.py --gpu --seq 8192 32768 --json out.json

Each configuration spawns its own process group (torch.multiprocessing); rank 0 prints a
markdown table per (device, cp, shape): max abs error vs fp64 and its ratio to single device,
the fraction of elements outside fp32 tolerance of fp64, and the fraction that differ from the
single-device result beyond fp32 tolerance. docs/context_parallel.md holds the CPU output.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, shape, seed, queue):
    import torch.distributed as dist
    if backend == "gloo":
        os.environ["TRITIUM_FORCE_REF"] = "1"
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        device = "cpu"
    else:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = f"cuda:{rank}"
    from tritium import _env
    _env.reload()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        from tritium.attention.cp import accuracy
        rows = accuracy.measure(dist.group.WORLD, device=device, seed=seed, **shape)
        if rank == 0:
            queue.put(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, backend: str, shape: dict, seed: int = 0):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), backend, shape, seed, queue),
                       nprocs=world, join=True, start_method="spawn")
    return queue.get()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--gpu", action="store_true", help="also run on 2 GPUs with NCCL")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU (gloo) tables")
    ap.add_argument("--seq", type=int, nargs="+", default=[8192], help="GPU sequence lengths")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args(argv)
    jobs = []
    if not args.no_cpu:
        for world in (2, 4):
            jobs.append(("cpu (gloo)", world, "gloo",
                         dict(b=1, s=512, h=4, hk=2, d=64, causal=True)))
    if args.gpu:
        if torch.cuda.device_count() < 2:
            print("--gpu: needs 2 GPUs, found", torch.cuda.device_count(), file=sys.stderr)
            return 1
        for s in args.seq:
            jobs.append((torch.cuda.get_device_name(0) + " (nccl)", 2, "nccl",
                         dict(b=1, s=s, h=12, hk=12, d=128, causal=True)))
    from tritium.attention.cp.accuracy import table
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # no NVLink multicast
    everything = []
    for device, world, backend, shape in jobs:
        t0 = time.time()
        rows = run(world, backend, shape)
        title = (f"{device}, cp={world}, bf16, B{shape['b']} S={shape['s']} H={shape['h']} "
                 f"H_kv={shape['hk']} D={shape['d']}, "
                 f"{'causal' if shape['causal'] else 'no_mask'} ({time.time() - t0:.0f} s)")
        print(table(rows, title), end="\n\n", flush=True)
        everything.append(dict(device=device, cp=world, **shape, rows=rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
