"""Usage: python scripts/profile_host.py
       {host,cputime,threading,parts,trace,launch,model-cpu,model-cpu-llama,model-cpu-graphs,
        model-cpu-tp,kernels,ops} [args]

Where the time of an eager step goes, host and GPU (diagnostics; all but model-cpu* need CUDA).
The FP8 step is a bf16 tritium.Linear under fp8_autocast (delayed scaling), fwd + bwd. The
model-cpu* commands (GPU calls stubbed, any CPU) are in profile_host_cpu.py.

  host [CASE ...]     wall and host-enqueue time per step with the GPU kept busy, the kernels'
                      own time (torch.profiler) and the profiler's table of host-side ops and
                      CUDA calls by self CPU time, all threads. Cases: linear4096 linear_tiny
                      layernorm rmsnorm (bench_norm's fwd+bwd; torch_layernorm torch_rmsnorm:
                      torch.nn's) graphs_fp8 graphs_bf16 graphs_fp8_current (bench_graphs'
                      eager step: delayed scaling, bf16, current scaling;
                      default all).
  cputime [CASE ...] [--rounds R --steps N]
                      host CPU time per step of the cases (default graphs_fp8 graphs_bf16:
                      bench_graphs' eager steps), each run with the backward on the calling
                      thread in R alternating rounds of N steps, this thread's CPU time (the
                      GPU synced outside the timing); medians and ratios to the first case.
                      Host changes are judged by it: the wall of a host-bound step drifts by
                      more than such a change between rounds (docs/performance.md).
  threading [CASE ...] [--rounds R --steps N]
                      wall ms per step of the cases (default layernorm rmsnorm torch_layernorm
                      torch_rmsnorm) with PyTorch's default threading (a CUDA backward runs on
                      the autograd engine's device thread) and with the backward on the calling
                      thread, in R alternating rounds of N steps: medians, the rounds' spread
                      and the handoff (default - calling). Where the GPU work is shorter than
                      the host's, this is what the engine's device thread costs a Python
                      backward on this host (docs/performance.md, the norm section).
  parts               host time per step at T256 512->512 (where the GPU waits on the host),
                      real and then with more and more of its GPU calls replaced by stand-ins
                      that return at once (the C launch, torch._scaled_mm, Launcher.__call__),
                      under the default autograd threading and with the backward on the
                      calling thread: what each kind of call costs inside a real step, which
                      per-call micro-benchmarks miss.
  trace [--loop] [--calling] [T K N]
                      perf_counter_ns stamps at entry and exit of the step's functions, on
                      whatever thread runs them; prints the median step. --loop runs steps
                      back to back as do_bench does (L2 flush, CUDA events, no sync);
                      --calling runs the backward on the calling thread.
  launch              per-launch host cost: the Launcher's key, Triton's compiled run with
                      tensors or int pointers, the C launch, driver calls, the GEMM's TMA
                      descriptors, torch._scaled_mm and torch.empty.
  model-cpu [--profile] [T K N]
                      the step's CUDA-path Python on any CPU, its GPU calls stubbed (Triton
                      launches compute their cache key and return; torch._scaled_mm only
                      allocates): host-side changes measured without a GPU. --profile adds
                      cProfile's table.
  model-cpu-llama [--profile | --kept] [--layers N --hidden H --heads A --kv-heads G
                   --vocab V --batch B --seq S] [--repeats R --steps N]
                      the same for a whole model: a tiny HF LlamaForCausalLM (default 4 layers,
                      hidden 256, 4/2 heads, ffn 4x, vocab 1024, B1 x S128) converted by
                      convert_llama, forward with labels + backward under fp8_autocast
                      (delayed scaling), with the cuDNN attention ATen ops also stubbed (empty
                      outputs of the real shapes). Prints host us per layer forward and
                      backward (the model's time minus the same model with no decoder layers,
                      rounds interleaved, medians); --profile adds cProfile's tables of the
                      forward (tottime and cumulative). CPU ops that are not stubbed (residual
                      adds, reshapes that copy, the loss) really run, on one thread.
                      --kept: no timing; the tensor storages one forward keeps alive for its
                      backward (reachable after it, not before; parameters left out), bf16 and
                      FP8 delayed, by shape and dtype, and bytes per token per layer.
  model-cpu-graphs [--profile] [--launches] [--repeats R --steps N]
                      bench_graphs' eager step (4 TransformerLayers, hidden 512, 8 heads, S128
                      B2, fwd + bwd + FusedAdam) the same way, bf16, FP8 delayed and FP8
                      current, with the bf16 path's GPU ATen ops (GEMMs, adds, copies, cat,
                      sums) also stubbed: host ms per step (this thread's CPU time, best of
                      interleaved rounds) and FP8 / bf16 (the GPU ratio when the step is
                      host-bound, docs/performance.md), Triton launches, _scaled_mm and
                      Python-level calls per step; --profile adds cProfile's tables of the
                      FP8 delayed step, --launches the Triton launches per kernel name.
  model-cpu-tp [--profile] [--launches] [--repeats R --steps N] [--hidden H --heads A --kv-heads G
                --ffn F --seq S --batch B]
                      bench_tp's step the same way: its Llama-style TransformerLayer (RMSNorm,
                      swiglu, no bias, GQA, fused QKV, RoPE, sbhd; default hidden 512, 8/2
                      heads, ffn 1024, S256 B2) with tp_group of size 2 and sequence_parallel,
                      fwd + bwd under fp8_autocast(fp8_group=the TP group), on torch's fake
                      process group (world 2, rank 0: collectives return at once, no data
                      moves, no communication timed). Same output as model-cpu-graphs.
  kernels [T K N]     torch.profiler's CUDA time per kernel of the step and its host enqueue
                      time (above the GPU time: the step is bound by the host).
  ops                 host vs GPU time per call of RoPE (q+k, fwd and fwd+bwd).

Shapes default to T8192 4096->4096 (trace, kernels) and T256 512->512 (model-cpu).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import sys
import threading
import time

import torch

import tritium as te

import profile_host_cpu
from profile_host_cpu import fp8_linear_step

_launch = importlib.import_module("tritium.kernels._launch")


# ---- host -----------------------------------------------------------------------------------

def _norm_step(kind, torch_eager=False):
    """bench_norm's fwd+bwd step at 16384 x 4096 bf16: tritium's module or torch.nn's."""
    mod = (getattr(torch.nn, kind)(4096, eps=1e-5, device="cuda", dtype=torch.bfloat16)
           if torch_eager else getattr(te, kind)(4096, params_dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(mod.parameters()) + [x]

    def step():
        for p in params:
            p.grad = None
        mod(x).backward(dy)
    return step


def _graphs_step(fp8):
    """bench_graphs' eager step (4 TransformerLayers, hidden 512, fwd + bwd + FusedAdam); fp8:
    False, True (delayed scaling) or "current"."""
    profile_host_cpu.benchmarks_on_path()
    import bench_graphs
    return bench_graphs.make_step(fp8, False, False, 1)


HOST_CASES = {"linear4096": lambda: fp8_linear_step(8192, 4096, 4096),
              "linear_tiny": lambda: fp8_linear_step(256, 512, 512),
              "layernorm": lambda: _norm_step("LayerNorm"),
              "rmsnorm": lambda: _norm_step("RMSNorm"),
              "torch_layernorm": lambda: _norm_step("LayerNorm", torch_eager=True),
              "torch_rmsnorm": lambda: _norm_step("RMSNorm", torch_eager=True),
              "graphs_fp8": lambda: _graphs_step(True), "graphs_bf16": lambda: _graphs_step(False),
              "graphs_fp8_current": lambda: _graphs_step("current")}


def cmd_host(args):
    from torch.profiler import ProfilerActivity, profile
    for name in args.cases or list(HOST_CASES):
        step = HOST_CASES[name]()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        t_host = time.perf_counter()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 20 / 1e3
        print(f"\n=== {name}: wall {1e3 * (t1 - t0) / n:.3f} ms/step, host enqueue "
              f"{1e3 * (t_host - t0) / n:.3f} ms/step, kernels {gpu:.3f} ms/step", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def cmd_cputime(args):
    """Host CPU ms per step of each case, interleaved rounds (docs/performance.md: wall times
    of host-bound steps drift by tens of percent between rounds; a thread's CPU time drifts
    far less)."""
    import statistics
    names = args.cases or ["graphs_fp8", "graphs_bf16"]
    steps = {name: HOST_CASES[name]() for name in names}
    cpu = {name: [] for name in names}
    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread too
        for step in steps.values():
            for _ in range(5):
                step()
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                torch.cuda.synchronize()  # outside the timing: a sync may spin on the CPU
                t0 = time.thread_time()
                for _ in range(args.steps):
                    steps[name]()
                cpu[name].append(1e3 * (time.thread_time() - t0) / args.steps)
                torch.cuda.synchronize()
    base = statistics.median(cpu[names[0]])
    print(f"host CPU per step (the calling thread, backward included; median of {args.rounds} "
          f"alternating rounds of {args.steps} steps):")
    for name, values in cpu.items():
        ms = statistics.median(values)
        print(f"  {name:<12} {ms:8.3f} ms  ({ms / base:.3f}x {names[0]})")


def cmd_threading(args):
    """Wall ms per step, default threading vs the backward on the calling thread, alternating
    rounds (the GPU synced after each round's steps, inside its timing)."""
    import statistics
    names = args.cases or ["layernorm", "rmsnorm", "torch_layernorm", "torch_rmsnorm"]
    steps = {name: HOST_CASES[name]() for name in names}
    runs = [(name, calling) for name in names for calling in (False, True)]
    wall = {run: [] for run in runs}
    for step in steps.values():
        for _ in range(5):
            step()
    for r in range(args.rounds):
        for name, calling in (runs if r % 2 == 0 else runs[::-1]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autograd.set_multithreading_enabled(not calling):
                for _ in range(args.steps):
                    steps[name]()
                torch.cuda.synchronize()
            wall[(name, calling)].append(1e3 * (time.perf_counter() - t0) / args.steps)
    print(f"wall ms per step (median of {args.rounds} alternating rounds of {args.steps} steps; "
          "min-max):")
    for name in names:
        ms = {c: statistics.median(wall[(name, c)]) for c in (False, True)}
        spread = {c: f"{min(wall[(name, c)]):.3f}-{max(wall[(name, c)]):.3f}" for c in ms}
        print(f"  {name:<16} default {ms[False]:.3f} ({spread[False]})  calling thread "
              f"{ms[True]:.3f} ({spread[True]})  handoff {ms[False] - ms[True]:+.3f}")


# ---- parts ----------------------------------------------------------------------------------

def _instances(cls):
    import gc
    return [o for o in gc.get_objects() if isinstance(o, cls)]


def _no_launch(*args, **kwargs):
    return None


def cmd_parts(args):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from ab_linear import host_us
    step = fp8_linear_step(256, 512, 512)
    real_call, real_mm = _launch.Launcher.__call__, torch._scaled_mm

    def stub_c_launch():  # keep keys, pointer lists and descriptor encodes; drop the C call
        for launcher in [o for o in _instances(_launch.Launcher) if o._cache]:
            for key, entry in list(launcher._cache.items()):
                if entry[0] is not None:
                    launcher._cache[key] = (_no_launch, *entry[1:])
        for fixed in _instances(_launch._FixedLaunch):  # the prebuilt scale updates
            if fixed._c_launch is not None:
                fixed._c_launch = _no_launch

    def stub_mm():
        def fake(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False,
                 out=None):
            return out if out is not None else torch.empty(a.shape[0], b.shape[1],
                                                           dtype=out_dtype, device=a.device)
        torch._scaled_mm = fake

    def stub_launcher_call():
        _launch.Launcher.__call__ = lambda self, grid, *a, **k: None

    stages = [("real", lambda: None), ("Triton C launch stubbed", stub_c_launch),
              ("+ torch._scaled_mm stubbed", stub_mm),
              ("+ Launcher.__call__ stubbed", stub_launcher_call)]
    try:
        for name, apply in stages:
            apply()
            for mode in ("default", "calling thread"):
                torch.autograd.set_multithreading_enabled(mode == "default")
                print(f"{name:<32} {mode:<15} {host_us(step):8.1f} us/step", flush=True)
            torch.autograd.set_multithreading_enabled(True)
    finally:
        _launch.Launcher.__call__ = real_call
        torch._scaled_mm = real_mm


# ---- trace ----------------------------------------------------------------------------------

STAMPS: list = []
_now = time.perf_counter_ns


def _wrap(owner, attr, label=None, static=False):
    fn = getattr(owner, attr)
    label = label or f"{getattr(owner, '__name__', owner)}.{attr}"

    def wrapper(*args, **kwargs):
        t0 = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((label, t0, _now(), threading.get_ident()))
    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)


def _instrument():
    fl = importlib.import_module("tritium.functional.linear")
    ml = importlib.import_module("tritium.modules.linear")
    base = importlib.import_module("tritium.modules.base")
    ac = importlib.import_module("tritium.fp8.autocast")
    gemm = importlib.import_module("tritium.functional.gemm")
    _wrap(ml.Linear, "forward")
    _wrap(base.FP8Module, "_fp8_plan")
    _wrap(ml, "linear", "functional.linear")
    _wrap(fl._LinearFunction, "forward", "Function.forward", static=True)
    _wrap(fl._LinearFunction, "backward", "Function.backward", static=True)
    _wrap(fl.FP8Plan, "quantize")
    _wrap(fl.FP8Plan, "weight_operands")
    _wrap(fl, "fp8_gemm_tn")
    _wrap(gemm.torch, "_scaled_mm", "torch._scaled_mm")
    _wrap(_launch.Launcher, "__call__", "Launcher.__call__")
    _wrap(ac.FP8Region, "forward_done")
    _wrap(ac.FP8Region, "backward_done")
    _wrap(torch.Tensor, "backward", "Tensor.backward")


def cmd_trace(args, steps=60):
    t, k, n = args.shape or (8192, 4096, 4096)
    if args.calling:
        torch.autograd.set_multithreading_enabled(False)
    step = fp8_linear_step(t, k, n)
    for _ in range(10):
        step()
    _instrument()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    runs = []
    torch.cuda.synchronize()
    for i in range(steps):
        if args.loop:
            flush.zero_()
            events[i][0].record()
        else:
            torch.cuda.synchronize()
        STAMPS.clear()
        t0 = _now()
        step()
        t1 = _now()
        if args.loop:
            events[i][1].record()
        runs.append([t1 - t0, t0, list(STAMPS), 0.0])
    torch.cuda.synchronize()
    if args.loop:
        for run, (a, b) in zip(runs, events):
            run[3] = a.elapsed_time(b) * 1e3
    runs.sort(key=lambda r: r[0])
    total, t0, stamps, _ = runs[len(runs) // 2]
    main_thread = threading.get_ident()
    extra = ""
    if args.loop:
        timed = sorted(r[3] for r in runs)
        extra = f"; measured (events) median {timed[len(timed) // 2]:.0f} us"
    print(f"T{t} {k}->{n}{' (loop)' if args.loop else ''}: median step host {total / 1e3:.0f} us "
          f"(min {runs[0][0] / 1e3:.0f}, max {runs[-1][0] / 1e3:.0f}){extra}; stamps: start, "
          "end, duration in us; * = autograd thread")
    for label, a, b, tid in sorted(stamps, key=lambda s: s[1]):
        mark = " " if tid == main_thread else "*"
        print(f"{mark} {label:<34} {(a - t0) / 1e3:8.1f} {(b - t0) / 1e3:8.1f} {(b - a) / 1e3:7.1f}")


# ---- launch ---------------------------------------------------------------------------------

def _per_call(name, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    print(f"{name:<58} {1e6 * best:8.2f} us", flush=True)


def cmd_launch(args):
    from tritium.kernels import gemm as kgemm
    from tritium.kernels import scaling as kscaling
    dev = torch.device("cuda")
    hist = torch.zeros(16, 3, device=dev)
    scale = torch.ones(3, device=dev)
    update = kscaling.prepared_update(hist, scale, 448.0, 0, "max")
    update()
    launcher = kscaling._launch_update
    _per_call("scale update: Launcher call (prepared partial)", update)
    largs = (hist, scale, 16, 3)
    const = dict(FP8_MAX=448.0, MARGIN_DIV=1.0, MOST_RECENT=False, BLOCK_L=16)
    _per_call("  Launcher.key", lambda: launcher.key(0, largs, 4, const))
    _, function, metadata, cvals, _, _, compiled = next(iter(launcher._cache.values()))
    run = compiled.run
    stream = _launch._raw_stream(0)
    _per_call("  _raw_stream + _current_device",
              lambda: _launch._raw_stream(_launch._current_device()))
    _per_call("  compiled.run, tensor args",
              lambda: run(3, 1, 1, stream, function, metadata, None, None, None, *largs, *cvals))
    iargs = (hist.data_ptr(), scale.data_ptr(), 16, 3)
    _per_call("  compiled.run, int pointers",
              lambda: run(3, 1, 1, stream, function, metadata, None, None, None, *iargs, *cvals))
    launch = run.launch
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    _per_call("  C launch, int pointers",
              lambda: launch(3, 1, 1, stream, function, coop, pdl, None, None, metadata, None,
                             None, None, *iargs, *cvals))
    _per_call("  C launch, tensor args",
              lambda: launch(3, 1, 1, stream, function, coop, pdl, None, None, metadata, None,
                             None, None, *largs, *cvals))
    _per_call("  tensor.data_ptr()", hist.data_ptr)
    cuda = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    ptr = ctypes.c_uint64(hist.data_ptr())
    _per_call("  ctypes cuPointerGetAttribute (incl. ctypes cost)",
              lambda: cuda.cuPointerGetAttribute(ctypes.byref(out), 3, ptr))
    _per_call("  ctypes cuCtxGetCurrent (ctypes cost reference)",
              lambda: cuda.cuCtxGetCurrent(ctypes.byref(out)))
    if torch.cuda.get_device_capability()[0] < 9:
        return
    a = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
    si = torch.ones(1, device=dev)
    _per_call("GEMM 256x256x512 fast: kernels.gemm.fp8_gemm_tn",
              lambda: kgemm.fp8_gemm_tn(a, b, si, si, torch.bfloat16, fast_accum=True))
    o = torch.empty(256, 256, device=dev, dtype=torch.bfloat16)
    _per_call("  same, out= given",
              lambda: kgemm.fp8_gemm_tn(a, b, si, si, torch.bfloat16, fast_accum=True, out=o))
    _per_call("  3x TensorDesc(...)",
              lambda: (_launch.TensorDesc(a, (128, 128)), _launch.TensorDesc(b, (256, 128)),
                       _launch.TensorDesc(o, (128, 256))))
    try:
        import triton
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        _per_call("  fill_tma_descriptor (one)",
                  lambda: fill(a.data_ptr(), 128, 1, 0, [128, 128], [256, 512], [512, 1], 0))
    except Exception as exc:  # an internal API: report, go on
        print("fill_tma_descriptor:", repr(exc))
    _per_call("torch._scaled_mm 256x256x512 (precise)",
              lambda: torch._scaled_mm(a, b.t(), scale_a=si, scale_b=si,
                                       out_dtype=torch.bfloat16))
    _per_call("torch.empty(256, 256) bf16",
              lambda: torch.empty(256, 256, device=dev, dtype=torch.bfloat16))


# ---- kernels --------------------------------------------------------------------------------

def cmd_kernels(args):
    from torch.profiler import ProfilerActivity, profile
    step = fp8_linear_step(*(args.shape or (8192, 4096, 4096)))
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"host enqueue {1e3 * (t1 - t0) / 20:.3f} ms/step, wall {1e3 * (t2 - t0) / 20:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                    max_name_column_width=70))


# ---- ops ------------------------------------------------------------------------------------

def _op_profile(name, fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = {e.key[:60]: e.device_time_total / iters / 1e3 for e in prof.key_averages()
               if e.device_time_total > 0}
    print(f"{name:<40} host {host:.3f} ms/call  wall {wall:.3f}  gpu {sum(kernels.values()):.3f}")
    for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
        print(f"    {ms:.4f} ms  {key}")


def cmd_ops(args):
    q = torch.randn(4096, 2, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4096, 2, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(128)(4096).cuda()
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def rope_fwd():
        with torch.no_grad():
            te.apply_rotary_pos_emb(q, freqs, "sbhd")
            te.apply_rotary_pos_emb(k, freqs, "sbhd")

    def rope_fwd_bwd():
        torch.autograd.backward([te.apply_rotary_pos_emb(q, freqs, "sbhd"),
                                 te.apply_rotary_pos_emb(k, freqs, "sbhd")], [dq, dk])
    _op_profile("rope q+k fwd", rope_fwd)
    _op_profile("rope q+k fwd+bwd", rope_fwd_bwd)


# ---- command line ---------------------------------------------------------------------------

def main(argv=None):
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="scripts/profile_host.py", description=doc[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(doc[2:]))
    sub = parser.add_subparsers(dest="command", required=True)

    def shape(p):
        p.add_argument("shape", nargs="*", type=int, metavar="T K N",
                       help="tokens, in_features, out_features")

    p = sub.add_parser("host", help="host enqueue vs kernels, profiler table of host ops")
    p.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(HOST_CASES))
    p.set_defaults(func=cmd_host)
    p = sub.add_parser("cputime", help="host CPU time per step, cases in alternating rounds")
    p.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(HOST_CASES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=30)
    p.set_defaults(func=cmd_cputime)
    p = sub.add_parser("threading", help="wall per step, default vs calling-thread backward")
    p.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(HOST_CASES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=100)
    p.set_defaults(func=cmd_threading)
    sub.add_parser("parts", help="host time with GPU calls stubbed kind by kind").set_defaults(
        func=cmd_parts)
    p = sub.add_parser("trace", help="per-function host stamps of the median step")
    p.add_argument("--loop", action="store_true", help="back to back, as do_bench")
    p.add_argument("--calling", action="store_true", help="backward on the calling thread")
    shape(p)
    p.set_defaults(func=cmd_trace)
    sub.add_parser("launch", help="per-launch host cost micro-benchmarks").set_defaults(
        func=cmd_launch)
    profile_host_cpu.add_commands(sub, shape)
    p = sub.add_parser("kernels", help="CUDA time per kernel and host enqueue time")
    shape(p)
    p.set_defaults(func=cmd_kernels)
    sub.add_parser("ops", help="host vs GPU time of RoPE calls").set_defaults(func=cmd_ops)
    args = parser.parse_args(argv)
    unknown = [c for c in getattr(args, "cases", ()) if c not in HOST_CASES]
    if unknown:
        parser.error(f"{args.command}: unknown case(s) {unknown}; choose from {', '.join(HOST_CASES)}")
    if getattr(args, "shape", None) and len(args.shape) != 3:
        parser.error(f"{args.command}: give the shape as three numbers T K N, got {args.shape}")
    if not args.command.startswith("model-cpu") and not torch.cuda.is_available():
        parser.error(f"{args.command} needs a CUDA GPU; torch sees none (model-cpu* run on a CPU)")
    args.func(args)


if __name__ == "__main__":
    main()
