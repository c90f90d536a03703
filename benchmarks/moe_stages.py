"""Stage probe of GroupedLinear's FP8 path at the Mixtral-8x7B expert shapes (`bench_moe.py
--stages`): every launch of the experts' fwd+bwd timed alone, next to its bf16 counterpart.

    python benchmarks/bench_moe.py --stages          # stages + candidates + profile
    python benchmarks/bench_moe.py --stages --sweep  # and a tile-config sweep of the GEMMs

Shapes: G=8 experts x 2048 rows (M=16384), fc1 4096 -> 2*14336, fc2 14336 -> 4096.
Per GEMM (fc1, fc2): the grouped casts (input e4m3 + transpose, weight e4m3 + transpose,
grad_output e5m2 + transpose; GB/s of bf16 read + fp8 data + fp8 transpose, and % of a bf16
device copy's GB/s measured here; fc1's weight cast also in other tiles; the 6 casts of an
experts step summed, against their floor at the copy's GB/s), fprop / dgrad / wgrad through
tritium's Triton kernels, through one cuBLASLt `_scaled_mm` per group (tritium.ops.grouped_gemm),
through torch._scaled_grouped_mm (CUTLASS, e4m3 only, rowwise fp32
scales: a group's tensorwise scale written to each of its rows) and through bf16
torch._grouped_mm. Timing: do_bench medians.
Then torch.profiler's kernel table of one FP8 experts step (where the step's time goes).
Prints one line per measurement ({"stage", "ms", "tflops" or "gbps"}); nothing is written.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness import time_ms

from tritium.functional.activation import activation
from tritium.kernels import grouped_gemm as kg
from tritium.ops import grouped_gemm as og
from tritium.ref.grouped_gemm import make_offsets

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


_CAST_STEP = []  # (ms, bytes) of each GroupedLinear's three casts
_COPY_GBPS = []  # a bf16 device copy's GB/s (read + write), measured once: casts' % of it


def copy_gbps() -> float:
    if not _COPY_GBPS:
        src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src))
        _COPY_GBPS.append(4 * src.numel() / ms / 1e6)
        print({"stage": "bf16 copy 512 MiB (read + write)", "ms": round(ms, 4),
               "gbps": round(_COPY_GBPS[0], 1)}, flush=True)
    return _COPY_GBPS[0]


def _row(stage, ms, flops=None, nbytes=None, **extra):
    row = {"stage": stage, "ms": round(ms, 4)}
    if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
    if nbytes:
        row["gbps"] = round(nbytes / ms / 1e6, 1)
        row["pct_of_copy"] = round(100 * row["gbps"] / copy_gbps(), 1)
    row.update(extra)
    print(row, flush=True)
    return row


def _try(stage, fn, flops=None, nbytes=None):
    try:
        fn()
        return _row(stage, time_ms(fn), flops, nbytes)
    except Exception as exc:  # a missing op or an unsupported layout is a row, not a crash
        print({"stage": stage, "error": repr(exc)[:300]}, flush=True)
        return None


def _gemm_stages(tag, m_splits, k, n, sweep, gemm_check=True):
    dev = "cuda"
    g = len(m_splits)
    m = sum(m_splits)
    offsets = make_offsets(m_splits, dev)
    ends = offsets[0, 1:].contiguous()
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    one = torch.ones(2 * g + 1, device=dev)
    amax = torch.zeros(2 * g + 1, device=dev)
    gemm_flops = 2 * m * n * k
    eq_offsets = make_offsets([n] * g, dev)

    # grouped casts (bytes: bf16 read once + fp8 data + fp8 transpose)
    def cast_x():
        return kg.grouped_cast_transpose(x, offsets, one[:g], amax[:g], E4M3,
                                         write_transpose=True, m_splits=m_splits)

    def cast_w():
        return kg.grouped_cast_transpose(w.view(g * n, k), eq_offsets, one[:g], amax[:g], E4M3,
                                         write_transpose=True, m_splits=[n] * g)

    def cast_dy():
        return kg.grouped_cast_transpose(dy, offsets, one[:g], amax[:g], E5M2,
                                         write_transpose=True, m_splits=m_splits)
    casts = [_try(f"{tag} cast input e4m3 +T", cast_x, nbytes=4 * m * k),
             _try(f"{tag} cast weight e4m3 +T", cast_w, nbytes=4 * g * n * k),
             _try(f"{tag} cast grad_output e5m2 +T", cast_dy, nbytes=4 * m * n)]
    if all(casts):  # the three casts one GroupedLinear makes per step
        nbytes = 4 * (m * k + g * n * k + m * n)
        ms = sum(r["ms"] for r in casts)
        _CAST_STEP.append((ms, nbytes))
        _row(f"{tag} casts per step (input, weight, grad_output)", ms, nbytes=nbytes,
             floor_ms=round(nbytes / copy_gbps() / 1e6, 4))
    if tag == "fc1":  # the grouped cast's tiles (BLOCK_M, BLOCK_N, num_warps, COLS)
        saved = kg.CAST_CONFIG
        for cfg in [(64, 128, 8, 4), (32, 128, 4, 1), (64, 128, 4, 1), (128, 128, 8, 1),
                    (64, 256, 8, 1)]:
            kg.CAST_CONFIG = cfg
            _try(f"{tag} sweep cast weight e4m3 +T {cfg}", cast_w, nbytes=4 * g * n * k)
        kg.CAST_CONFIG = saved
    _try(f"{tag} amax weight (current scaling's extra pass)",
         lambda: kg.grouped_amax_into(w.view(g * n, k), eq_offsets, amax[:g]),
         nbytes=2 * g * n * k)
    x8, x8_t, x_si = cast_x()
    w8, w8_t, w_si = cast_w()
    w8, w8_t = w8.view(g, n, k), w8_t.view(g, k, n)
    dy8, dy8_t, dy_si = cast_dy()

    # tritium's Triton grouped GEMMs: the default configs, then their per-group TMA walk
    def fprop(cfg=None):
        return kg.grouped_fp8_gemm_tn(x8, w8, x_si, w_si, offsets, torch.bfloat16, None, True,
                                      m_splits=m_splits, config=cfg)

    def dgrad(cfg=None):
        return kg.grouped_fp8_gemm_tn(dy8, w8_t, dy_si, w_si, offsets, torch.bfloat16, None,
                                      False, m_splits=m_splits, config=cfg)

    def wgrad(cfg=None):
        return kg.grouped_fp8_gemm_wgrad(dy8_t, x8_t, dy_si, x_si, offsets, n, k,
                                         torch.bfloat16, config=cfg)
    gemms = {"fprop (fast accum)": (fprop, kg.CONFIGS["fast"]),
             "dgrad (precise)": (dgrad, kg.CONFIGS["precise"]),
             "wgrad (precise)": (wgrad, kg.CONFIGS["wgrad"])}
    for name, (fn, cfg) in gemms.items():
        for variant in kg.VARIANTS:
            c = (*cfg[:6], variant)
            _try(f"{tag} triton {name} {c}", lambda fn=fn, c=c: fn(c), gemm_flops)
    if gemm_check:  # the TMA walks give the flat walks' values
        for name, (fn, cfg) in gemms.items():
            ref = fn((*cfg[:6], "flat")).float()
            for variant in ("tma", "tma_flat"):
                try:
                    err = (fn((*cfg[:6], variant)).float() - ref).abs().max().item()
                    print({"stage": f"{tag} check {name} {variant} vs flat",
                           "max_abs_diff": err, "ref_max": ref.abs().max().item()}, flush=True)
                except Exception as exc:
                    print({"stage": f"{tag} check {name} {variant}", "error": repr(exc)[:300]})

    # the same GEMMs as one cuBLASLt call per group (tritium.ops.grouped_gemm: the default for
    # dgrad and wgrad)
    loops = {
        "fprop (fast accum)": lambda: og.cublas_grouped_fp8_gemm_tn(
            x8, w8, x_si, w_si, offsets, torch.bfloat16, None, True, m_splits=m_splits),
        "dgrad (precise)": lambda: og.cublas_grouped_fp8_gemm_tn(
            dy8, w8_t, dy_si, w_si, offsets, torch.bfloat16, None, False, m_splits=m_splits),
        "wgrad (precise)": lambda: og.cublas_grouped_fp8_gemm_wgrad(
            dy8_t, x8_t, dy_si, x_si, offsets, n, k, torch.bfloat16, m_splits=m_splits)}
    for name, fn in loops.items():
        _try(f"{tag} cublas per group {name}", fn, gemm_flops)

    # bf16 torch._grouped_mm counterparts
    gmm = getattr(torch, "_grouped_mm", None)
    if gmm is not None:
        w_t = w.transpose(-2, -1)
        _try(f"{tag} bf16 _grouped_mm fprop", lambda: gmm(x, w_t, ends), gemm_flops)
        _try(f"{tag} bf16 _grouped_mm dgrad", lambda: gmm(dy, w, ends), gemm_flops)
        _try(f"{tag} bf16 _grouped_mm wgrad", lambda: gmm(dy.t(), x, ends), gemm_flops)

    # torch._scaled_grouped_mm (e4m3 operands only): rowwise scales from per-group ones
    sgmm = getattr(torch, "_scaled_grouped_mm", None)
    if sgmm is not None:
        rows_g = torch.repeat_interleave(torch.arange(g, device=dev),
                                         torch.tensor(m_splits, device=dev))
        sa = x_si[rows_g].contiguous()
        sb = w_si[:, None].expand(g, n).contiguous()
        _try(f"{tag} _scaled_grouped_mm fprop (fast accum)",
             lambda: sgmm(x8, w8.transpose(-2, -1), sa, sb, ends, out_dtype=torch.bfloat16,
                          use_fast_accum=True), gemm_flops)
        dy8e, _, dye_si = kg.grouped_cast_transpose(dy, offsets, one[:g], amax[:g], E4M3,
                                                    m_splits=m_splits)
        sd = dye_si[rows_g].contiguous()
        sbk = w_si[:, None].expand(g, k).contiguous()
        _try(f"{tag} _scaled_grouped_mm dgrad (e4m3 dy, precise)",
             lambda: sgmm(dy8e, w8_t.transpose(-2, -1), sd, sbk, ends,
                          out_dtype=torch.bfloat16, use_fast_accum=False), gemm_flops)
        # wgrad: 2D x 2D with offsets along the reduction; whole-matrix transposes
        dyt = dy8e.t().contiguous()  # [N, M]
        xt_cm = x8.t().contiguous().t()  # [M, K] column-major
        swa = dye_si[:, None].expand(g, n).reshape(-1).contiguous()
        swb = x_si[:, None].expand(g, k).reshape(-1).contiguous()
        _try(f"{tag} _scaled_grouped_mm wgrad (precise)",
             lambda: sgmm(dyt, xt_cm, swa, swb, ends, out_dtype=torch.bfloat16,
                          use_fast_accum=False), gemm_flops)

    if sweep:
        sweeps = {
            "fprop": (fprop, [(128, 256, 64, 8, 8, 4, "tma"), (256, 128, 128, 8, 8, 3, "tma"),
                              (128, 128, 128, 8, 4, 4, "tma"), (128, 256, 128, 16, 8, 3, "tma"),
                              (128, 256, 128, 4, 8, 3, "tma"), (128, 256, 128, 8, 8, 3, "flat"),
                              (128, 128, 128, 8, 8, 4, "tma_flat")]),
            "dgrad": (dgrad, [(128, 256, 128, 8, 8, 3, "tma"), (128, 128, 128, 8, 4, 4, "tma"),
                              (128, 128, 128, 8, 8, 4, "tma"), (256, 128, 64, 8, 8, 4, "tma"),
                              (256, 128, 128, 16, 8, 3, "tma")]),
            "wgrad": (wgrad, [(128, 128, 128, 8, 4, 4, "tma"), (128, 256, 128, 8, 8, 3, "tma"),
                              (256, 128, 128, 8, 8, 3, "tma"), (128, 256, 64, 8, 8, 4, "tma"),
                              (128, 128, 64, 8, 4, 5, "tma"), (128, 128, 128, 16, 8, 4, "tma"),
                              (128, 128, 128, 8, 8, 4, "tma_flat")]),
        }
        for name, (fn, cfgs) in sweeps.items():
            for cfg in cfgs:
                _try(f"{tag} sweep {name} {cfg}", lambda fn=fn, cfg=cfg: fn(cfg), gemm_flops)
    return x8


def _activation_stages(m, f):
    h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * (2 * m * f + m * f)  # fwd: read 2F, write F (bwd reads 3F, writes 2F)

    def tri():
        h.grad = None
        activation(h, "swiglu").backward(dout)

    def plain():
        h.grad = None
        gate, up = h.chunk(2, -1)
        (F.silu(gate) * up).backward(dout)
    _try("swiglu fwd+bwd tritium", tri, nbytes=nbytes * 8 // 3)
    _try("swiglu fwd+bwd plain torch", plain, nbytes=nbytes * 8 // 3)


def _profile_step(module, x, dy, ctx):
    from torch.profiler import ProfilerActivity, profile

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with ctx():
            out = module(x)
        out.backward(dy)
    step(), step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25,
                                    max_name_column_width=70), flush=True)
    # host syncs in the step: cudaStreamSynchronize / cudaMemcpy / cudaDeviceSynchronize calls
    syncs = {e.key: e.count // 3 for e in prof.key_averages()
             if "Synchronize" in e.key or e.key in ("cudaMemcpy", "aten::item",
                                                      "aten::_local_scalar_dense")}
    print({"host syncs per step": syncs}, flush=True)


def run_stages(experts_module_factory, sweep: bool) -> None:
    """experts_module_factory() -> (module, x, dy, fp8 ctx) of bench_moe's experts case."""
    g, rows, h, f = 8, 2048, 4096, 14336
    splits = [rows] * g
    print(f"== stages: {g} experts x {rows} rows, H{h} F{f} ==", flush=True)
    _gemm_stages("fc1", splits, h, 2 * f, sweep)
    _gemm_stages("fc2", splits, f, h, sweep)
    if len(_CAST_STEP) == 2:  # fc1's and fc2's: the 6 casts of an experts step
        ms, nbytes = (sum(v) for v in zip(*_CAST_STEP))
        _row("all 6 casts of an experts step", ms, nbytes=nbytes,
             floor_ms=round(nbytes / copy_gbps() / 1e6, 4))
    _activation_stages(g * rows, f)
    module, x, dy, ctx = experts_module_factory()
    print("(the FP8 steps below cast the weights every step: no is_first_microbatch, no "
          "weight caching)", flush=True)

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with ctx():
            out = module(x)
        out.backward(dy)
    saved = dict(kg.CONFIGS)
    flops = 18 * g * rows * h * f
    _try("experts fwd+bwd fp8 delayed, default GEMM configs "
         f"{ {key: cfg[6] for key, cfg in saved.items()} }", step, flops)
    for variant in kg.VARIANTS:  # the whole experts step with each tile walk
        kg.CONFIGS.update({key: (*cfg[:6], variant) for key, cfg in saved.items()})
        _try(f"experts fwd+bwd fp8 delayed, GEMMs {variant}", step, flops)
    kg.CONFIGS.update(saved)
    print("== profile: tritium GroupedLinear fp8 delayed, experts fwd+bwd (3 steps) ==",
          flush=True)
    _profile_step(module, x, dy, ctx)
