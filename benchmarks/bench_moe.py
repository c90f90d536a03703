"""MoE layer fwd+bwd: tritium FP8 (te.MoE) vs the same layer in bf16 through torch._grouped_mm,
and torchao's FP8 grouped GEMM where the installed torchao has one.

    python benchmarks/bench_moe.py            # GPU: Mixtral-8x7B-shaped layer (below)
    python benchmarks/bench_moe.py --tiny     # CPU smoke run (tiny shapes, emulated FP8)
    python benchmarks/bench_moe.py --stages [--sweep]   # GPU: each FP8 stage alone (moe_stages)

Shape: 8 experts, top-2, hidden 4096, ffn 14336, 8192 tokens, bf16, swiglu experts, no bias.
Cases:
  * "layer": the whole MoE block (router, permutation, experts, unpermute). Baseline = plain
    PyTorch: router nn.Linear, softmax top-k renormalised (Mixtral's), argsort permutation,
    experts through torch._grouped_mm (a per-expert loop where torch lacks it), index_add
    unpermute. Rows: that in bf16; te.MoE in bf16 and FP8 (delayed, current scaling); the
    plain layer with its grouped GEMMs through torchao's FP8 rowwise grouped GEMM (each
    expert's rows padded to 16 with zero rows: torchao 0.18 needs 16-row groups and does not
    pad them itself).
  * "experts": the expert GEMMs alone (fc1, swiglu, fc2) on balanced splits (2048 rows per
    expert, multiples of 16 as torchao needs): bf16 _grouped_mm vs tritium FP8 vs torchao.
  * "routing": te.MoE's router + permute + unpermute alone (fwd+bwd); its `share_of_fp8_layer`
    is the part of the FP8 layer's time they take (target < 10%).
Every FP8 row casts the weights in every step (no is_first_microbatch, so no weight caching:
the single-step comparison with bf16 is fair; with micro-batches `is_first_microbatch=False`
skips the weight casts, the largest of the six per step).
FLOPs: 6 * (T * topk) * H * F * 3 per fwd+bwd (three expert GEMMs; the router's are ~0.1%).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, measure_fwd_bwd  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402


def grouped_mm_fn():
    """torch._grouped_mm(x [M, K], w [G, K, N] (column-major per group), offs) or None."""
    return getattr(torch, "_grouped_mm", None)


def torchao_grouped_mm():
    """(name, fn(x, w_t, offs) -> bf16) of torchao's FP8 rowwise grouped GEMM, or (why, None)."""
    try:
        import torchao.prototype.moe_training as mt
    except Exception as exc:
        return f"torchao.prototype.moe_training not importable: {exc!r}", None
    fn = getattr(mt, "_to_fp8_rowwise_then_scaled_grouped_mm", None)
    if fn is not None:
        # torchao 0.18 asserts on its own padding (pad_token_groups_for_grouped_mm=True, the
        # default, "is not yet supported"): the callers pad every group to 16 rows themselves
        # (PlainMoE(align=16)) and say so
        return ("_to_fp8_rowwise_then_scaled_grouped_mm",
                lambda a, b, offs: fn(a, b, offs=offs, out_dtype=torch.bfloat16,
                                      pad_token_groups_for_grouped_mm=False))
    return f"no FP8 grouped GEMM in torchao.prototype.moe_training ({dir(mt)})", None


def expert_gemm(x, w, m_splits, offs, gmm):
    """x [M, K] rows grouped by expert, w [G, N, K] -> [M, N]."""
    if gmm is None:  # a per-expert loop
        return torch.cat([F.linear(xi, w[i]) for i, xi in enumerate(x.split(m_splits))])
    return gmm(x, w.transpose(-2, -1), offs)


class PlainMoE(torch.nn.Module):
    """The baseline: Mixtral's routing and swiglu experts in plain PyTorch."""

    def __init__(self, h, f, e, k, device, dtype, gmm, share=None, align=1):
        super().__init__()
        self.e, self.k, self.gmm, self.align = e, k, gmm, align
        if share is not None:  # the same parameters, another grouped GEMM
            self.router, self.w1, self.w2 = share.router, share.w1, share.w2
            return
        self.router = torch.nn.Parameter(torch.randn(e, h, device=device, dtype=dtype) * 0.02)
        self.w1 = torch.nn.Parameter(torch.randn(e, 2 * f, h, device=device, dtype=dtype) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(e, h, f, device=device, dtype=dtype) * 0.02)

    def forward(self, x):
        t = x.shape[0]
        p = torch.softmax(F.linear(x, self.router).float(), -1)
        top, idx = p.topk(self.k, -1)
        top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.e)
        m_splits = counts.tolist()
        offs = torch.cumsum(counts, 0).to(torch.int32)
        src = order // self.k
        if self.align > 1:  # every expert's rows padded to `align` with zero rows (torchao)
            m_splits = [-(-c // self.align) * self.align for c in m_splits]
            padded = torch.tensor(m_splits, device=x.device)
            start = torch.cumsum(counts, 0) - counts
            pstart = torch.cumsum(padded, 0) - padded
            dest = torch.arange(flat.numel(), device=x.device) - start[flat[order]] + \
                pstart[flat[order]]
            offs = torch.cumsum(padded, 0).to(torch.int32)
            rows = x.new_zeros(sum(m_splits), x.shape[1]).index_copy(0, dest, x[src])
        else:
            rows = x[src]
        h = expert_gemm(rows, self.w1, m_splits, offs, self.gmm)
        gate, up = h.chunk(2, -1)
        y = expert_gemm(F.silu(gate) * up, self.w2, m_splits, offs, self.gmm)
        if self.align > 1:
            y = y[dest]
        y = y * top.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, src, y).view(t, -1)


class Experts(torch.nn.Module):
    """fc1 -> swiglu -> fc2 on rows already grouped by expert (fixed splits)."""

    def __init__(self, moe_plain, m_splits, gmm):
        super().__init__()
        self.w1, self.w2, self.m_splits, self.gmm = moe_plain.w1, moe_plain.w2, m_splits, gmm
        self.offs = torch.cumsum(torch.tensor(m_splits), 0).to(torch.int32).to(moe_plain.w1.device)

    def forward(self, x):
        gate, up = expert_gemm(x, self.w1, self.m_splits, self.offs, self.gmm).chunk(2, -1)
        return expert_gemm(F.silu(gate) * up, self.w2, self.m_splits, self.offs, self.gmm)


class TeExperts(torch.nn.Module):
    def __init__(self, moe, m_splits):
        super().__init__()
        self.moe, self.m_splits = moe, m_splits

    def forward(self, x):
        from tritium.functional.activation import activation
        h = activation(self.moe.experts_fc1(x, self.m_splits), "swiglu")
        return self.moe.experts_fc2(h, self.m_splits)


class Routing(torch.nn.Module):
    """te.MoE's router + permute + unpermute, without the experts."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        cfg = self.moe.config
        logits = F.linear(x, self.moe.router_weight)
        probs, rmap = te.fused_topk_with_score_function(logits, cfg.topk, False, None, None,
                                                        None, "softmax", None)
        rmap.sum(0).tolist()  # the host read-back te.MoE does for m_splits
        rows, row_id_map = te.moe_permute(x, rmap, num_out_tokens=x.shape[0] * cfg.topk)
        return te.moe_unpermute(rows, row_id_map, merging_probs=probs)


def _measure_cpu(module, x, dy, ctx=None) -> dict:
    def step():
        for p in list(module.parameters()) + [x]:
            p.grad = None
        if ctx is None:
            out = module(x)
        else:
            with ctx():
                out = module(x)
        out.backward(dy)
    step()
    t0 = time.perf_counter()
    step()
    return {"ms": round((time.perf_counter() - t0) * 1e3, 3)}


def stages(sweep: bool) -> None:
    if not torch.cuda.is_available():
        print("bench_moe --stages needs a CUDA GPU")
        return
    from moe_stages import run_stages
    t, h, f, e, k = 8192, 4096, 14336, 8, 2

    def experts_case():
        torch.manual_seed(0)
        moe = te.MoE(h, f, te.MoEConfig(num_experts=e, topk=k), params_dtype=torch.bfloat16,
                     device="cuda")
        xe = torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dye = torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16)
        delayed = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
        return (TeExperts(moe, [t * k // e] * e), xe, dye,
                lambda: te.fp8_autocast(fp8_recipe=delayed))
    run_stages(experts_case, sweep)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run, tiny shapes")
    parser.add_argument("--stages", action="store_true",
                        help="GPU: time each FP8 stage of the experts alone (moe_stages.py)")
    parser.add_argument("--sweep", action="store_true", help="with --stages: tile configs")
    args = parser.parse_args()
    if args.stages:
        return stages(args.sweep)
    if args.tiny:
        t, h, f, e, k, device = 64, 64, 32, 4, 2, "cpu"
        os.environ.setdefault("OUT", tempfile.mkdtemp(prefix="bench_moe_tiny_"))
        measure = _measure_cpu
    else:
        if not torch.cuda.is_available():
            print("bench_moe needs a CUDA GPU (or --tiny for a CPU smoke run)")
            return
        t, h, f, e, k, device = 8192, 4096, 14336, 8, 2, "cuda"
        measure = measure_fwd_bwd
    dtype = torch.bfloat16
    torch.manual_seed(0)
    gmm = grouped_mm_fn()
    plain = PlainMoE(h, f, e, k, device, dtype, gmm)
    moe = te.MoE(h, f, te.MoEConfig(num_experts=e, topk=k), params_dtype=dtype, device=device)
    with torch.no_grad():  # the same weights
        moe.router_weight.copy_(plain.router)
        for i in range(e):
            getattr(moe.experts_fc1, f"weight{i}").copy_(plain.w1[i])
            getattr(moe.experts_fc2, f"weight{i}").copy_(plain.w2[i])
    x = torch.randn(t, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(t, h, device=device, dtype=dtype)
    delayed = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    fp8_d = lambda: te.fp8_autocast(fp8_recipe=delayed)  # noqa: E731
    fp8_c = lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling())  # noqa: E731
    ao_name, ao = torchao_grouped_mm()
    base_name = f"bf16 plain, {'torch._grouped_mm' if gmm else 'per-expert loop'}"
    flops = 18 * t * k * h * f
    layer_case = f"layer T{t} E{e} top{k} H{h} F{f}"
    variants = [(layer_case, base_name, plain, None),
                (layer_case, "tritium MoE bf16", moe, None),
                (layer_case, "tritium MoE fp8 delayed", moe, fp8_d),
                (layer_case, "tritium MoE fp8 current", moe, fp8_c)]
    if ao is not None:
        variants.append((layer_case, f"plain, torchao {ao_name}",
                         PlainMoE(h, f, e, k, device, dtype, ao, share=plain, align=16), None))
    balanced = [t * k // e] * e
    ex_case = f"experts {e}x{t * k // e} rows H{h} F{f}"
    xe = torch.randn(t * k, h, device=device, dtype=dtype, requires_grad=True)
    dye = torch.randn(t * k, h, device=device, dtype=dtype)
    variants += [(ex_case, "bf16 _grouped_mm" if gmm else "bf16 per-expert loop",
                  Experts(plain, balanced, gmm), None),
                 (ex_case, "tritium GroupedLinear fp8 delayed", TeExperts(moe, balanced), fp8_d),
                 (ex_case, "tritium GroupedLinear fp8 current", TeExperts(moe, balanced), fp8_c)]
    if ao is not None:
        variants.append((ex_case, f"torchao {ao_name}", Experts(plain, balanced, ao), None))
    rows = []
    if ao is None:
        rows.append({"case": layer_case, "variant": "torchao fp8 grouped mm", "error": ao_name})
    for case, name, module, ctx in variants:
        xi, dyi = (xe, dye) if case == ex_case else (x, dy)
        try:
            res = measure(module, xi, dyi, ctx)
        except Exception as exc:
            rows.append({"case": case, "variant": name, "error": repr(exc)})
            print(rows[-1], flush=True)
            continue
        row = {"case": case, "variant": name, **res}
        row["tflops"] = round(flops / res["ms"] / 1e9, 1)
        rows.append(row)
        print(row, flush=True)
    routing = {"case": layer_case, "variant": "tritium router+permute+unpermute only"}
    try:
        routing.update(measure(Routing(moe), x, dy))
        fp8_layer = next((r for r in rows if r["variant"] == "tritium MoE fp8 delayed"
                          and "ms" in r), None)
        if fp8_layer is not None:
            routing["share_of_fp8_layer"] = round(routing["ms"] / fp8_layer["ms"], 3)
    except Exception as exc:
        routing["error"] = repr(exc)
    rows.append(routing)
    print(routing, flush=True)
    # the experts case has its own baseline row: rename so finish() pairs it per case
    for r in rows:
        if r["case"] == ex_case and r["variant"].startswith("bf16"):
            r["variant"] = base_name
    finish("moe" + ("-tiny" if args.tiny else ""), rows, baseline=base_name)


if __name__ == "__main__":
    main()
