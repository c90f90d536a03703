"""When each kernel of an eager step is launched by the host and when it runs on the GPU.

For a host-bound step the wall time is set by the launch of the last long kernels, not by the
sum of host time: this prints, for the median step of N (each after a do_bench-style L2 flush),
every kernel with its host launch offset and its GPU start/end offset from the step's start,
and the GPU's idle gaps, so one can see which host stretch delays the GPU.

    python scripts/linear_timeline.py [fp8|bf16|both] [T K N]    (default both 8192 4096 4096)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_host import fp8_linear_step  # noqa: E402


def bf16_linear_step(t, k, n):
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.weight.grad = x.grad = None
        layer(x).backward(dy)
    return step


def _trace(step, steps):
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            flush.zero_()
            with record_function("step"):
                step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _steps(events):
    marks = sorted((e for e in events if e.get("name") == "step" and e.get("ph") == "X"
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    out = []
    for i, m in enumerate(marks):
        t0 = m["ts"]
        t_next = marks[i + 1]["ts"] if i + 1 < len(marks) else float("inf")
        rows = []
        for k in kernels:
            launch = launches.get(k["args"].get("correlation"))
            if launch is None or not (t0 <= launch["ts"] < t_next):
                continue
            rows.append((k["name"][:60], launch["ts"] - t0, k["ts"] - t0, k["ts"] + k["dur"] - t0))
        out.append({"host_us": m["dur"], "rows": rows,
                    "gpu_end_us": max((r[3] for r in rows), default=0.0)})
    return out


def report(name, step, steps=15):
    runs = _steps(_trace(step, steps))
    runs.sort(key=lambda r: r["gpu_end_us"])
    med = runs[len(runs) // 2]
    busy = sum(r[3] - r[2] for r in med["rows"])
    print(f"\n=== {name}: median step: host {med['host_us']:.0f} us, last kernel ends at "
          f"{med['gpu_end_us']:.0f} us, kernels busy {busy:.0f} us "
          f"(all steps' ends: {[round(r['gpu_end_us']) for r in runs]})")
    print(f"{'kernel':<60} {'launch':>7} {'start':>7} {'end':>7} {'wait':>6}")
    prev_end = None
    for kname, launch, start, end in med["rows"]:
        gap = start - prev_end if prev_end is not None else 0.0
        print(f"{kname:<60} {launch:7.0f} {start:7.0f} {end:7.0f} {gap:6.0f}")
        prev_end = end


def main(argv):
    which = argv[0] if argv else "both"
    t, k, n = map(int, argv[1:4]) if len(argv) >= 4 else (8192, 4096, 4096)
    if which in ("bf16", "both"):
        report(f"bf16 nn.Linear T{t} {k}->{n}", bf16_linear_step(t, k, n))
    if which in ("fp8", "both"):
        report(f"tritium FP8 delayed T{t} {k}->{n}", fp8_linear_step(t, k, n))


if __name__ == "__main__":
    main(sys.argv[1:])
