"""Context-parallel scaling: cp = 2, 4, 8 on the GPUs (or gloo processes) of one launch.

    torchrun --nproc_per_node=4 benchmarks/bench_cp_scale.py          # 4 GPUs: cp = 2 and 4
    torchrun --nproc_per_node=8 benchmarks/bench_cp_scale.py          # 8 GPUs: cp = 2, 4, 8
    torchrun --nproc_per_node=4 benchmarks/bench_cp_scale.py --tiny   # CPU/gloo smoke run
    python benchmarks/bench_cp_scale.py      # launches itself on every GPU (needs 2 or more)

The world size comes from the launcher. For every cp size that divides it, the world is cut
into world/cp groups of consecutive ranks and every group runs the same problem at once (so the
cp=2 groups of a 4-GPU run time two pairs side by side). Speed: fwd+bwd of
`context_parallel_attention`, causal bf16, B1 H32 D128, S = 32768 and 131072, p2p and
all_gather in the default (fast on GPU) mode with fp32 accumulation; a fixed number of
iterations on every rank (CUDA events, median), the max over all ranks. `speedup_vs_cp2` =
cp=2 ms / cp ms, `scaling` = that / (cp / 2): 1.0 is linear (target >= 0.85 for p2p at 131072).

Accuracy on a slice (`tritium.attention.cp.accuracy.measure`): the same attention restricted to
2 heads at S=32768 (an fp64 reference over the full 131072 x 131072 score matrix does not fit),
every configuration of `accuracy.CONFIGS` (exact / fast blocks, fp32 accumulation on / off,
p2p and all_gather) vs an fp64 reference computed from the same bf16 values, next to
single-device attention. Rank 0 writes the JSON (harness) and prints the tables.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish  # noqa: E402

from tritium.attention import cp  # noqa: E402
from tritium.attention.cp import accuracy  # noqa: E402

WARMUP, ITERS = 2, 5


def _time_ms(fn, group, device) -> float:
    """Median ms of fn over ITERS iterations (after WARMUP), the max over `group`."""
    for _ in range(WARMUP):
        fn()
    dist.barrier(group)
    times = []
    for _ in range(ITERS):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    ms = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


def _step(q, k, v, dout, group, comm):
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def run():
        for x in leaves:
            x.grad = None
        out = cp.context_parallel_attention(*leaves, group, qkv_format="bshd",
                                            attn_mask_type="causal", cp_comm_type=comm)
        out.backward(dout)
    return run


def _groups(world: int, rank: int) -> dict:
    """{cp: this rank's group of cp consecutive ranks} for cp in 2, 4, 8 dividing world (every
    rank creates every group, as new_group requires)."""
    mine = {}
    for size in (2, 4, 8):
        if size > world or world % size:
            continue
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine[size] = g
    return mine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--acc-seq", type=int, default=32768)
    parser.add_argument("--acc-heads", type=int, default=2)
    parser.add_argument("--no-accuracy", action="store_true", help="timing only")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke sizes: S 64, 2 heads, D 16, accuracy at S 64")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seqs, args.heads, args.dim, args.acc_seq, args.acc_heads = [64], 2, 16, 64, 2
    if "WORLD_SIZE" not in os.environ:   # run directly (e.g. by `python -m tritium bench`)
        gpus = torch.cuda.device_count()
        if gpus < 2 or args.tiny:
            print(f"bench_cp_scale: needs 2 or more CUDA GPUs (found {gpus}) or a launcher "
                  "(torchrun --nproc_per_node=N ...); nothing timed")
            return 0
        import subprocess
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
               __file__, *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd).returncode
    use_cuda = torch.cuda.is_available() and not args.tiny
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16
    groups = _groups(world, rank)
    if not groups:
        raise SystemExit(f"bench_cp_scale: world size {world} has no cp size in (2, 4, 8)")
    rows, tables = [], []
    try:
        for s in args.seqs:
            q, k, v, dout = accuracy.make_inputs(1, s, args.heads, args.heads, args.dim, dtype,
                                                 device, seed=s)
            dout = dout.reshape(1, s, args.heads * args.dim)
            case = f"B1 H{args.heads} D{args.dim} S{s} causal bf16"
            for comm in ("p2p", "all_gather"):
                for size, group in groups.items():
                    r = dist.get_rank(group)
                    loc = [cp.shard(x, size, r, 1) for x in (q, k, v, dout)]
                    ms = _time_ms(_step(*loc, group, comm), None, device)
                    rows.append({"case": f"{case} {comm}", "variant": f"cp={size}",
                                 "cp": size, "ms": round(ms, 3)})
                    if rank == 0:
                        print(rows[-1], flush=True)
                    del loc
            del q, k, v, dout
            if use_cuda:
                torch.cuda.empty_cache()
        for size, group in ({} if args.no_accuracy else groups).items():
            acc_rows = accuracy.measure(group, b=1, s=args.acc_seq, h=args.acc_heads,
                                        hk=args.acc_heads, d=args.dim, causal=True, dtype=dtype,
                                        device=device, seed=7)
            if rank == 0:
                title = (f"{torch.cuda.get_device_name() if use_cuda else 'CPU (gloo)'}, cp={size}, "
                         f"bf16, B1 S={args.acc_seq} H={args.acc_heads} D={args.dim} causal "
                         "(a head slice of the timed problem)")
                tables.append(accuracy.table(acc_rows, title))
                for row in acc_rows:
                    rows.append({"case": f"accuracy S{args.acc_seq} H{args.acc_heads}",
                                 "variant": f"cp={size} {row['config']}",
                                 **{n: row[n] for n in accuracy.NAMES}})
        if rank == 0:
            base = {r["case"]: r["ms"] for r in rows if r.get("cp") == 2}
            for r in rows:
                if "ms" in r and r["case"] in base:
                    r["speedup_vs_cp2"] = round(base[r["case"]] / r["ms"], 3)
                    r["scaling"] = round(r["speedup_vs_cp2"] / (r["cp"] / 2), 3)
            finish("cp_scale", rows, baseline="cp=2", gpus=world)
            print("\n".join(["", "Scaling (fwd+bwd ms, speedup vs cp=2, fraction of linear):"]
                            + [f"  {r['case']:<42} {r['variant']:<6} {r['ms']:10.3f} ms  "
                               f"x{r['speedup_vs_cp2']:.2f}  {100 * r['scaling']:.0f}%"
                               for r in rows if "scaling" in r]))
            print("\n\n".join([""] + tables))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
