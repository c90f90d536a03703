"""Usage: python scripts/profile_host.py
       {host,parts,trace,launch,model-cpu,model-cpu-llama,model-cpu-graphs,model-cpu-tp,kernels,
        ops} [args]

Where the time of an eager step goes, host and GPU (diagnostics; all but model-cpu* need CUDA).
The FP8 step is a bf16 tritium.Linear under fp8_autocast (delayed scaling), fwd + bwd.

  host [CASE ...]     wall and host-enqueue time per step with the GPU kept busy, the kernels'
                      own time (torch.profiler) and the profiler's table of host-side ops and
                      CUDA calls by self CPU time, all threads. Cases: linear4096 linear_tiny
                      layernorm rmsnorm (default all).
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
  model-cpu-llama [--profile] [--layers N --hidden H --heads A --kv-heads G --vocab V
                   --batch B --seq S] [--repeats R --steps N]
                      the same for a whole model: a tiny HF LlamaForCausalLM (default 4 layers,
                      hidden 256, 4/2 heads, ffn 4x, vocab 1024, B1 x S128) converted by
                      convert_llama, forward with labels + backward under fp8_autocast
                      (delayed scaling), with the cuDNN attention ATen ops also stubbed (empty
                      outputs of the real shapes). Prints host us per layer forward and
                      backward (the model's time minus the same model with no decoder layers,
                      rounds interleaved, medians); --profile adds cProfile's tables of the
                      forward (tottime and cumulative). CPU ops that are not stubbed (residual
                      adds, reshapes that copy, the loss) really run, on one thread.
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
import collections
import ctypes
import importlib
import sys
import threading
import time

import torch

import tritium as te
from tritium import recipe

_launch = importlib.import_module("tritium.kernels._launch")


def fp8_linear_step(t, k, n, device="cuda"):
    """A step of a bf16 tritium.Linear under fp8_autocast (delayed scaling): fwd + bwd."""
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    rec = recipe.DelayedScaling(amax_history_len=16)

    def step():
        layer.weight.grad = x.grad = None
        with te.fp8_autocast(fp8_recipe=rec):
            out = layer(x)
        out.backward(dy)
    return step


# ---- host -----------------------------------------------------------------------------------

def _norm_step(kind):
    mod = getattr(te, kind)(4096, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(mod.parameters()) + [x]

    def step():
        for p in params:
            p.grad = None
        mod(x).backward(dy)
    return step


HOST_CASES = {"linear4096": lambda: fp8_linear_step(8192, 4096, 4096),
              "linear_tiny": lambda: fp8_linear_step(256, 512, 512),
              "layernorm": lambda: _norm_step("LayerNorm"), "rmsnorm": lambda: _norm_step("RMSNorm")}


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


# ---- model-cpu ------------------------------------------------------------------------------

STUB_CALLS = {"launch": 0, "_scaled_mm": 0}  # calls of the stubs below, for counts per step
STUB_KERNELS: collections.Counter = collections.Counter()  # launches per Triton kernel name


def _stub_launch(self, grid, *args, num_warps=4, **constexprs):
    STUB_CALLS["launch"] += 1
    STUB_KERNELS[getattr(self.kernel, "__name__", None)
                 or getattr(getattr(self.kernel, "fn", None), "__name__", "?")] += 1
    self._cache = self._cache if self._cache is not None else {}
    self._cache.get(self.key(0, args, num_warps, constexprs))


def _stub_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False,
                    out=None):
    STUB_CALLS["_scaled_mm"] += 1
    return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)


def _stub_gpu_calls():
    """The CUDA path's Python on a CPU: tritium takes its GPU branches, Triton launches compute
    their cache key and return, torch._scaled_mm only allocates."""
    device = importlib.import_module("tritium._device")
    device.use_triton = lambda t: True
    device.fp8_tensor_cores = lambda t: True
    _launch.Launcher.__call__ = _stub_launch
    torch._scaled_mm = _stub_scaled_mm


def cmd_model_cpu(args, steps=500):
    import cProfile
    import pstats
    _stub_gpu_calls()
    step = fp8_linear_step(*(args.shape or (256, 512, 512)), device="cpu")
    for _ in range(min(50, steps)):
        step()
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps)
    print(f"host model (CPU, GPU calls stubbed): {1e6 * best:.1f} us per fwd+bwd step")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def _stub_attention():
    """The cuDNN SDPA path with its ATen ops returning empty outputs of the real shapes and
    layouts (the output keeps q's bshd memory order, as cuDNN's does)."""
    backends = importlib.import_module("tritium.attention.backends")
    backends.choose = lambda q, k, v, a, backend="auto": (backends.BACKENDS["cudnn"], {})
    backends._cudnn_native_gqa = lambda index: True

    def fwd(q, k, v, bias, lse, dropout, causal, debug, *, scale=None):
        b, h, s, _ = q.shape
        out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype).transpose(1, 2)
        return (out, torch.empty(b, h, s, 1), None, None, s, k.shape[2], torch.empty(2),
                torch.empty(()), None)

    def bwd(dout, q, k, v, out, lse, seed, offset, bias, cq, ck, sq, sk, dropout, causal, *,
            scale=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.ops.aten._scaled_dot_product_cudnn_attention = fwd
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward = bwd


def _tiny_llama(layers, hidden, heads, kv_heads, ffn, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM
    from tritium.integrations.hf import convert_llama
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return convert_llama(model)


def cmd_model_cpu_llama(args):
    """Host us per decoder-layer forward and backward of a converted HF Llama under FP8."""
    import cProfile
    import pstats
    _stub_gpu_calls()
    _stub_attention()
    torch.set_num_threads(1)  # the host path is one thread; CPU ops' thread pools add noise
    model = _tiny_llama(args.layers, args.hidden, args.heads, args.kv_heads, 4 * args.hidden,
                        args.vocab)
    inner = model.model
    all_layers, no_layers = inner.layers, torch.nn.ModuleList()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    rec = recipe.DelayedScaling(amax_history_len=16)

    def fwd():
        with te.fp8_autocast(fp8_recipe=rec):
            return model(input_ids=ids, labels=ids).loss

    def timed(n):  # -> (fwd us, bwd us) medians of n steps
        fs, bs = [], []
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = fwd()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fs.append(t1 - t0)
            bs.append(t2 - t1)
        return 1e6 * sorted(fs)[n // 2], 1e6 * sorted(bs)[n // 2]

    rows = []
    for layers in (all_layers, no_layers):
        inner.layers = layers
        timed(10)
    for _ in range(args.repeats):  # interleaved: the machine's load shifts both alike
        row = []
        for layers in (all_layers, no_layers):
            inner.layers = layers
            row += timed(args.steps)
        rows.append(row)
    inner.layers = all_layers
    med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
    n = len(all_layers)
    print(f"converted Llama {n}L hidden {args.hidden} heads {args.heads}/{args.kv_heads} vocab "
          f"{args.vocab} B{args.batch} x S{args.seq}, FP8 delayed, GPU calls stubbed (median of "
          f"{args.repeats} x {args.steps} steps)")
    print(f"  model fwd {med[0]:8.1f} us  bwd {med[1]:8.1f} us")
    print(f"  no layers fwd {med[2]:8.1f} us  bwd {med[3]:8.1f} us")
    print(f"  per layer fwd {(med[0] - med[2]) / n:8.1f} us  bwd {(med[1] - med[3]) / n:8.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            fwd()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)


_CPU_STUBS = None


def _stub_cpu_compute():
    """The ATen ops of the bf16 path that run as GPU kernels (GEMMs, residual adds, copies,
    concatenations, bias-grad sums) return empty outputs of the right shape on CPU tensors: what
    stays is their dispatch, as on a GPU, not a CPU's arithmetic (52 of the bf16 step's 58 ms
    at bench_graphs' config before). Registered once, for the process."""
    global _CPU_STUBS
    if _CPU_STUBS is not None:
        return
    import warnings

    def new(shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def cat(tensors, dim=0):
        tensors = [t for t in tensors if t.dim() > 1 or t.numel()]  # cat skips 1-D empties
        shape = list(tensors[0].shape)
        dim = dim % len(shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        return new(shape, tensors[0].dtype)

    def sum_dims(t, dims, keepdim=False, *, dtype=None):
        dims = {d % t.dim() for d in (dims if dims is not None else range(t.dim()))}
        shape = [1 if i in dims else n for i, n in enumerate(t.shape)
                 if keepdim or i not in dims]
        return new(shape, dtype or t.dtype)

    stubs = {
        "mm": lambda a, b: new((a.shape[0], b.shape[1]), a.dtype),
        "addmm": lambda c, a, b, *, beta=1, alpha=1: new((a.shape[0], b.shape[1]), a.dtype),
        "bmm": lambda a, b: new((*a.shape[:2], b.shape[2]), a.dtype),
        "add.Tensor": lambda a, b, *, alpha=1: new(
            a.shape if a.shape == b.shape else torch.broadcast_shapes(a.shape, b.shape),
            a.dtype if a.dtype == b.dtype else torch.result_type(a, b)),
        "add_.Tensor": lambda a, b, *, alpha=1: a,
        "copy_": lambda self, src, non_blocking=False: self,
        "cat": cat, "sum.dim_IntList": sum_dims}
    _CPU_STUBS = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
        warnings.simplefilter("ignore")
        for name, fn in stubs.items():
            _CPU_STUBS.impl(name, fn, "CPU")


def _graphs_model_step(fp8_recipe):
    """bench_graphs' eager step on the CPU: 4 TransformerLayers (hidden 512, 8 heads, ffn 2048,
    bf16, dropout 0), sbhd S128 x B2, fwd + bwd under fp8_autocast (enabled iff a recipe is
    given) + FusedAdam step + zero_grad(set_to_none=True)."""
    from tritium.optimizers import FusedAdam
    graphs = importlib.import_module("bench_graphs")
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        te.TransformerLayer(graphs.H, graphs.FFN, graphs.HEADS, hidden_dropout=0.0,
                            attention_dropout=0.0, params_dtype=torch.bfloat16, device="cpu")
        for _ in range(graphs.LAYERS))
    shape = (graphs.SEQ, graphs.BATCH, graphs.H)
    x = torch.randn(shape, dtype=torch.bfloat16)
    dy = torch.randn(shape, dtype=torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-4)
    fp8 = fp8_recipe is not None

    def step():
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            y = x
            for layer in model:
                y = layer(y)
        y.backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _cpu_step_setup():
    """The stubs of the model-cpu-graphs / model-cpu-tp steps, for this process."""
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")
    _stub_gpu_calls()
    _stub_attention()
    _stub_cpu_compute()
    torch.set_num_threads(1)  # the host path is one thread; CPU ops' thread pools add noise
    torch.autograd.set_multithreading_enabled(False)  # CPU tensors: the calling thread anyway


def _cpu_step_cases() -> dict:
    return {"bf16": None,
            "fp8 delayed": recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max"),
            "fp8 current": recipe.Float8CurrentScaling()}


def _compare_steps(steps: dict, args, title: str) -> None:
    """Host ms per step of each step (this thread's CPU time, best of interleaved rounds), the
    ratio to the first and the calls per step; --profile: cProfile's tables of "fp8 delayed"."""
    import cProfile
    import pstats
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict = {name: [] for name in steps}
    for _ in range(args.repeats):  # interleaved: the machine's load shifts all alike
        for name, step in steps.items():
            t0 = time.thread_time()  # this thread's CPU time: other processes' load adds none
            for _ in range(args.steps):
                step()
            times[name].append((time.thread_time() - t0) / args.steps)
    ms = {name: 1e3 * min(t) for name, t in times.items()}  # what load adds is never less
    counts, kernels = {}, {}
    for name, step in steps.items():  # what load cannot change: calls per step
        STUB_CALLS.update(launch=0, _scaled_mm=0)
        STUB_KERNELS.clear()
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        counts[name] = (STUB_CALLS["launch"], STUB_CALLS["_scaled_mm"],
                        pstats.Stats(prof).total_calls)
        kernels[name] = dict(STUB_KERNELS)
    base = next(iter(ms.values()))
    print(f"{title}, CPU, GPU calls stubbed, thread CPU time, best of {args.repeats} x "
          f"{args.steps} steps; calls per step:")
    for name, value in ms.items():
        launches, mms, calls = counts[name]
        print(f"  {name:<12} {value:7.2f} ms/step  ({value / base:.2f}x bf16)  Triton "
              f"launches {launches:4d}, _scaled_mm {mms:3d}, Python-level calls {calls:6d}")
    if getattr(args, "launches", False):
        print("Triton launches per step, by kernel:")
        for name in sorted({k for per in kernels.values() for k in per}):
            print(f"  {name:<32}" + "".join(f"  {case} {kernels[case].get(name, 0):3d}"
                                            for case in steps))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            steps["fp8 delayed"]()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)


def cmd_model_cpu_graphs(args):
    """Host ms per step of bench_graphs' eager model: bf16, FP8 delayed and FP8 current."""
    _cpu_step_setup()
    steps = {name: _graphs_model_step(rec) for name, rec in _cpu_step_cases().items()}
    _compare_steps(steps, args, "bench_graphs' eager step (4 TransformerLayers, hidden 512, 8 "
                   "heads, S128 B2, fwd + bwd + FusedAdam)")


def _fake_tp_group():
    """A world of 2 on torch's fake backend, this process rank 0: collectives return at once
    without moving data (no communication timed). Made once, for the process."""
    import torch.distributed as dist
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return dist.group.WORLD


def _tp_layer_step(fp8_recipe, group, freqs, hidden, heads, groups, ffn, seq, batch):
    """bench_tp's step on the CPU: its Llama-style TransformerLayer (RMSNorm, swiglu, no bias,
    GQA, fused non-interleaved QKV, RoPE, sbhd) at TP=2 with sequence parallelism, fwd + bwd
    under fp8_autocast(fp8_group=the TP group) when a recipe is given."""
    torch.manual_seed(0)
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    layer = te.TransformerLayer(
        hidden, ffn, heads, num_gqa_groups=groups, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", activation="swiglu", bias=False, fuse_qkv_params=True,
        qkv_weight_interleaved=False, attn_input_format="sbhd", tp_group=group,
        sequence_parallel=True, set_parallel_mode=True, get_rng_state_tracker=lambda: tracker,
        params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(seq // 2, batch, hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(seq // 2, batch, hidden, dtype=torch.bfloat16)
    params = list(layer.parameters())
    fp8 = fp8_recipe is not None

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe, fp8_group=group):
            out = layer(x, rotary_pos_emb=freqs)
        out.backward(dy)
    return step


def cmd_model_cpu_tp(args):
    """Host ms per step of bench_tp's TP=2 + SP TransformerLayer: bf16, FP8 delayed, current."""
    freqs = te.RotaryPositionEmbedding(args.hidden // args.heads)(args.seq)  # before the stubs
    _cpu_step_setup()
    group = _fake_tp_group()
    shape = (args.hidden, args.heads, args.kv_heads, args.ffn, args.seq, args.batch)
    steps = {name: _tp_layer_step(rec, group, freqs, *shape)
             for name, rec in _cpu_step_cases().items()}
    _compare_steps(steps, args, f"bench_tp's step (TransformerLayer hidden {args.hidden}, "
                   f"{args.heads}/{args.kv_heads} heads, ffn {args.ffn} swiglu, S{args.seq} "
                   f"B{args.batch}, TP=2 + SP on the fake backend, fwd + bwd)")


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
    sub.add_parser("parts", help="host time with GPU calls stubbed kind by kind").set_defaults(
        func=cmd_parts)
    p = sub.add_parser("trace", help="per-function host stamps of the median step")
    p.add_argument("--loop", action="store_true", help="back to back, as do_bench")
    p.add_argument("--calling", action="store_true", help="backward on the calling thread")
    shape(p)
    p.set_defaults(func=cmd_trace)
    sub.add_parser("launch", help="per-launch host cost micro-benchmarks").set_defaults(
        func=cmd_launch)
    p = sub.add_parser("model-cpu", help="the step's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="print cProfile's table")
    p.add_argument("--repeats", type=int, default=7, help="timed loops, best kept (default 7)")
    shape(p)
    p.set_defaults(func=cmd_model_cpu)
    p = sub.add_parser("model-cpu-llama",
                       help="a converted HF Llama's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="print cProfile's tables (forward)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds, median kept")
    p.add_argument("--steps", type=int, default=20, help="steps per round (median kept)")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("kv-heads", 2),
                          ("vocab", 1024), ("batch", 1), ("seq", 128)):
        p.add_argument("--" + name, type=int, default=default, help=f"default {default}")
    p.set_defaults(func=cmd_model_cpu_llama)
    p = sub.add_parser("model-cpu-graphs",
                       help="bench_graphs' eager step's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="cProfile's tables of the FP8 step")
    p.add_argument("--launches", action="store_true", help="Triton launches per kernel")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds, best kept")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.set_defaults(func=cmd_model_cpu_graphs)
    p = sub.add_parser("model-cpu-tp",
                       help="bench_tp's TP=2 + SP step's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="cProfile's tables of the FP8 step")
    p.add_argument("--launches", action="store_true", help="Triton launches per kernel")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds, best kept")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    for name, default in (("hidden", 512), ("heads", 8), ("kv-heads", 2), ("ffn", 1024),
                          ("seq", 256), ("batch", 2)):
        p.add_argument("--" + name, type=int, default=default, help=f"default {default}")
    p.set_defaults(func=cmd_model_cpu_tp)
    p = sub.add_parser("kernels", help="CUDA time per kernel and host enqueue time")
    shape(p)
    p.set_defaults(func=cmd_kernels)
    sub.add_parser("ops", help="host vs GPU time of RoPE calls").set_defaults(func=cmd_ops)
    args = parser.parse_args(argv)
    unknown = [c for c in getattr(args, "cases", ()) if c not in HOST_CASES]
    if unknown:
        parser.error(f"host: unknown case(s) {unknown}; choose from {', '.join(HOST_CASES)}")
    if getattr(args, "shape", None) and len(args.shape) != 3:
        parser.error(f"{args.command}: give the shape as three numbers T K N, got {args.shape}")
    if not args.command.startswith("model-cpu") and not torch.cuda.is_available():
        parser.error(f"{args.command} needs a CUDA GPU; torch sees none (model-cpu* run on a CPU)")
    args.func(args)


if __name__ == "__main__":
    main()
