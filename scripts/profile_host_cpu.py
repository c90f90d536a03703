"""Usage: python scripts/profile_host.py {model-cpu,model-cpu-llama,model-cpu-graphs,model-cpu-tp}
       [args]   (this file holds those commands; run them through profile_host.py)

The model-cpu* commands: a step's host path timed on any CPU, with the CUDA path's GPU calls
stubbed (tritium takes its GPU branches, Triton launches compute their cache key and return,
torch._scaled_mm and the cuDNN attention ops only allocate). What they measure and how to read
it: profile_host.py's usage text and docs/performance.md.

`fp8_linear_step` is the FP8 Linear step both files time (here on the CPU, there on the GPU).
"""
from __future__ import annotations

import collections
import importlib
import sys
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
    layouts (the output keeps q's memory order, as cuDNN's does; q/k/v go in as they lie)."""
    backends = importlib.import_module("tritium.attention.backends")
    backends.choose = lambda q, k, v, a, backend="auto": (backends.BACKENDS["cudnn"], {})
    backends._cudnn_native_gqa = lambda index: True
    backends._cudnn_strided = lambda index: True

    def fwd(q, k, v, bias, lse, dropout, causal, debug, *, scale=None):
        b, h, s, _ = q.shape
        order = sorted(range(4), key=lambda i: -q.stride(i))  # q's dims, outermost first
        out = torch.empty_permuted((b, h, s, v.shape[-1]), order, dtype=q.dtype)
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


def _storages() -> dict:
    """{(data_ptr, nbytes): (shape, dtype)} of every tensor storage Python can reach, parameters
    left out (theirs are alive anyway)."""
    import gc
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
            try:
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (fake, meta)
                continue
            found.setdefault((st.data_ptr(), st.nbytes()), (tuple(obj.shape), obj.dtype))
    return found


def _print_kept(model, ids, rec) -> None:
    """--kept: what a forward leaves alive for its backward, bf16 and FP8 delayed: every
    storage reachable after the forward that was not before, by shape and dtype (a storage is
    listed under the shape of one tensor that views it), and bytes per token per layer. Small
    weights keep their fp8 transposes (functional/_recast.py); the tool's tiny model stands in
    for large ones, so that rule is off here: every weight is recast as at the 1B shape."""
    from tritium.functional import _recast
    _recast.KEEP_TRANSPOSE_MAX_NUMEL = 0
    print("weights recast in backward whatever their size (as at the 1B shape)")
    n, tokens = len(model.model.layers), ids.numel()
    for name, fp8 in (("bf16", False), ("fp8 delayed", True)):
        for _ in range(2):  # FP8 state and first-call allocations made before counting
            with te.fp8_autocast(enabled=fp8, fp8_recipe=rec):
                model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        before = _storages()
        with te.fp8_autocast(enabled=fp8, fp8_recipe=rec):
            loss = model(input_ids=ids, labels=ids).loss
        kept = {k: v for k, v in _storages().items() if k not in before}
        by_kind = collections.Counter()
        for (_, nbytes), (shape, dtype) in kept.items():
            by_kind[shape, str(dtype).replace("torch.", "")] += nbytes
        total = sum(by_kind.values())
        print(f"{name}: {total / 2**20:.1f} MiB kept by the forward ({n} layers, {tokens} "
              f"tokens: {total / n / tokens:.0f} bytes per token per layer, embedding and loss "
              "included)")
        for (shape, dtype), nbytes in by_kind.most_common(12):
            print(f"  {nbytes / 2**20:9.2f} MiB  {dtype:14s} {shape}")
        del loss


def cmd_model_cpu_llama(args):
    """Host us per decoder-layer forward and backward of a converted HF Llama under FP8
    (--kept: the bytes its forward keeps for backward instead)."""
    import cProfile
    import pstats
    _stub_gpu_calls()
    _stub_attention()
    torch.set_num_threads(1)  # the host path is one thread; CPU ops' thread pools add noise
    model = _tiny_llama(args.layers, args.hidden, args.heads, args.kv_heads, 4 * args.hidden,
                        args.vocab)
    if args.kept:
        _print_kept(model, torch.randint(0, args.vocab, (args.batch, args.seq)),
                    recipe.DelayedScaling(amax_history_len=16))
        return
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


def benchmarks_on_path() -> None:
    """The repository's benchmarks/ importable (bench_graphs' model and step)."""
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")


def _cpu_step_setup():
    """The stubs of the model-cpu-graphs / model-cpu-tp steps, for this process."""
    benchmarks_on_path()
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


def _compared_steps_parser(sub, name: str, summary: str):
    """A sub-command timing bf16 / FP8 delayed / FP8 current steps (`_compare_steps`)."""
    p = sub.add_parser(name, help=summary)
    p.add_argument("--profile", action="store_true", help="cProfile's tables of the FP8 step")
    p.add_argument("--launches", action="store_true", help="Triton launches per kernel")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds, best kept")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    return p


def add_commands(sub, shape) -> None:
    """The model-cpu* sub-commands on profile_host.py's argparse `sub` (shape(p): the T K N
    positional arguments)."""
    p = sub.add_parser("model-cpu", help="the step's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="print cProfile's table")
    p.add_argument("--repeats", type=int, default=7, help="timed loops, best kept (default 7)")
    shape(p)
    p.set_defaults(func=cmd_model_cpu)
    p = sub.add_parser("model-cpu-llama",
                       help="a converted HF Llama's host path on a CPU, GPU calls stubbed")
    p.add_argument("--profile", action="store_true", help="print cProfile's tables (forward)")
    p.add_argument("--kept", action="store_true",
                   help="no timing: the storages a forward keeps for backward, bf16 and FP8")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds, median kept")
    p.add_argument("--steps", type=int, default=20, help="steps per round (median kept)")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("kv-heads", 2),
                          ("vocab", 1024), ("batch", 1), ("seq", 128)):
        p.add_argument("--" + name, type=int, default=default, help=f"default {default}")
    p.set_defaults(func=cmd_model_cpu_llama)
    p = _compared_steps_parser(
        sub, "model-cpu-graphs", "bench_graphs' eager step's host path on a CPU, GPU calls stubbed")
    p.set_defaults(func=cmd_model_cpu_graphs)
    p = _compared_steps_parser(
        sub, "model-cpu-tp", "bench_tp's TP=2 + SP step's host path on a CPU, GPU calls stubbed")
    for name, default in (("hidden", 512), ("heads", 8), ("kv-heads", 2), ("ffn", 1024),
                          ("seq", 256), ("batch", 2)):
        p.add_argument("--" + name, type=int, default=default, help=f"default {default}")
    p.set_defaults(func=cmd_model_cpu_tp)
