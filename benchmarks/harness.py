"""Shared benchmark plumbing: timing, environment record, result files, tables.

Timing is `triton.testing.do_bench` (CUDA events, median). Each bench script builds rows
{bench, case, variant, ms, ...} and calls `finish()`, which adds ratios against the row marked as
baseline of the same case, prints a table and writes JSON to $OUT (when set) or
benchmarks/results/, named <date>-<gpu>-<bench>.json ("<n>x<gpu>" for a run on n GPUs). The
environment record (env_info) holds the date, versions, GPU and the git commit of the tree the
run was made from. `python -m tritium bench --markdown` builds benchmarks/RESULTS.md from those
files. Peers (torchao, liger) are optional imports: a missing peer becomes a row
with an error instead of a crash.

torch.compile variants (issue 20) are compiled with fullgraph=True, so a graph break raises
instead of running part of the model eagerly; `error_fields` turns that into an error row with
fullgraph False, `compile_counts` says how many graphs were compiled and how often
mode="reduce-overhead" skipped CUDA graphs (a silent fallback the benches turn into an error),
and the timed steps run under `no_recompiles()`: a recompile after the warm-up raises.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
from typing import NamedTuple

import torch

from tritium import _env

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def git_commit() -> dict:
    """{"commit": short hash of HEAD, "dirty": uncommitted changes to tracked files} of the
    tree the run is made from. A copy of the tree without .git (a GPU machine that got the
    files only) names its commit in $BENCH_COMMIT; {} when neither says."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"]}
    root = pathlib.Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def env_info() -> dict:
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "python": platform.python_version(), **git_commit()}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for peer in ("torchao", "liger_kernel"):
        try:
            mod = __import__(peer)
            info[peer] = getattr(mod, "__version__", "installed")
        except Exception:
            info[peer] = None
    launch = launch_env()
    if launch:
        info["launch_env"] = launch
    return info


# Launch settings that change how compute and communication share the GPU or what the host pays
# per collective (docs/tensor_parallel.md, docs/distributed.md), and tritium's switches of which
# code runs (tritium/_env.py): recorded with every result.
LAUNCH_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_TRACE_BUFFER_SIZE", "NCCL_ALGO",
              "NCCL_PROTO", "NCCL_NVLS_ENABLE") + _env.SWITCHES


def launch_env() -> dict:
    """The LAUNCH_ENV variables this process was started with (only those set)."""
    return {k: os.environ[k] for k in LAUNCH_ENV if os.environ.get(k)}


def loss_tail(curve, n: int = 10) -> float:
    """The mean of a loss curve's last n steps (the loss a benchmark compares across variants:
    one step's loss wobbles while the curve still falls)."""
    tail = list(curve)[-n:]
    return sum(tail) / len(tail)


def time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def interleaved_rounds(fns: dict, rounds: int = 7, rep: int = 100) -> dict:
    """{name: [ms of each round]}: `rounds` rounds of `time_ms` of each fn in turn (the order
    reversed every other round), for host-bound steps compared with each other. A host's speed
    drifts over seconds (clocks, other processes); timed one after the other, two such steps
    measured 1.17x and 1.57x apart on the same code and GPU kind."""
    seen = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            seen[name].append(time_ms(fns[name], warmup=10, rep=rep))
    return seen


def median_ms(seen: dict) -> dict:
    """{name: the median over rounds} of `interleaved_rounds`' times."""
    import statistics
    return {name: round(statistics.median(v), 4) for name, v in seen.items()}


def paired_speedups(seen: dict, baseline: str) -> dict:
    """{name: the median over rounds of baseline's ms / name's ms in the same round}: each
    round's pair ran back to back, so a drift slower than a round cancels in its ratio, where
    the ratio of the two medians takes each from a different moment."""
    import statistics
    return {name: round(statistics.median(b / t for b, t in zip(seen[baseline], v)), 4)
            for name, v in seen.items()}


def settle_gpu(seconds: float = 3.0) -> None:
    """Run large bf16 GEMMs for `seconds`, so that what is timed next runs at the GPU's
    sustained clock. An H100 SXM under bf16 GEMM load reaches its 700 W cap within a second and
    drops from 1980 MHz to ~1500-1800 MHz (nvidia-smi: throttle reason SW power cap); a variant
    timed first on an idle GPU gets the boost clock the others do not (bf16 nn.Linear 8192x4096
    ->4096: 1.035 ms first, 1.16-1.20 ms in the five runs after it, same process)."""
    import time
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def cuda_profile(fn, iters: int):
    """torch.profiler (CUDA activity only) over `iters` calls of fn, after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def _merged(spans):
    """Sorted, disjoint intervals covering `spans` ((start, end) pairs)."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length_outside(spans, cover):
    """Total length of the merged `spans` not inside the merged `cover` (both sorted)."""
    total, j = 0.0, 0
    for a, b in spans:
        inside = 0.0
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            inside += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
        total += (b - a) - inside
    return total


class KernelSummary(NamedTuple):
    """Per step, in ms: `busy` the union of the non-NCCL kernels' intervals, `nccl` the NCCL
    kernels' summed time, `nccl_exposed` the part of the NCCL kernels' union that no compute
    kernel overlaps, `exposed_by_kind` the same per collective kind ({"AllGather": ms,
    "ReduceScatter": ms, ...}, from the NCCL kernels' names); `ranked` the top (kernel, ms)
    pairs."""

    busy: float
    nccl: float
    nccl_exposed: float
    ranked: list
    exposed_by_kind: dict


_NCCL_KIND = re.compile(r"(AllGather|ReduceScatter|AllReduce|Broadcast|Reduce|SendRecv|Send|Recv)")


def nccl_kind(kernel: str) -> str:
    """The collective of an NCCL kernel's name ("ncclDevKernel_AllGather_RING_LL" ->
    "AllGather"), "other" where the name says none."""
    found = _NCCL_KIND.search(kernel)
    return found.group(1) if found else "other"


def kernel_summary(prof, steps: int, top: int = 25) -> KernelSummary:
    """From a torch.profiler run over `steps` steps. The rest of the wall beyond busy +
    nccl_exposed is the GPU idle (waiting for the host)."""
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(ev, "is_user_annotation", False)]
    kernels, compute, comm, by_kind = {}, [], [], {}
    for ev in events:
        kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time / 1e3 / steps
        span = (ev.time_range.start, ev.time_range.end)
        if "nccl" in ev.name.lower():
            comm.append(span)
            by_kind.setdefault(nccl_kind(ev.name), []).append(span)
        else:
            compute.append(span)
    compute, comm = _merged(compute), _merged(comm)
    busy = sum(b - a for a, b in compute)
    nccl = sum(ms for k, ms in kernels.items() if "nccl" in k.lower())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    exposed = {kind: _length_outside(_merged(spans), compute) / 1e3 / steps
               for kind, spans in sorted(by_kind.items())}
    return KernelSummary(busy / 1e3 / steps, nccl, _length_outside(comm, compute) / 1e3 / steps,
                         ranked, exposed)


def device_syncs(fn) -> dict:
    """Run fn() once under torch.cuda.set_sync_debug_mode("warn") and count the synchronizing
    CUDA operations (a host read of a device tensor, a stream or device sync) by the innermost
    line outside torch that made them: {"folder/file.py:line": count}, in the order first seen.
    A step that syncs lets the GPU drain and then wait for the host; where the host is much
    slower than the GPU within one phase, look here. Other warnings raised by fn are dropped.
    Without CUDA fn() just runs (nothing syncs)."""
    import traceback
    import warnings
    sites: dict = {}

    def seen(message, *args, **kwargs):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings.py" not in f.filename]
        site = (f"{'/'.join(frames[-1].filename.rsplit('/', 2)[-2:])}:{frames[-1].lineno}"
                if frames else "?")
        sites[site] = sites.get(site, 0) + 1

    cuda = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
    return sites


def gpu_ms(fn, iters: int = 20) -> float:
    """Device time of one call of fn: the kernels' (and memsets'/copies') own time from
    torch.profiler, summed and divided by iters. Host time is not in it, so next to time_ms it
    says whether a step is bound by the GPU or by the host enqueueing it."""
    total_us = sum(e.self_device_time_total for e in cuda_profile(fn, iters).key_averages())
    return total_us / iters / 1e3


def peak_mem_mb(fn) -> float:
    """Peak allocated memory above what was allocated before one call of fn (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd_runner(module, x, dy, ctx=None, fresh_input=False):
    """A callable that runs module(x) (inside ctx() when given) and backward(dy). With
    fresh_input the input is made inside the step by a previous op (`x * 1.0`), as in a
    network, so that what the module keeps for backward counts in its peak memory."""
    def run():
        inp = x * 1.0 if fresh_input else x
        if ctx is None:
            out = module(inp)
        else:
            with ctx():
                out = module(inp)
        del inp
        out.backward(dy)
    return run


def fwd_bwd_step(module, x, dy, ctx=None):
    """(step, reset): step resets the grads of module and x, then runs fwd+bwd."""
    grads = list(module.parameters()) + [x]
    run = fwd_bwd_runner(module, x, dy, ctx)

    def reset():
        for p in grads:
            p.grad = None

    def step():
        reset()
        run()
    return step, reset


def measure_fwd_bwd(module, x, dy, ctx=None, in_network=False) -> dict:
    """Median ms, device time (`gpu_ms`) and peak MiB of fwd+bwd, grads reset before each call
    (and the peak with the input made in the step when in_network)."""
    step, reset = fwd_bwd_step(module, x, dy, ctx)
    run = fwd_bwd_runner(module, x, dy, ctx)
    step(); step()
    out = {"ms": round(time_ms(step), 4), "gpu_ms": round(gpu_ms(step), 4)}
    reset()
    out["peak_mb"] = round(peak_mem_mb(run), 1)
    if in_network:
        reset()
        out["peak_mb_in_network"] = round(
            peak_mem_mb(fwd_bwd_runner(module, x, dy, ctx, fresh_input=True)), 1)
    return out


def add_ratio(rows: list[dict], field: str, pairs) -> None:
    """For each (variant, versus) of pairs and each case where both have ms: the variant's row
    gets `field` = versus ms / variant ms (how many times faster than `versus`, same run)."""
    ms = {(r["case"], r["variant"]): r["ms"] for r in rows if "ms" in r}
    for r in rows:
        for variant, versus in pairs:
            if r["variant"] == variant and "ms" in r and (r["case"], versus) in ms:
                r[field] = round(ms[(r["case"], versus)] / r["ms"], 3)


def compile_counts() -> dict:
    """dynamo's count of graphs compiled so far in this process and inductor's count of CUDA
    graphs skipped (mode="reduce-overhead" running a graph without CUDA graphs)."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def no_recompiles():
    """A context in which a recompile raises (torch._dynamo.config.error_on_recompile): the
    timed steps of a compiled variant, after the warm-up that compiled it."""
    return torch._dynamo.config.patch(error_on_recompile=True)


def error_fields(exc: BaseException) -> dict:
    """An error row's fields for a variant that raised: the exception, its head and tail kept
    (dynamo names the user frame where it stopped at the end) without dynamo's closing hint;
    dynamo failing to trace one graph under fullgraph=True (a graph break, a data-dependent
    guard) also reads fullgraph False."""
    from torch._dynamo.exc import Unsupported, UserError
    text = f"{type(exc).__name__}: {exc}".split("\nSet TORCHDYNAMO_VERBOSE")[0].strip()
    if len(text) > 700:
        text = text[:350] + " [...] " + text[-350:]
    out = {"error": text}
    if isinstance(exc, (Unsupported, UserError)):
        out["fullgraph"] = False
    return out


def finish(bench: str, rows: list[dict], baseline: str, gpus: int = 1) -> dict:
    """Add `speedup_vs_<baseline>` to every row with ms, then write {bench, baseline, env, rows}
    (env: env_info() and `gpus`, the number of GPUs the run used) and print a table."""
    by_case = {r["case"]: r for r in rows if r["variant"] == baseline and "ms" in r}
    for r in rows:
        base = by_case.get(r["case"])
        if base and "ms" in r:
            r[f"speedup_vs_{baseline}"] = round(base["ms"] / r["ms"], 3)
    out = {"bench": bench, "baseline": baseline, "env": {**env_info(), "gpus": gpus},
           "rows": rows}
    dest = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS_DIR
    dest.mkdir(parents=True, exist_ok=True)
    gpu = out["env"].get("gpu", "cpu").replace(" ", "_")
    gpu = f"{gpus}x{gpu}" if gpus > 1 else gpu
    path = dest / f"{out['env']['date']}-{gpu}-{bench}.json"
    path.write_text(json.dumps(out, indent=1))
    print_table(bench, rows, baseline)
    print(f"wrote {path}")
    return out


def print_table(bench: str, rows: list[dict], baseline: str) -> None:
    key = f"speedup_vs_{baseline}"
    print(f"\n== {bench} ({env_info().get('gpu', 'cpu')}) ==")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<28} {r['variant']:<34} ERROR {r['error'][:80]}")
            continue
        if "ms" not in r:  # a row of other measurements (e.g. accuracy)
            continue
        extra = "".join(f" {k}={r[k]}" for k in ("gpu_ms", "tflops", "gbps", "peak_mb", "peak_mb_in_network",
                                                  "vs_eager", "vs_torchao_compiled", "compile_s", "graphs")
                        if k in r)
        print(f"{r['case']:<28} {r['variant']:<34} {r['ms']:8.3f} ms  x{r.get(key, float('nan')):.2f}"
              f"{extra}")
