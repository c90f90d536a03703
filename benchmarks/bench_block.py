"""A Llama-3-8B-shaped TransformerLayer, fwd+bwd: tritium FP8 vs eager bf16 PyTorch and torchao.

Shape (issue 4, BASELINE.md): B2 x S4096 tokens, hidden 4096, 32 heads, 8 KV groups, head dim
128, ffn 14336 SwiGLU, RMSNorm, no bias, causal, RoPE. Variants, one run:
  * "bf16 eager Llama block": plain PyTorch (q/k/v/o/gate/up/down nn.Linear, fp32 RMSNorm cast
    back, rotate-half RoPE, causal SDPA with GQA), eager: the baseline;
  * the same block under torch.compile; under torchao float8 tensorwise (convert_to_float8_training)
    eager and compiled;
  * tritium TransformerLayer in bf16 and under fp8_autocast (DelayedScaling HYBRID, history 16,
    "max"; and Float8CurrentScaling); the delayed recipe also with FP8 attention (fp8_dpa) and
    with fp8_mha (FP8 attention whose output reaches the output projection in E4M3);
  * the same three tritium variants under `torch.compile(block, fullgraph=True)` (default mode),
    fp8_autocast entered outside the compiled call as torchtitan does (issue 20). Each compiles
    afresh (dynamo reset) in two warm-up steps, fwd and bwd (compile_s, graphs); a graph break
    raises (an error row with fullgraph False, no eager fallback) and so does a recompile in the
    timed steps. vs_eager = the eager variant's ms / ms, vs_torchao_compiled = torchao compiled's
    ms / ms (FP8 rows).
Reported: ms, tokens/s, peak MiB with the input resident and with the input made in the step.
--only REGEX: the variants whose names match (the baseline always runs). --profile: each variant's
GPU kernels per step after its timing (torch.profiler, 5 steps): busy ms and the top kernels, to
compare a compiled variant's kernels with its eager self's.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import re
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import (add_ratio, compile_counts, cuda_profile, error_fields, finish,  # noqa: E402
                     fwd_bwd_step, kernel_summary, measure_fwd_bwd, no_recompiles)

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402

B, S, H, HEADS, GROUPS, FFN = 2, 4096, 4096, 32, 8, 14336
D = H // HEADS
EPS = 1e-5
BASELINE = "bf16 eager Llama block"


def _rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(torch.nn.Module):
    """One Llama decoder layer in plain PyTorch (HF's math), bf16."""

    def __init__(self):
        super().__init__()
        kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
        self.q_proj = torch.nn.Linear(H, HEADS * D, **kw)
        self.k_proj = torch.nn.Linear(H, GROUPS * D, **kw)
        self.v_proj = torch.nn.Linear(H, GROUPS * D, **kw)
        self.o_proj = torch.nn.Linear(HEADS * D, H, **kw)
        self.gate_proj = torch.nn.Linear(H, FFN, **kw)
        self.up_proj = torch.nn.Linear(H, FFN, **kw)
        self.down_proj = torch.nn.Linear(FFN, H, **kw)
        self.ln1 = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=torch.bfloat16))
        self.ln2 = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=torch.bfloat16))
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        ang = torch.outer(torch.arange(S, device="cuda").float(), inv)
        emb = torch.cat((ang, ang), -1)
        self.register_buffer("cos", emb.cos().to(torch.bfloat16))
        self.register_buffer("sin", emb.sin().to(torch.bfloat16))

    def forward(self, x):
        b, s, _ = x.shape
        h = _rms(x, self.ln1)
        q = self.q_proj(h).view(b, s, HEADS, D).transpose(1, 2)
        k = self.k_proj(h).view(b, s, GROUPS, D).transpose(1, 2)
        v = self.v_proj(h).view(b, s, GROUPS, D).transpose(1, 2)
        q = q * self.cos + _rotate_half(q) * self.sin
        k = k * self.cos + _rotate_half(k) * self.sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, H))
        h = _rms(x, self.ln2)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TritiumBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = te.TransformerLayer(
            H, FFN, HEADS, num_gqa_groups=GROUPS, layernorm_epsilon=EPS, hidden_dropout=0.0,
            attention_dropout=0.0, normalization="RMSNorm", activation="swiglu", bias=False,
            fuse_qkv_params=True, qkv_weight_interleaved=False, attn_input_format="bshd",
            params_dtype=torch.bfloat16, device="cuda")
        self.freqs = te.RotaryPositionEmbedding(D)(S).cuda()

    def forward(self, x):
        return self.layer(x, rotary_pos_emb=self.freqs)


def _torchao(block, compile_it):
    from torchao.float8 import convert_to_float8_training
    model = convert_to_float8_training(copy.deepcopy(block))
    return torch.compile(model) if compile_it else model


def _compiled(block, x, dy, ctx) -> tuple:
    """(torch.compile(block, fullgraph=True), its warm-up fields): compiled afresh, warmed up by
    two fwd+bwd steps (the first compiles the forward and the backward)."""
    torch._dynamo.reset()
    before = compile_counts()["graphs"]
    compiled = torch.compile(block, fullgraph=True)
    step, _ = fwd_bwd_step(compiled, x, dy, ctx)
    t0 = time.perf_counter()
    step()
    step()
    torch.cuda.synchronize()
    return compiled, {"fullgraph": True, "compile_s": round(time.perf_counter() - t0, 1),
                      "graphs": compile_counts()["graphs"] - before}


def _print_kernels(name, module, x, dy, ctx, steps: int = 5) -> None:
    """The variant's kernels per step, then where the GPU waited inside the profiled steps: the
    gaps of over 10 us between one kernel's end and the next one's start, summed per pair of
    kernel names (the step is bound by the host where these add up)."""
    step, _ = fwd_bwd_step(module, x, dy, ctx)
    prof = cuda_profile(step, steps)
    summary = kernel_summary(prof, steps, top=30)
    print(f"--- {name}: GPU kernels {summary.busy:.3f} ms/step")
    for kernel, ms in summary.ranked:
        print(f"  {ms:8.3f} ms  {kernel[:120]}")
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end, last = {}, spans[0][1], spans[0][2]
    for start, stop, kernel in spans[1:]:
        if start - end > 10:
            pair = f"{last[:50]} -> {kernel[:50]}"
            gaps[pair] = gaps.get(pair, 0.0) + (start - end) / 1e3 / steps
        if stop > end:
            end, last = stop, kernel
    print(f"  GPU idle between kernels: {sum(gaps.values()):.3f} ms/step")
    for pair, ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {ms:8.3f} ms idle  {pair}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="regex: variants to run (the baseline always runs)")
    p.add_argument("--profile", action="store_true",
                   help="print each variant's GPU kernels per step (busy ms, top kernels)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block needs a CUDA GPU")
        return
    x = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16)
    ref = LlamaBlock()
    ours = TritiumBlock()
    delayed = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                    amax_compute_algo="max")
    fp8_delayed = lambda: te.fp8_autocast(fp8_recipe=delayed)  # noqa: E731
    fp8_current = lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling())  # noqa: E731

    def fp8_attention(flag):   # delayed, with FP8 attention (fp8_dpa) or fp8_mha as well
        r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                  amax_compute_algo="max", **{flag: True})
        return lambda: te.fp8_autocast(fp8_recipe=r)
    variants = [  # (name, module factory, forward context, compiled by torch.compile here)
        ("bf16 eager Llama block", lambda: ref, None, False),
        ("bf16 Llama block compiled", lambda: torch.compile(ref), None, False),
        ("torchao fp8 tensorwise eager", lambda: _torchao(ref, False), None, False),
        ("torchao fp8 tensorwise compiled", lambda: _torchao(ref, True), None, False),
        ("tritium TransformerLayer bf16", lambda: ours, None, False),
        ("tritium TransformerLayer fp8 delayed", lambda: ours, fp8_delayed, False),
        ("tritium TransformerLayer fp8 current", lambda: ours, fp8_current, False),
        ("tritium TransformerLayer fp8 delayed fp8_dpa", lambda: ours, fp8_attention("fp8_dpa"),
         False),
        ("tritium TransformerLayer fp8 delayed fp8_mha", lambda: ours, fp8_attention("fp8_mha"),
         False),
        ("tritium TransformerLayer fp8 delayed fp8_mha compiled", lambda: ours,
         fp8_attention("fp8_mha"), True),
        ("tritium TransformerLayer bf16 compiled", lambda: ours, None, True),
        ("tritium TransformerLayer fp8 delayed compiled", lambda: ours, fp8_delayed, True),
        ("tritium TransformerLayer fp8 current compiled", lambda: ours, fp8_current, True)]
    variants = [v for v in variants if v[0] == BASELINE or re.search(args.only, v[0])]
    case = f"B{B} S{S} H{H} ffn{FFN}"
    rows = []
    for name, make, ctx, compile_it in variants:
        extra = {}
        try:
            module = make()
            if compile_it:
                module, extra = _compiled(module, x, dy, ctx)
            with no_recompiles() if compile_it else contextlib.nullcontext():
                res = measure_fwd_bwd(module, x, dy, ctx, in_network=True)
        except Exception as exc:
            rows.append({"case": case, "variant": name, **error_fields(exc)})
            print(rows[-1], flush=True)
            continue
        rows.append({"case": case, "variant": name, "ms": res["ms"],
                     "ktok_per_s": round(B * S / res["ms"], 1), "peak_mb": res["peak_mb"],
                     "peak_mb_in_network": res["peak_mb_in_network"], **extra})
        print(rows[-1], flush=True)
        if args.profile:
            _print_kernels(name, module, x, dy, ctx)
        torch.cuda.empty_cache()
    ours_names = [v[0] for v in variants if v[3]]
    add_ratio(rows, "vs_eager", [(v, v[:-len(" compiled")]) for v in ours_names])
    add_ratio(rows, "vs_torchao_compiled", [(v, "torchao fp8 tensorwise compiled")
                                            for v in ours_names if "fp8" in v])
    add_ratio(rows, "vs_fp8_dpa", [("tritium TransformerLayer fp8 delayed fp8_mha",
                                    "tritium TransformerLayer fp8 delayed fp8_dpa")])
    finish("block", rows, baseline=BASELINE)


if __name__ == "__main__":
    main()
