"""Which CUDA API calls and aten ops an eager Linear step makes, and what each costs on this host.

    python scripts/api_calls.py [T K N]        (default 8192 4096 4096)

torch.profiler (CPU + CUDA activity) over 20 steps of tritium's FP8 Linear (delayed scaling)
and of bf16 nn.Linear: per step, the count and mean host duration of every CUDA runtime /
driver call and of every aten op, sorted by total host time. On a VM a CUDA API call can cost
far more than on bare metal; this says how much of an eager step's host time they are.
"""
from __future__ import annotations

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from linear_timeline import bf16_linear_step  # noqa: E402
from profile_host import fp8_linear_step  # noqa: E402


def report(name, step, steps=20):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        kind = "kernel" if e.device_type == torch.autograd.DeviceType.CUDA else "host"
        if kind == "kernel":
            continue
        s = stats[e.name]
        s[0] += 1
        s[1] += e.cpu_time_total  # us, includes children for ops
    print(f"\n== {name}: per step (count, mean us, total us) sorted by total")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    for op, (count, total) in rows[:40]:
        print(f"  {op[:60]:60s} {count / steps:6.1f} {total / count:8.1f} {total / steps:9.1f}")


def main(t=8192, k=4096, n=4096):
    print(torch.cuda.get_device_name(), torch.__version__)
    report("tritium FP8 Linear (delayed, eager)", fp8_linear_step(t, k, n))
    report("bf16 nn.Linear", bf16_linear_step(t, k, n))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
