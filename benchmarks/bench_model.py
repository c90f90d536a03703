"""The whole training step of a 1B Llama: tritium against HF eager, Liger, torch.compile, torchao.

Model (issue 19): a real transformers `LlamaForCausalLM` with Llama-3.2-1B's shape (16 layers,
hidden 2048, 32 heads, 8 KV heads, head dim 64, ffn 8192, vocab 128256, tied embeddings,
rope_theta 500000), random weights (HF's init, seed 0: the same weights in every variant), cast
to bf16 with model.to(torch.bfloat16). Data: B4 x S2048 byte-level ids of real text (the
demo's corpus loader: the Python standard library's source), the same 50 batches for every
variant; labels = input ids (HF shifts them). A step: zero_grad, forward with labels, backward,
optimizer step.

Optimizer. Every variant: torch.optim.AdamW(fused=True), lr 3e-4, betas (0.9, 0.95), no
weight decay, on the bf16 parameters themselves: no fp32 master copy (its moments are bf16 as
well, torch keeps them in the parameter's dtype), as a plain `model.to(bf16)` training loop
does. Beside it, tritium FP8 delayed with te.optimizers.FusedAdam(master_weights=True): fp32
masters and fp32 moments as optimizer state, the bf16 parameters written from the masters.

Variants (each in its own process, so a peer's global patches, compile caches and memory never
leak into the next one; --only picks some):
  hf_eager       HF, attn_implementation="sdpa", eager: the baseline
  hf_liger       apply_liger_kernel_to_llama() before building the model (RoPE, RMSNorm,
                 SwiGLU, fused linear cross-entropy)
  hf_compile     every decoder layer torch.compile'd (module.compile())
  hf_torchao     torchao convert_to_float8_training (tensorwise) on the decoder layers' Linears
                 (lm_head stays bf16: it is tied to the embedding), then layers compiled
  tritium_bf16   tritium.integrations.hf.convert_llama (fused linear cross-entropy loss)
  tritium_fp8_delayed / tritium_fp8_current   convert_llama, forward under te.fp8_autocast with
                 DelayedScaling(HYBRID, amax_history_len=16, "max") / Float8CurrentScaling()
  tritium_fp8_delayed_fp8head   the same with the lm_head GEMMs in FP8 (fp8_lm_head=True)
  tritium_fp8_delayed_fusedadam FP8 delayed with te.optimizers.FusedAdam(master_weights=True)
  tritium_bf16_compile / tritium_fp8_delayed_compile   tritium_bf16 / tritium_fp8_delayed with
                 every converted decoder layer compiled (issue 20): layer.compile(fullgraph=True),
                 default mode, fp8_autocast outside the compiled calls. A graph break raises, so
                 does hitting dynamo's recompile limit (64 here, as hf_compile: one graph per
                 distinct layer is allowed) and any recompile after the warm-up steps: an error
                 row, never an eager fallback. Choosing one also runs its eager self;
                 vs_eager = the eager self's ms / ms.
  tritium_fp8_delayed_compile_cudagraphs   the same with mode="reduce-overhead": each layer's
                 forward and backward replayed as CUDA graphs (inductor's cudagraph trees;
                 torch.compiler.cudagraph_mark_step_begin() at each step), so the layers cost
                 no host time per op; the embedding, final norm, loss and optimizer stay eager.
  tritium_fp8_delayed_fp8head_compile_cudagraphs   both: FP8 lm_head GEMMs and graphed layers
                 (its eager self: tritium_fp8_delayed_fp8head).
Reported per variant: ms per step and tokens_per_s (mean over the steps after the first
WARMUP, which compile and autotune), peak_gib (torch.cuda.max_memory_allocated over the whole
run: weights, grads, optimizer state, activations), loss_50 (the last step's loss) and
loss_curve (every step); compiled variants also fullgraph and graphs (how many dynamo compiled).
speedup_vs_hf_eager = hf_eager ms / ms.

--tiny: a small config (2 layers, hidden 64, vocab 512, B2 x S64), 3 steps: a smoke test that
writes the same rows. Without a GPU it runs on the CPU, in this process, only the variants that
run there (hf_eager and tritium_*; FP8 emulated; the compiled ones through inductor's CPU
backend).
--rounds R: every chosen variant R times, in alternating order (a fresh process each time
on the GPU), for ratios of steps whose host and clock drift between runs (two H200 runs of one
commit put the graphed FP8 step at 1.252x and 1.249x hf_torchao): each row's ms is the median
over its rounds (`ms_rounds` lists them; the other fields are the first round's), and each
tritium row gets `paired_vs_<v>` for the baseline, every peer and its eager self: the median
over rounds of v's ms / this variant's ms in the same round, which the report's "versus"
targets read where present.
--profile VARIANT: that variant in this process under torch.profiler: wall time per step, GPU
kernel time per step and the kernels that take it (is the step bound by kernels or the host?).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (add_ratio, compile_counts, device_syncs, error_fields,  # noqa: E402
                     finish, loss_tail, no_recompiles, paired_speedups)

MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
             max_position_embeddings=8192)
TINY = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
BATCH, SEQ, STEPS, WARMUP = 4, 2048, 50, 5
TINY_BATCH, TINY_SEQ, TINY_STEPS = 2, 64, 3
LR, BETAS = 3e-4, (0.9, 0.95)
BASELINE = "hf_eager"
VARIANTS = ["hf_eager", "hf_liger", "hf_compile", "hf_torchao", "tritium_bf16",
            "tritium_fp8_delayed", "tritium_fp8_current", "tritium_fp8_delayed_fp8head",
            "tritium_fp8_delayed_fusedadam", "tritium_bf16_compile", "tritium_fp8_delayed_compile",
            "tritium_fp8_delayed_compile_cudagraphs",
            "tritium_fp8_delayed_fp8head_compile_cudagraphs"]
CPU_VARIANTS = ["hf_eager", "tritium_bf16", "tritium_fp8_delayed", "tritium_fp8_current",
                "tritium_fp8_delayed_fusedadam", "tritium_bf16_compile",
                "tritium_fp8_delayed_compile", "tritium_fp8_delayed_compile_cudagraphs"]
EAGER_SELF = {"tritium_bf16_compile": "tritium_bf16",
              "tritium_fp8_delayed_compile": "tritium_fp8_delayed",
              "tritium_fp8_delayed_compile_cudagraphs": "tritium_fp8_delayed",
              "tritium_fp8_delayed_fp8head_compile_cudagraphs": "tritium_fp8_delayed_fp8head"}


def batches(n: int, batch: int, seq: int, seed: int = 0):
    """n [batch, seq] int64 id tensors of real text (bytes), on the CPU."""
    from tritium.demo import load_corpus, split_corpus
    data, _ = load_corpus(max_bytes=max(4 << 20, 64 * (seq + 1) * batch))
    train, _ = split_corpus(data, seq)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, train.numel() - seq, (batch,), generator=g)
        out.append(train[starts[:, None] + torch.arange(seq)].long())
    return out


def build(variant: str, cfg: dict, device: torch.device):
    """(model, optimizer, context factory for the forward) for one variant."""
    import transformers
    if variant == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    # use_cache=False in every variant: a training step builds no KV cache (with HF's default
    # use_cache=True each layer would append to a DynamicCache, and a compiled layer would be
    # specialized on its layer_idx: one recompile per layer).
    config = transformers.LlamaConfig(**cfg, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).train()
    ctx = contextlib.nullcontext
    if variant in ("hf_compile", "hf_torchao"):
        if variant == "hf_torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(model.model.layers,
                                       config=Float8LinearConfig.from_recipe_name("tensorwise"))
        # One compiled graph per distinct layer is the intent: allow a recompile per layer
        # rather than falling back to eager after dynamo's default limit of 8.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for layer in model.model.layers:
            layer.compile()
    if variant.startswith("tritium"):
        import tritium as te
        from tritium import recipe
        from tritium.integrations.hf import convert_llama
        convert_llama(model, fp8_lm_head="fp8head" in variant)
        if variant in EAGER_SELF:
            torch._dynamo.reset()  # the CPU smoke test runs variants in one process
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            mode = "reduce-overhead" if variant.endswith("cudagraphs") else None
            for layer in model.model.layers:
                layer.compile(fullgraph=True, mode=mode)
        if "fp8" in variant:
            rcp = recipe.Float8CurrentScaling() if "current" in variant else \
                recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                      amax_compute_algo="max")
            ctx = lambda: te.fp8_autocast(enabled=True, fp8_recipe=rcp)  # noqa: E731
            if variant in EAGER_SELF:
                te.prepare_fp8(model, rcp)  # the FP8 state outside the graphs (docs/compile.md)
    params = [p for p in model.parameters() if p.requires_grad]
    if variant.endswith("fusedadam"):
        import tritium as te
        opt = te.optimizers.FusedAdam(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0,
                                      adam_w_mode=True, master_weights=True)
    else:
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0,
                                fused=device.type == "cuda" or None)
    return model, opt, ctx


def run_variant(variant: str, tiny: bool, steps: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg, b, s = (TINY, TINY_BATCH, TINY_SEQ) if tiny else (MODEL, BATCH, SEQ)
    # On the device before the first step: a copy from pageable host memory inside the loop
    # would wait for the GPU to drain at every step.
    data = [ids.to(device) for ids in batches(steps, b, s)]
    graphs = compile_counts()["graphs"]
    model, opt, ctx = build(variant, cfg, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, marks = [], []

    cudagraphs = variant.endswith("cudagraphs")

    def step(ids):
        opt.zero_grad(set_to_none=True)
        if cudagraphs:  # a new step: the graphs may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())

    warm = min(WARMUP, max(steps - 2, 0))
    for ids in data[:warm + 1]:
        step(ids)
    # the timed steps (after marks[warm]): a compiled variant's recompile there raises
    with no_recompiles() if variant in EAGER_SELF else contextlib.nullcontext():
        for ids in data[warm + 1:]:
            step(ids)
    if cuda:
        torch.cuda.synchronize()
        ms = marks[warm].elapsed_time(marks[-1]) / max(steps - 1 - warm, 1)
    else:
        ms = (marks[-1] - marks[warm]) * 1e3 / max(steps - 1 - warm, 1)
    curve = [round(float(x), 5) for x in torch.stack(losses).float().cpu()]
    row = {"variant": variant, "ms": round(ms, 3), "tokens_per_s": round(b * s / ms * 1e3, 1),
           "loss_50": curve[-1], "loss_last10": round(loss_tail(curve), 5),
           "loss_curve": curve, "steps": steps,
           "optimizer": type(opt).__name__ + (" (fp32 masters)" if variant.endswith(
               "fusedadam") else " (bf16 params, no masters)")}
    if cuda:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if variant in EAGER_SELF:
        row.update(fullgraph=True, graphs=compile_counts()["graphs"] - graphs)
    return row


PHASES = ("forward", "backward", "optimizer")
_MARKER = "bitwise_not"  # a kernel no variant launches otherwise: it marks where a phase starts


def phase_gaps(kernels: list, steps: int) -> dict:
    """{phase: (GPU span, kernel-busy time, idle) in ms per step} from [(name, start_us,
    end_us)] sorted by start, where a marker kernel opens each phase of each step."""
    out = {ph: [0.0, 0.0] for ph in PHASES}
    phase, first, last = None, None, None

    def close():
        if phase is not None and first is not None:
            out[phase][0] += (last - first) / 1e3 / steps

    i = 0
    for name, start, end in kernels:
        if _MARKER in name:
            close()  # a phase spans from its marker to its last kernel
            phase, first, last = PHASES[i % len(PHASES)], end, end
            i += 1
            continue
        if phase is None:
            continue
        out[phase][1] += max(0.0, end - max(start, last)) / 1e3 / steps  # overlaps counted once
        last = max(last, end)
    close()
    return {ph: (span, busy, span - busy) for ph, (span, busy) in out.items()}


def profile_variant(variant: str, steps: int = 3, top: int = 30) -> None:
    """One variant in this process: WARMUP steps, then `steps` steps under torch.profiler. Prints
    the wall time per step, the GPU kernels' busy time per step and the kernels that take it,
    grouped by name, and per phase (forward, backward, optimizer) the GPU's span, its busy time
    and its idle time (where it waited for the host): is the step bound by kernels or by the
    host, and where. First, the device syncs of one step by the line that made them (a sync
    drains the GPU, which then waits for the host: HF's mask code made one per forward)."""
    from torch.profiler import ProfilerActivity, profile
    device = torch.device("cuda")
    data = [ids.to(device) for ids in batches(WARMUP + 1 + steps, BATCH, SEQ)]
    model, opt, ctx = build(variant, MODEL, device)
    flag = torch.zeros(1, dtype=torch.int8, device=device)
    cudagraphs = variant.endswith("cudagraphs")

    def step(ids):
        torch.bitwise_not(flag, out=flag)
        opt.zero_grad(set_to_none=True)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        torch.bitwise_not(flag, out=flag)
        loss.backward()
        torch.bitwise_not(flag, out=flag)
        opt.step()

    for ids in data[:WARMUP]:
        step(ids)
    syncs = device_syncs(lambda: step(data[WARMUP]))
    print(f"{variant}: device syncs in one step: " + (", ".join(
        f"{site} x{n}" for site, n in sorted(syncs.items())) or "none"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for ids in data[WARMUP + 1:]:
            step(ids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(ev, "is_user_annotation", False)]
    kernels: dict = {}
    for ev in events:
        if _MARKER not in ev.name:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time / 1e3 / steps
    busy = sum(kernels.values())
    print(f"{variant}: wall {wall:.2f} ms/step (profiled), GPU kernels {busy:.2f} ms/step")
    timeline = sorted((ev.name, ev.time_range.start, ev.time_range.end) for ev in events)
    timeline.sort(key=lambda k: k[1])
    for ph, (span, kbusy, idle) in phase_gaps(timeline, steps).items():
        print(f"  {ph:9s} GPU span {span:8.2f} ms, kernels {kbusy:8.2f} ms, idle {idle:7.2f} ms")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.3f} ms {100 * ms / busy:5.1f}%  {name[:110]}")


def merge_rounds(case: str, names: list, seen: dict) -> list:
    """{variant: [row of each round]} -> one row per variant (see --rounds): ms the median over
    the rounds that timed it, the rest the first round's; an error in any round is the row."""
    import statistics
    timed = {v: [r["ms"] for r in runs] for v, runs in seen.items()
             if all("ms" in r for r in runs)}
    rows = []
    for v in names:
        runs = seen[v]
        row = {"case": case, **next((r for r in runs if "ms" not in r), runs[0])}
        if len(runs) > 1 and v in timed:
            ms = statistics.median(timed[v])
            row.update(ms=round(ms, 3), ms_rounds=timed[v],
                       tokens_per_s=round(runs[0]["tokens_per_s"] * runs[0]["ms"] / ms, 1))
            versus = [u for u in names if not u.startswith("tritium")]
            if EAGER_SELF.get(v) in names:
                versus.append(EAGER_SELF[v])
            for u in versus if v.startswith("tritium") else ():
                if u in timed:
                    row[f"paired_vs_{u}"] = paired_speedups({u: timed[u], v: timed[v]}, u)[v]
        rows.append(row)
    return rows


def _child(variant: str, tiny: bool, steps: int, timeout: int) -> dict:
    """run_variant in a fresh process; an error row when it fails (the child's own, with its
    fields, when it wrote one)."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--steps",
               str(steps), "--row-file", dest] + (["--tiny"] if tiny else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "error": f"timed out after {timeout} s"}
        if not os.path.exists(dest):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"variant": variant, "error": " | ".join(tail)[-400:] or "failed"}
        with open(dest) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, help=f"variants, of {VARIANTS}")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="small config, in process (smoke test)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant (GPU runs)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variants this many times, alternating (medians, paired ratios)")
    p.add_argument("--profile", metavar="VARIANT",
                   help="profile one variant in this process: GPU kernel time per step, top kernels")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--row-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    steps = args.steps or (TINY_STEPS if args.tiny else STEPS)
    if args.profile:
        profile_variant(args.profile)
        return 0
    if args.child:
        try:
            row, rc = run_variant(args.child, args.tiny, steps), 0
        except Exception as exc:
            traceback.print_exc()
            row, rc = {"variant": args.child, **error_fields(exc)}, 1
        with open(args.row_file, "w") as f:
            json.dump(row, f)
        return rc
    if not args.tiny and not torch.cuda.is_available():
        print("bench_model needs a CUDA GPU (or --tiny for a CPU smoke test)")
        return 0
    names = VARIANTS if torch.cuda.is_available() else CPU_VARIANTS
    if args.only:
        bad = [v for v in args.only if v not in VARIANTS]
        if bad:
            p.error(f"unknown variants {bad}; choose from {VARIANTS}")
        # speedups need the baseline and a compiled variant's eager self in the same run
        wanted = set(args.only) | {EAGER_SELF[v] for v in args.only if v in EAGER_SELF}
        names = [v for v in VARIANTS if v in wanted]
    if BASELINE not in names:
        names = [BASELINE] + names
    case = ("tiny " if args.tiny else "Llama-3.2-1B ") + \
        (f"B{TINY_BATCH} S{TINY_SEQ}" if args.tiny else f"B{BATCH} S{SEQ}")
    seen = {v: [] for v in names}
    for r in range(max(args.rounds, 1)):
        for v in names if r % 2 == 0 else names[::-1]:
            if not torch.cuda.is_available():  # CPU smoke test: in this process
                try:
                    row = run_variant(v, True, steps)
                except Exception as exc:  # a missing peer, a CPU without the op: an error row
                    row = {"variant": v, **error_fields(exc)}
            else:
                row = _child(v, args.tiny, steps, args.timeout)
            seen[v].append(row)
            print({"round": r, **{k: x for k, x in row.items() if k != "loss_curve"}},
                  flush=True)
    rows = merge_rounds(case, names, seen)
    add_ratio(rows, "vs_eager", EAGER_SELF.items())
    # the loss target (issue 19: within 1% of HF bf16's after 50 steps) on the mean of the last
    # 10 steps: the curve still falls fast at step 50, and one step's loss wobbles by ~1%
    base = {r["case"]: r["loss_last10"] for r in rows
            if r["variant"] == BASELINE and "loss_last10" in r}
    for r in rows:
        if "loss_last10" in r and base.get(r["case"]):
            r["loss_last10_vs_hf_eager"] = round(r["loss_last10"] / base[r["case"]], 4)
    finish("model", rows, baseline=BASELINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
