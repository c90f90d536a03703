"""CUDA graphs: an FP8 training step of a small model, graphed vs eager (issue 7: >= 2x).

Model: 4 tritium TransformerLayers (hidden 512, 8 heads, ffn 2048, bf16 params, dropout 0), input
sbhd seq 128 x batch 2: small enough that an eager step is bound by host launch overhead.
Recipe DelayedScaling (HYBRID, history 16, "max"). A step is forward + backward + FusedAdam step
+ zero_grad; the FP8 scale updates (outer fp8_autocast exit, after the backward) stay eager in
every variant, as they must. Variants:
  * "fp8 eager": the baseline;
  * "fp8 graphed fwd+bwd": make_graphed_callables(fp8_enabled=True), optimizer eager;
  * "fp8 graphed fwd+bwd+adam": the same plus FusedAdam(capturable=True).step() captured by
    torch.cuda.graph (grads zeroed in place);
  * two micro-batches per step with FP8 weight caching (eager is_first_microbatch vs the graphed
    device flag), graphed with the optimizer captured;
  * bf16 eager and graphed for reference;
  * "fp8 current eager": the eager step under Float8CurrentScaling instead (no amax history,
    each cast's scale measured now), timed in the same rounds as the FP8 / bf16 pair;
  * "fp8 eager" and "bf16 eager" again with the backward on the calling thread
    (`torch.autograd.set_multithreading_enabled(False)` around the step, docs/performance.md:
    a Python backward on the autograd engine's device thread is the host's slow part);
  * "fp8 compiled reduce-overhead" (issue 20: >= 5x): torch.compile(model, mode="reduce-overhead",
    fullgraph=True), fp8_autocast entered outside the compiled call; forward and backward run as
    inductor's CUDA graphs (torch.compiler.cudagraph_mark_step_begin() before each forward), the
    optimizer captured as above. The grads are allocated once before the first step and zeroed
    in place, so the backward accumulates into tensors of their own, never into CUDA-graph
    memory a later replay overwrites. A graph break, a CUDA graph skipped by inductor (a silent
    eager fallback otherwise) or a recompile in the timed steps is an error row.
Timing: triton.testing.do_bench median of whole steps (see harness.py); the one-micro-batch
eager steps, host-bound, are compared as pairs (FP8 and bf16 of each case, and FP8 current
beside them in the first) timed in 15 alternating rounds (harness.interleaved_rounds): each
row's ms is its median over the rounds, and each row's `paired_speedup` the median of the
rounds' FP8 (delayed) / its own ratios (each round's steps ran back to back, so the host's
drift between rounds cancels; issue 19's target reads the bf16 row's).
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import (compile_counts, error_fields, finish, interleaved_rounds,  # noqa: E402
                     median_ms, no_recompiles, paired_speedups, time_ms)

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402
from tritium.graphs import make_graphed_callables  # noqa: E402
from tritium.optimizers import FusedAdam  # noqa: E402

LAYERS, H, HEADS, FFN, SEQ, BATCH = 4, 512, 8, 2048, 128, 2
PAIR_ROUNDS = 15


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.bfloat16) for _ in range(LAYERS))

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def make_step(fp8, graph, capture_opt: bool, micro_batches: int = 1):
    """One training step; fp8: False (bf16), True (DelayedScaling) or "current"
    (Float8CurrentScaling); graph: False (eager), True (make_graphed_callables) or
    "reduce-overhead" (torch.compile)."""
    torch.manual_seed(0)
    model = Model()
    rec = recipe.Float8CurrentScaling() if fp8 == "current" else \
        recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    fp8 = bool(fp8)
    shape = (SEQ, BATCH, H)
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(micro_batches)]
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    caching = fp8 and micro_batches > 1
    compiled = graph == "reduce-overhead"
    if compiled:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch._dynamo.reset()
        if fp8:
            te.prepare_fp8(model, rec)  # the FP8 state outside the graphs (docs/compile.md)
        model = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    elif graph:
        model = make_graphed_callables(model, (xs[0],), fp8_enabled=fp8,
                                       fp8_recipe=rec if fp8 else None,
                                       fp8_weight_caching=caching)
    opt = FusedAdam(model.parameters(), lr=1e-4, capturable=capture_opt)

    def fwd_bwd():
        for mb, x in enumerate(xs):
            kw = {"is_first_microbatch": mb == 0} if caching else {}
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with te.fp8_autocast(enabled=fp8, fp8_recipe=rec):
                y = model(x, **kw)
            y.backward(dy)

    if compiled:  # warm-up and record inductor's CUDA graphs before the optimizer's capture
        for _ in range(3):
            fwd_bwd()

    if not capture_opt:
        def step():
            fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    fwd_bwd()  # one eager optimizer step: state created, kernels compiled, then capture it
    opt.step()
    opt.zero_grad(set_to_none=False)
    fwd_bwd()
    torch.cuda.synchronize()
    opt_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(opt_graph):
        opt.step()
    opt.zero_grad(set_to_none=False)

    def step():
        fwd_bwd()
        opt_graph.replay()
        opt.zero_grad(set_to_none=False)
    return step


CALLING_THREAD = "1 micro-batch, backward on calling thread"


def _on_calling_thread(step):
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


def main():
    if not torch.cuda.is_available():
        print("bench_graphs needs a CUDA GPU")
        return
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    variants = [  # (case, variant, fp8, graph (see make_step), capture optimizer, micro-batches)
        ("1 micro-batch", "fp8 eager", True, False, False, 1),
        ("1 micro-batch", "fp8 graphed fwd+bwd", True, True, False, 1),
        ("1 micro-batch", "fp8 graphed fwd+bwd+adam", True, True, True, 1),
        ("1 micro-batch", "bf16 eager", False, False, False, 1),
        ("1 micro-batch", "fp8 current eager", "current", False, False, 1),
        ("1 micro-batch", "bf16 graphed fwd+bwd+adam", False, True, True, 1),
        ("2 micro-batches, weight caching", "fp8 eager", True, False, False, 2),
        ("2 micro-batches, weight caching", "fp8 graphed fwd+bwd+adam", True, True, True, 2),
        ("1 micro-batch", "fp8 compiled reduce-overhead", True, "reduce-overhead", True, 1),
        (CALLING_THREAD, "fp8 eager", True, False, False, 1),
        (CALLING_THREAD, "bf16 eager", False, False, False, 1),
    ]
    rows, eager_pairs = [], {}
    for case, name, fp8, graph, capture_opt, mbs in variants:
        full = f"L{LAYERS} H{H} heads{HEADS} S{SEQ} B{BATCH}, {case}"
        if fp8 and not fp8_ok:
            rows.append({"case": full, "variant": name, "error": "no FP8 on this GPU"})
            continue
        compiled = graph == "reduce-overhead"
        extra = {}
        try:
            before, t0 = compile_counts(), time.perf_counter()
            step = make_step(fp8, graph, capture_opt, mbs)
            if case == CALLING_THREAD:
                step = _on_calling_thread(step)
            if graph is False and mbs == 1:  # timed below, beside its pair
                eager_pairs.setdefault(full, {})[name] = step
                continue
            if compiled:
                extra = {"fullgraph": True, "compile_s": round(time.perf_counter() - t0, 1),
                         "graphs": compile_counts()["graphs"] - before["graphs"]}
            with no_recompiles() if compiled else contextlib.nullcontext():
                ms = time_ms(step)
            if compiled and compile_counts()["cudagraph_skips"] > before["cudagraph_skips"]:
                raise RuntimeError("inductor skipped CUDA graphs for part of the step (run "
                                   "with TORCH_LOGS=perf_hints for the reason)")
        except Exception as exc:  # a failing variant is a row, not a crash
            rows.append({"case": full, "variant": name, **error_fields(exc)})
            print(rows[-1], flush=True)
            continue
        rows.append({"case": full, "variant": name, "ms": ms,
                     "ktok_per_s": round(mbs * SEQ * BATCH / ms, 1), **extra})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    for full, steps in eager_pairs.items():
        seen = interleaved_rounds(steps, rounds=PAIR_ROUNDS)
        paired = paired_speedups(seen, "fp8 eager") if "fp8 eager" in seen else {}
        for name, ms in median_ms(seen).items():
            rows.append({"case": full, "variant": name, "ms": ms,
                         "ktok_per_s": round(SEQ * BATCH / ms, 1), "timing": "interleaved",
                         "rounds": PAIR_ROUNDS, **({"paired_speedup": paired[name]}
                                                   if name in paired else {})})
            print(rows[-1], flush=True)
    finish("graphs", rows, baseline="fp8 eager")


if __name__ == "__main__":
    main()
