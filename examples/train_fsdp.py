"""Train the HF Llama converted to tritium (`convert_llama`) with FSDP2 on every GPU of the machine
(or on CPU processes over gloo), FusedAdam with fp32 master weights, optionally in FP8.

    torchrun --nproc-per-node=gpu examples/train_fsdp.py                      # tiny config
    torchrun --nproc-per-node=2 examples/train_fsdp.py --config llama3-8b --seq-len 4096 \
        --batch 1 --fp8 current --fp8-all-gather --recompute
    torchrun --nproc-per-node=2 examples/train_fsdp.py --device cpu --steps 5    # gloo
    torchrun --nproc-per-node=2 examples/train_fsdp.py --fp8 delayed --fp8-params # FP8 params
    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node=8 examples/train_fsdp.py --tp 2 ...
                                                                  # FSDP2 x TP (see below)

How the model is made (docs/distributed.md, DESIGN.md section 11): the HF model is built on the
meta device, converted (its decoder layers become tritium TransformerLayers), optionally given
FP8 all-gather (`tritium.distributed.enable_fp8_all_gather`), sharded (`fully_shard` per decoder
layer, then the root), and only then materialized: `to_empty` allocates each rank's shards and
every module re-initializes its own shard (`reset_parameters`; HF's norms, embeddings and the
rotary buffers are re-made here), so no device ever holds the whole model.
FSDP2 x tensor parallelism (`--tp N`, docs/distributed.md): a 2D DeviceMesh (world / N, N) with
dims ("dp", "tp"); the decoder layers are converted with tp_group=mesh["tp"] and sequence
parallelism (each rank holds its TP shards), and fully_shard shards everything over mesh["dp"].
Launch TP jobs with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue per process, so a
collective issued before a GEMM starts first; Megatron-LM's setting; measured in
docs/tensor_parallel.md); rank 0 says so when it is missing.
Initialization: HF's modules (replicated over TP) draw from one seed per dp rank, so the TP
ranks of a dp group hold the same values; each TP-sharded tritium module draws from a stream of
its own per (dp rank, TP rank, module), so the TP shards differ.
Data: bytes of real text (the demo's corpus: Python's standard library source), a different
stream of random windows per dp rank (the TP ranks of a dp group get the same batch). The step:
the loss through tritium.linear_cross_entropy (no logits tensor; `fuse_cross_entropy` gives the
same to models that keep HF's layers), the grad norm clipped at 1.0 with the TP-aware
tritium.distributed.clip_grad_norm_, FusedAdam. Each step
prints one progress line (loss averaged over ranks, tokens/s over all ranks, peak memory per
device, bytes FSDP2 all-gathered per step per rank).
`build()` and `train()` are also used by benchmarks/bench_fsdp.py; `CollectiveLog` (a
diagnostic: the collectives and host syncs of a step) by its --diagnose and by the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.utils.checkpoint
import torch.distributed as dist

CONFIGS = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
}


def setup(device: str = "auto"):
    """Process group from torchrun's environment (a 1-process group without it)."""
    use_cuda = torch.cuda.is_available() and device != "cpu"
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def fp8_recipe(name: str):
    from tritium import recipe
    return {"none": None, "delayed": recipe.DelayedScaling(),
            "current": recipe.Float8CurrentScaling()}[name]


def make_mesh(device, tp: int = 1):
    """The DeviceMesh: 1D ("dp",) over every rank, or 2D (world / tp, tp) ("dp", "tp")."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    if not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"--tp {tp}: the tensor-parallel size must be a positive divisor of the "
                         f"number of processes ({world}); pick one that divides it, e.g. 2")
    if tp == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _local_rank(mesh, dim: str) -> int:
    return mesh.get_local_rank(dim) if dim in (mesh.mesh_dim_names or ()) else 0


@contextlib.contextmanager
def _stream(seed: int, device):
    """Draw from a generator seeded with `seed` inside the block; the default stream is
    restored after (CPU and this device's CUDA generator)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def _init_weights(model, config, device, seed: int, mesh) -> None:
    """Each rank initializes its own shards: tritium modules through reset_parameters, HF's
    modules as HF's _init_weights does (normal(0, initializer_range), norms at 1), the rotary
    inv_freq (a non-persistent buffer, left garbage by to_empty) made again. Seeds: see the
    module note (one per dp rank; TP-sharded modules one per dp rank, TP rank and module)."""
    dp_rank, tp_rank = _local_rank(mesh, "dp"), _local_rank(mesh, "tp")
    torch.manual_seed(seed + dp_rank)
    std = config.initializer_range
    for i, (name, m) in enumerate(model.named_modules()):
        if type(m).__module__.startswith("tritium") and hasattr(m, "reset_parameters"):
            sharded = getattr(m, "tp", None) is not None and m.tp.size > 1
            with (_stream(((seed * 1009 + dp_rank) * 1009 + tp_rank) * 100_003 + i, device)
                  if sharded else contextlib.nullcontext()):
                m.reset_parameters()
        elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, 0.0, std)
        elif type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight"):
            m.weight.fill_(1.0)
        elif name.endswith("rotary_emb"):
            with torch.device(device):
                fresh = type(m)(config)
            for key, buf in fresh.named_buffers():
                getattr(m, key).copy_(buf)


def build(config_name: str, device, *, dtype=torch.bfloat16, fp8_all_gather=None,
          recompute: bool = False, convert: bool = True, prepare=None, seed: int = 0,
          mesh=None, fp8_params=None, fp8_lm_head: bool = False):
    """The sharded, materialized model (see the module note). fp8_all_gather: None or the recipe
    the gathered weights are cast with. fp8_params: None or the recipe (DelayedScaling) the
    decoder layers' GEMM weights are made FP8 params under (fp8_model_init; FSDP2 then gathers
    their fp8 bytes and each rank initializes its shards in place). fp8_lm_head: the converted
    model's fused lm_head + cross-entropy runs its GEMMs in FP8 under fp8_autocast
    (`convert_llama(fp8_lm_head=True)`). convert=False keeps HF's own layers and `prepare(model)`
    runs on the meta model before sharding (the bf16 and torchao baselines of the benchmark).
    mesh: from make_mesh (default: 1D over every rank); with a "tp" dim the decoder layers are
    tensor- and sequence-parallel over it and FSDP2 shards over "dp"."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from tritium.integrations.hf import convert_llama, fuse_cross_entropy
    # use_cache=False: HF's default builds a KV cache in training, which torch.compile cannot
    # trace (the compiled torchao baseline would fall back to eager)
    config = transformers.LlamaConfig(**CONFIGS[config_name], tie_word_embeddings=False,
                                      attention_dropout=0.0, use_cache=False)
    mesh = make_mesh(device) if mesh is None else mesh
    tp = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
    if tp is not None and not convert:
        raise ValueError("tensor parallelism (a mesh with a 'tp' dim) needs convert=True: HF's "
                         "own layers are not tensor-parallel here; use a 1D mesh (--tp 1)")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if convert:
        import tritium as te
        with te.fp8_model_init(enabled=fp8_params is not None, recipe=fp8_params):
            convert_llama(model, tp_group=tp, sequence_parallel=tp is not None,
                          fp8_lm_head=fp8_lm_head)
    else:   # every variant's loss is the same fused lm_head + cross-entropy (no fp32 logits)
        fuse_cross_entropy(model)
    if fp8_all_gather is not None:
        from tritium.distributed import enable_fp8_all_gather
        enable_fp8_all_gather(model, fp8_all_gather)
    if prepare is not None:
        prepare(model)
    if recompute:
        for layer in model.model.layers:
            _recompute(layer)
    dp = mesh["dp"] if tp is not None else mesh
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    model.to_empty(device=device)
    _init_weights(model, config, device, seed, mesh)
    return model, config


def _recompute(layer) -> None:
    """Activation recomputation of a whole decoder layer with te.distributed.checkpoint, reentrant
    (TE's default): the first forward runs without grad, so the FP8 layers skip what only
    backward reads (the transposed fp8 copies of activations), and the host does less per layer
    than with torch's non-reentrant checkpoint. The recompute in backward re-enters the
    forward's fp8_autocast with the forward's frozen scales, so delayed scaling recomputes
    exactly what the forward computed. FSDP2's hooks stay on the layer, outside the checkpoint.
    HF's own layers (the benchmark's baselines, compiled per layer for torchao) take torch's
    non-reentrant checkpoint, which torch.compile traces."""
    from tritium.distributed import checkpoint
    forward = layer.forward
    reentrant = type(layer).__module__.startswith("tritium")
    if not reentrant:
        checkpoint = torch.utils.checkpoint.checkpoint

    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=reentrant, **kwargs)
    layer.forward = recomputed


class GatherCounter:
    """Bytes this rank receives from FSDP2's all-gathers (counted at dist.all_gather_single,
    the collective FSDP2 calls; older torch: all_gather_into_tensor)."""

    def __init__(self):
        self.bytes = 0
        self._saved = {}

    def __enter__(self):
        for name in ("all_gather_single", "all_gather_into_tensor"):
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def counting(output, inp, *args, _real=real, **kwargs):
                self.bytes += output.numel() * output.element_size()
                return _real(output, inp, *args, **kwargs)
            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


_COLLECTIVES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
                "reduce_scatter_single": "reduce_scatter",
                "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
                "all_gather": "all_gather_list", "reduce_scatter": "reduce_scatter_list",
                "broadcast": "broadcast", "all_to_all_single": "all_to_all", "barrier": "barrier"}
_HOST_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


class CollectiveLog:
    """A diagnostic: every torch.distributed collective this rank issues while `on` is True
    (FSDP2's, tritium's tensor-parallel ones, which tensor_parallel.py binds at import, and the
    amax reductions) as (kind, group ranks, dtype, bytes this rank sends) in issue order; and in
    `syncs` the tensor methods that make the host wait for the device (item, tolist, bool, ...)
    called from tritium's own code. Install it with `with CollectiveLog() as log:` (before the
    step: the wrappers stay in place until the block exits), then set `log.on`."""

    def __init__(self):
        self.log, self.syncs, self.on = [], [], False
        self._saved = []

    def __enter__(self):
        from tritium.distributed import tensor_parallel
        for name, kind in _COLLECTIVES.items():
            if hasattr(dist, name):
                self._patch(dist, name, self._collective(kind, getattr(dist, name)))
        for name in ("_all_gather", "_reduce_scatter"):
            self._patch(tensor_parallel, name, self._collective(
                "all_gather" if "gather" in name else "reduce_scatter",
                getattr(tensor_parallel, name)))
        for name in _HOST_SYNCS:
            self._patch(torch.Tensor, name, self._sync(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _patch(self, owner, name, fn):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def _collective(self, kind, real):
        def wrapped(*args, **kwargs):
            if self.on:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                group = kwargs.get("group") or next(
                    (a for a in args if isinstance(a, dist.ProcessGroup)), None)
                ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
                # what this rank sends: a gather's input (the smaller tensor), a
                # reduce-scatter's input (the larger), an all-reduce's one tensor
                pick = min if kind == "all_gather" else max
                t = pick(tensors, key=lambda x: x.numel()) if tensors else None
                self.log.append((kind, ranks, None if t is None else t.dtype,
                                 0 if t is None else t.numel() * t.element_size()))
            return real(*args, **kwargs)
        return wrapped

    def _sync(self, name, real):
        import traceback
        import tritium
        package = os.path.dirname(tritium.__file__) + os.sep

        def wrapped(*args, **kwargs):
            if self.on:
                caller = traceback.extract_stack(limit=2)[0]   # the code calling the method
                if caller.filename.startswith(package):
                    self.syncs.append(f"{name} at {caller.filename}:{caller.lineno}")
            return real(*args, **kwargs)
        return wrapped

    def summary(self) -> dict:
        """{(kind, group size, dtype): [count, bytes]} of the collectives logged."""
        out = {}
        for kind, ranks, dtype, nbytes in self.log:
            row = out.setdefault((kind, len(ranks), str(dtype).replace("torch.", "")), [0, 0])
            row[0] += 1
            row[1] += nbytes
        return out


def batches(seq_len: int, batch: int, steps: int, device, seed: int = 0, mesh=None):
    """Windows of real text (bytes as tokens), a different stream per dp rank (every rank
    without a mesh)."""
    from tritium.demo import load_corpus, split_corpus
    data, _ = load_corpus()
    train, _ = split_corpus(data, seq_len)
    rank = dist.get_rank() if mesh is None else _local_rank(mesh, "dp")
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        starts = torch.randint(0, train.numel() - seq_len - 1, (batch,), generator=g)
        w = train[starts[:, None] + torch.arange(seq_len + 1)].to(device, torch.long)
        yield w[:, :-1], w[:, 1:]


def train_step(model, opt, x, y, *, rcp=None, after_step=None,
               clip_grad_norm: float = 0.0) -> torch.Tensor:
    """One step: forward (under fp8_autocast with `rcp`) with the loss through
    tritium.linear_cross_entropy (fuse_cross_entropy: no fp32 logits), backward, the grad-norm
    clip (0: none), optimizer step, the FP8 gather scales' precompute, `after_step()`. Returns
    the loss, detached; nothing here waits for the device."""
    import tritium as te
    from tritium.distributed import clip_grad_norm_, precompute_fp8_scales_for_fsdp
    ctx = te.fp8_autocast(fp8_recipe=rcp) if rcp is not None else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=x, shift_labels=y).loss
    loss.backward()
    if clip_grad_norm:   # TP-aware: shards summed over the TP group, replicated params once
        clip_grad_norm_(model, clip_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    precompute_fp8_scales_for_fsdp(model)     # no-op without current-scaling gathers
    if after_step is not None:
        after_step()
    return loss.detach()


def train(model, opt, data, *, rcp=None, after_step=None, log=print, warmup: int = 2,
          dp: int = None, clip_grad_norm: float = 1.0):
    """Train over `data`; returns per-step dicts (loss, tokens/s after warm-up, peak GiB,
    all-gather bytes). One progress line per step on rank 0. dp: the number of data-parallel
    groups (default: every rank; under TP the TP ranks of a group share a batch, so a step
    trains batch * seq * dp tokens). clip_grad_norm: the global grad-norm clip of every Llama
    recipe (torchtitan's default 1.0; 0 turns it off), through
    tritium.distributed.clip_grad_norm_ (right under TP too)."""
    world, rows = dist.get_world_size(), []
    dp = world if dp is None else dp
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_start, tokens = None, 0
    for step, (x, y) in enumerate(data):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            t_start, tokens = time.perf_counter(), 0
        with GatherCounter() as gathered:
            loss = train_step(model, opt, x, y, rcp=rcp, after_step=after_step,
                              clip_grad_norm=clip_grad_norm)
        dist.all_reduce(loss)   # the TP ranks of a dp group hold the same loss: the mean is dp's
        tokens += x.numel() * dp
        elapsed = None if t_start is None else time.perf_counter() - t_start
        row = {"step": step + 1, "loss": loss.item() / world,
               "tokens_per_s": None if not elapsed else tokens / elapsed,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "all_gather_bytes": gathered.bytes}
        rows.append(row)
        if dist.get_rank() == 0 and log is not None:
            tps = f"{row['tokens_per_s']:,.0f} tok/s" if row["tokens_per_s"] else "warm-up"
            mem = f" | peak {row['peak_gib']:.1f} GiB" if cuda else ""
            log(f"step {row['step']:>4} | loss {row['loss']:.4f} | {tps}{mem} | "
                f"all-gather {gathered.bytes / 2**20:,.1f} MiB/step", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per dp rank per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--fp8", choices=["none", "delayed", "current"], default="none")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="gather the bf16 weights as FP8 (enable_fp8_all_gather; needs --fp8)")
    p.add_argument("--fp8-params", action="store_true",
                   help="the decoder layers' GEMM weights as FP8 params (fp8_model_init; needs "
                        "--fp8 delayed)")
    p.add_argument("--recompute", action="store_true", help="recompute each decoder layer")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2D mesh dp x tp, "
                   "sequence parallelism; must divide the number of processes)")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto")
    args = p.parse_args(argv)
    device = setup(args.device)
    try:
        mesh = make_mesh(device, args.tp)
    except ValueError as e:
        p.error(str(e))
    import tritium as te
    rcp = fp8_recipe(args.fp8)
    if args.fp8_all_gather and rcp is None:
        p.error("--fp8-all-gather needs --fp8 delayed or --fp8 current")
    if args.fp8_params and args.fp8 != "delayed":
        p.error("--fp8-params needs --fp8 delayed (FSDP2 shards FP8 params of DelayedScaling)")
    if args.fp8_params and args.fp8_all_gather:
        p.error("--fp8-params already gathers FP8 bytes: drop --fp8-all-gather")
    model, _ = build(args.config, device, fp8_all_gather=rcp if args.fp8_all_gather else None,
                     recompute=args.recompute, mesh=mesh,
                     fp8_params=rcp if args.fp8_params else None)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=args.lr, master_weights=True)
    if dist.get_rank() == 0 and args.tp > 1 and device.type == "cuda" and \
            os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        print("note: tensor-parallel jobs run faster launched with CUDA_DEVICE_MAX_CONNECTIONS=1 "
              "(docs/tensor_parallel.md)", flush=True)
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{args.config}: {n / 1e6:,.1f}M params on {dist.get_world_size()} x {device.type}; "
              f"(dp {mesh['dp'].size()} x tp {args.tp}); fp8={args.fp8} "
              f"fp8_all_gather={args.fp8_all_gather}", flush=True)
    data = batches(args.seq_len, args.batch, args.steps, device, mesh=mesh)
    train(model, opt, data, rcp=rcp, dp=mesh["dp"].size())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
