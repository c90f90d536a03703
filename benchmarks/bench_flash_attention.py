"""tritium's Triton flash attention (tritium/kernels/flash_attention.py) vs SDPA cuDNN, one GPU.

Cases (issue 26): B4 H32 S4096 D128 bf16, causal and no mask, MHA and GQA-8 (8 kv heads), fwd and
fwd+bwd. Variants: "sdpa cudnn" (the baseline; GQA through enable_gqa, or where this torch's cuDNN
path refuses it, on K/V repeated to 32 heads before the timed region: row field kv_repeated),
"tritium flash nosplit" (the speed mode: P / dS rounded once to bf16 as cuDNN does, out and grads in
bf16 like SDPA's; on sm90 it runs the Gluon kernels (forward and backward) of
tritium/kernels/flash_attention_sm90{,_bwd,_bwd_fused}.py, configs "sm90"), "tritium flash split"
(the exact mode context parallelism runs: head/tail split of P / dS, fp32 out and grads), and the
forward alone of FP8 attention (recipe fp8_dpa, issue 26's target >= 1.3x cuDNN's bf16 forward):
"tritium fp8 kernel" (the FP8 flash forward on q/k/v already in E4M3), "tritium fp8 layer" (with the
per-tensor current-scaling quantization of q, k, v that DotProductAttention runs first: an amax
pass, then the cast), "tritium fp8 layer, delayed" (the delayed-scaling cast, TE's fp8_dpa recipe:
the scales from a history, the amaxes recorded in the cast's own pass) and "tritium fp8 layer, mha"
(that, with fp8_mha's E4M3 out and its amax written by the epilogue too); their err_vs_cudnn
compares out only (FP8's error: docs/numerics.md). TFLOP/s count useful FLOPs (causal half; fwd+bwd
= 3.5x fwd). Each tritium row also records its configs and err_vs_cudnn: max |ours - cuDNN| / max
|cuDNN| over the first block's out and dq (bf16 rounding level, ~1e-2 at most; a wrong config shows
here). The two comparisons issue 26 sets targets on (the speed mode's fwd+bwd, the FP8 kernel's
forward, each against cuDNN's) are also timed in PAIR_ROUNDS alternating rounds at the B4 H32
shapes, and those rows carry `paired_speedup`, the median of the rounds' own ratios
(`harness.paired_speedups`; the GPU's clock drifts between calls: cuDNN's causal forward read
0.91-1.05 ms across one process on an H200), which the targets read.

--seq adds B1 H12 D128 causal cases at those lengths and --cp the blocks one rank computes in a
cp=2 causal p2p ring at S=32768 (a causal [L, L] block and a no-mask [L/2, L] block, L=16384),
the CP exact mode's numbers.

--window W adds B1 H32 KV8 S16384 D128 causal with a sliding window of W keys and --varlen
packed sequences (thd: 16 of 512..4096 tokens, H32 KV8 D128 causal), both through
DotProductAttention: "tritium flash nosplit" is backend="triton" (its band / varlen path),
"flash window" / "flash varlen" backend="flash" (FlashAttention-2 in torch, the kernel auto
takes for them on Hopper), and "sdpa cudnn" the cuDNN op: for the window case at full causal
(cuDNN takes no window: the dense cost the window saves), for varlen one call per sequence
(what the cudnn backend does with thd). TFLOP/s count the visible pairs.

--sweep first times a grid of configs of each kernel (fwd; dk/dv with the dq kernel, or with
atomic dq alone; dq) for the speed mode, then a smaller one for the split mode, at the issue's
shape (MHA, causal + no mask summed; a candidate off cuDNN's results is not chosen), prints each
and the best per kernel (as --cfg arguments), applies the best and then runs the table: one
command finds the configs and shows what they give (sized for ~8 minutes on an H200).
--sweep-fp8 does the same for the FP8 forward alone (kind fwd_fp8, E4M3 q/k/v with V
keys-contiguous as the layer passes it; off cuDNN's bf16 out by more than FP8's error: out).

    python benchmarks/bench_flash_attention.py                  # the table (JSON to $OUT)
    python benchmarks/bench_flash_attention.py --sweep          # sweep, then the table
    python benchmarks/bench_flash_attention.py --sweep nosplit  # the speed mode's sweep alone
    python benchmarks/bench_flash_attention.py --kernels [--cp]  # the sm90 Gluon kernels alone
    python benchmarks/bench_flash_attention.py --kernels --once  # each launched once (ncu)
    python benchmarks/bench_flash_attention.py --cfg fwd=128,128,8,3,1,1 --cfg split:dq=128,64,8,3
      (kind=BLOCK_M,BLOCK_N,warps,stages[,tma[,ws[,atomic_dq]]], D=128, nosplit unless split:;
       kind fwd_fp8: the FP8 forward, both masks, e.g. --cfg fwd_fp8=128,128,4,3,1;
       causal:fwd_fp8=...: its causal launches alone)
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, interleaved_rounds, median_ms, paired_speedups, settle_gpu, \
    time_ms  # noqa: E402

from tritium.kernels import flash_attention as FA  # noqa: E402

D = 128
Cfg = FA.Cfg


def _sdpa(q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kw = dict(enable_gqa=True) if gqa else {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **kw)
    return o.transpose(1, 2)


def _tensors(b, s_q, s_kv, h, h_kv, g):
    def mk(s, heads):
        return torch.randn(b, s, heads, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(s_q, h), mk(s_kv, h_kv), mk(s_kv, h_kv), mk(s_q, h)


def _sdpa_steps(blocks):
    """(fwd, fwd_bwd, kv_repeated) for SDPA cuDNN over the blocks."""
    leaves = [[t.detach().requires_grad_() for t in blk[:3]] + list(blk[3:]) for blk in blocks]
    repeated = False
    for i, (q, k, v, do, c) in enumerate(leaves):
        if k.shape[2] != q.shape[2]:
            try:
                _sdpa(q, k, v, c, True).backward(do)
            except RuntimeError:  # no GQA in this cuDNN path: K/V repeated, outside the timing
                rep = q.shape[2] // k.shape[2]
                k, v = (t.detach().repeat_interleave(rep, 2).requires_grad_() for t in (k, v))
                leaves[i] = [q, k, v, do, c]
                repeated = True

    def fwd():
        with torch.no_grad():
            for q, k, v, _, c in leaves:
                _sdpa(q, k, v, c, k.shape[2] != q.shape[2])

    def fwd_bwd():
        for q, k, v, do, c in leaves:
            for t in (q, k, v):
                t.grad = None
            _sdpa(q, k, v, c, k.shape[2] != q.shape[2]).backward(do)
    return fwd, fwd_bwd, repeated


def _steps(blocks, variant):
    """blocks: [(q, k, v, dout, causal)] -> (fwd, fwd_bwd, extra row fields) over all blocks."""
    if variant == "sdpa cudnn":
        fwd, fwd_bwd, repeated = _sdpa_steps(blocks)
        return fwd, fwd_bwd, ({"kv_repeated": True} if repeated else {})
    if " fp8 " in variant:
        return _fp8_steps(blocks, variant)
    split = variant.endswith(" split")
    scale = 1 / math.sqrt(D)
    dt = None if split else blocks[0][0].dtype  # the speed mode: out / grads like SDPA's
    configs = " ".join(_cfg_arg(kind, FA.GPU_CFG[kind][(D, split)], split)[6:]
                       for kind in ("fwd", "dkdv", "dq"))
    if not split and FA.sm90.applies(*blocks[0][:3], dt):
        configs = "sm90"   # the Gluon kernels run, forward and backward

    def fwd():
        for q, k, v, _, c in blocks:
            FA.flash_attention_fwd(q, k, v, c, scale, split=split, out_dtype=dt)

    def fwd_bwd():
        for q, k, v, do, c in blocks:
            out, lse = FA.flash_attention_fwd(q, k, v, c, scale, split=split, out_dtype=dt)
            FA.flash_attention_bwd(do, q, k, v, out, lse, c, scale, split=split, grad_dtype=dt)

    # the first block's out and dq against cuDNN's (relative to their max): a wrong config
    # must not pass as a fast one
    q, k, v, do, c = blocks[0]
    out, lse = FA.flash_attention_fwd(q, k, v, c, scale, split=split, out_dtype=dt)
    dq = FA.flash_attention_bwd(do, q, k, v, out, lse, c, scale, split=split, grad_dtype=dt)[0]
    err = _rel_err((out, dq), _sdpa_out_dq(*blocks[0]))
    return fwd, fwd_bwd, {"configs": configs, "err_vs_cudnn": float(f"{err:.2e}")}


def _fp8_plan(delayed: bool, blocks):
    """The FP8 attention plan of a layer call: current scaling, or delayed scaling whose q/k/v
    state has seen the first block once (its scales those of real amaxes)."""
    from tritium.attention import fp8 as F
    from tritium.fp8 import recipe
    if not delayed:
        return F.FP8AttnPlan(recipe.Float8CurrentScaling(fp8_dpa=True), None, False)
    rec = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=16, amax_compute_algo="max")
    state = F.new_state(torch.nn.Module(), rec, blocks[0][0].device)
    plan = F.FP8AttnPlan(rec, state, False)
    F.record_amaxes(plan, *blocks[0][:3])
    state.update()
    return plan


def _fp8_steps(blocks, variant):
    """FP8 attention's forward (no fwd_bwd: the backward is the bf16 one, timed above)."""
    from tritium.attention import fp8 as F
    mha = variant.endswith(", mha")
    plan = _fp8_plan(variant.endswith(", delayed") or mha, blocks)
    scale, layer = 1 / math.sqrt(D), " layer" in variant
    # fp8_mha: the E4M3 out too (a delayed O scale, its amax recorded), beside the bf16 out
    # a backward reads, as a training call writes them
    o8 = FA.FP8Out(torch.full((1,), 100.0, device=blocks[0][0].device),
                   torch.zeros(1, device=blocks[0][0].device)) if mha else None

    def kernel_args(q, k, v):   # as the layer calls the kernel: V with the keys contiguous
        q8, k8, _, descale, v8_t = F.quantize(plan, q, k, v, v_keys_contiguous=True)
        return q8, k8, v8_t, descale
    quantized = [(kernel_args(q, k, v), c) for q, k, v, _, c in blocks]

    def one(q, k, v, c):
        return FA.flash_attention_fp8_fwd(*kernel_args(q, k, v), c, scale,
                                          out_dtype=torch.bfloat16, fp8_out=o8)[0]

    def fwd():
        if layer:
            for q, k, v, _, c in blocks:
                one(q, k, v, c)
        else:
            for qkv8, c in quantized:
                FA.flash_attention_fp8_fwd(*qkv8, c, scale, out_dtype=torch.bfloat16)

    q, k, v, do, c = blocks[0]
    err = _rel_err((one(q, k, v, c),), _sdpa_out_dq(*blocks[0])[:1])
    return fwd, None, {"configs": " ".join(
                           _cfg_arg("fwd_fp8", FA.GPU_CFG["fwd_fp8"][(D, m)], m)[6:]
                           for m in (True, False)),
                       "err_vs_cudnn": float(f"{err:.2e}")}


def _sdpa_out_dq(q, k, v, do, causal):
    """SDPA cuDNN's (out, dq) for one block (K/V repeated where its GQA path refuses)."""
    q = q.detach().requires_grad_()
    try:
        o = _sdpa(q, k, v, causal, k.shape[2] != q.shape[2])
    except RuntimeError:
        rep = q.shape[2] // k.shape[2]
        o = _sdpa(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), causal, False)
    o.backward(do)
    return o.detach(), q.grad


def _cases(args, g):
    b, h, s = 4, 32, 4096
    for h_kv in (h, 8):
        for causal in (True, False):
            name = f"B{b} H{h}{'' if h_kv == h else f' KV{h_kv}'} S{s} D{D} " + \
                ("causal" if causal else "nomask")
            yield name, [(*_tensors(b, s, s, h, h_kv, g), causal)], FA.flops(b, s, s, h, D, causal)
    for s in args.seq:
        yield f"B1 H12 S{s} D{D} causal", [(*_tensors(1, s, s, 12, 12, g), True)], \
            FA.flops(1, s, s, 12, D, True)
    if args.cp:
        s, L = 32768, 16384
        q, k, v, do = _tensors(1, L, L, 12, 12, g)
        # ring step 1 on rank 0: second half of q vs all KV (rank 1: all q vs the first half of
        # KV, same FLOPs); timed as rank 0's blocks
        blocks = [(q, k, v, do, True), (q[:, L // 2:], k, v, do[:, L // 2:], False)]
        fl = FA.flops(1, L, L, 12, D, True) + FA.flops(1, L // 2, L, 12, D, False)
        yield f"cp2 rank S{s} D{D} causal", blocks, fl


VARIANTS = ["sdpa cudnn", "tritium flash nosplit", "tritium flash split", "tritium fp8 kernel",
            "tritium fp8 layer", "tritium fp8 layer, delayed", "tritium fp8 layer, mha"]
# (mode, tritium variant) timed against cuDNN in alternating rounds (the targets' comparisons)
PAIRED = (("fwd+bwd", "tritium flash nosplit"), ("fwd", "tritium fp8 kernel"))
PAIR_ROUNDS = 7
LAYER_HEADS, WINDOW_SEQ, VARLEN_LENGTHS = (32, 8), 16384, (512, 4097, (16,))
LAYER_BACKENDS = {"sdpa cudnn": "cudnn", "flash window": "flash", "flash varlen": "flash",
                  "tritium flash nosplit": "triton"}


def _layer_cases(args, g):
    """(case, variants, kwargs of dot_product_attention, q, k, v, dout, flops): --window and
    --varlen, through the attention layer's backends."""
    h, h_kv = LAYER_HEADS
    if args.window:
        s, w = WINDOW_SEQ, args.window
        q, k, v, do = _tensors(1, s, s, h, h_kv, g)
        pairs = sum(min(i + 1, w + 1) for i in range(s))
        yield (f"B1 H{h} KV{h_kv} S{s} D{D} causal window {w} (cudnn: full causal)",
               ["sdpa cudnn", "flash window", "tritium flash nosplit"],
               dict(qkv_format="bshd", attn_mask_type="causal", window_size=(w, 0)),
               q, k, v, do, 4.0 * h * pairs * D)
    if args.varlen:
        lens = torch.randint(*VARLEN_LENGTHS, generator=torch.Generator().manual_seed(1))
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        t, longest = int(lens.sum()), int(lens.max())
        q, k, v, do = (x[0] for x in _tensors(1, t, t, h, h_kv, g))
        cu = cu.to(q.device)
        pairs = sum(n * (n + 1) // 2 for n in lens.tolist())
        yield (f"thd {len(lens)} seqs {t} tokens H{h} KV{h_kv} D{D} causal",
               ["sdpa cudnn", "flash varlen", "tritium flash nosplit"],
               dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                    cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest),
               q, k, v, do, 4.0 * h * pairs * D)


def _layer_steps(variant, kw, q, k, v, do):
    """(fwd, fwd_bwd) of dot_product_attention on the variant's backend; the window case's
    cuDNN baseline drops the window (full causal)."""
    from tritium.attention import dot_product_attention
    backend = LAYER_BACKENDS[variant]
    if backend == "cudnn" and "window_size" in kw:
        kw = {**kw, "window_size": None}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    flat = do.flatten(-2)

    def fwd():
        with torch.no_grad():
            dot_product_attention(*leaves, backend=backend, **kw)

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        dot_product_attention(*leaves, backend=backend, **kw).backward(flat)
    return fwd, fwd_bwd


def _paired(rows, case, steps):
    """PAIRED's comparisons in alternating rounds: paired_speedup into the tritium rows."""
    for mode, variant in PAIRED:
        fns = {name: steps[(name, mode)] for name in ("sdpa cudnn", variant)
               if steps.get((name, mode)) is not None}
        if len(fns) < 2:
            continue
        ratio = paired_speedups(interleaved_rounds(fns, rounds=PAIR_ROUNDS), "sdpa cudnn")
        for row in rows:
            if row["case"] == f"{case} {mode}" and row["variant"] == variant:
                row.update(paired_speedup=ratio[variant], paired_rounds=PAIR_ROUNDS)
                print(row, flush=True)


def _run(rows, args):
    g = torch.Generator(device="cuda").manual_seed(0)
    for case, blocks, flops in _cases(args, g):
        steps = {}  # (variant, mode) -> step, for the paired rounds
        for variant in VARIANTS:
            for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                row = {"case": f"{case} {mode}", "variant": variant}
                if mode != "fwd" and " fp8 " in variant:
                    continue  # FP8 attention: forward only (its backward is the bf16 one)
                try:
                    fwd, fwd_bwd, extra = _steps(blocks, variant)
                    step = fwd if mode == "fwd" else fwd_bwd
                    step()
                    ms = time_ms(step)
                    row.update(ms=round(ms, 4), tflops=round(mult * flops / ms / 1e9, 1), **extra)
                    steps[(variant, mode)] = step
                except Exception as exc:  # record and go on
                    row["error"] = repr(exc)[:300]
                rows.append(row)
                print(row, flush=True)
        if case.startswith("B4 H32"):
            _paired(rows, case, steps)
        del blocks, steps
        torch.cuda.empty_cache()
    for case, variants, kw, q, k, v, do, flops in _layer_cases(args, g):
        for variant in variants:
            for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                row = {"case": f"{case} {mode}", "variant": variant}
                try:
                    step = _layer_steps(variant, kw, q, k, v, do)[mode != "fwd"]
                    step()
                    ms = time_ms(step)
                    row.update(ms=round(ms, 4), tflops=round(mult * flops / ms / 1e9, 1))
                except Exception as exc:  # record and go on
                    row["error"] = repr(exc)[:300]
                rows.append(row)
                print(row, flush=True)


def _qualifier(kind: str) -> str:
    """What the second half of GPU_CFG's key is: split for the 16-bit kernels, causal for the
    FP8 forward (its tiles chosen per mask)."""
    return "causal" if kind == "fwd_fp8" else "split"


def _parse_cfg(spec: str):
    """"[split: | causal:]kind=bm,bn,warps,stages[,tma[,ws[,atomic_dq]]]" -> (kind,
    GPU_CFG keys, Cfg): D=128's (split / causal, as prefixed); fwd_fp8 unprefixed: both masks."""
    kind, _, vals = spec.partition("=")
    qual, _, name = kind.rpartition(":")
    nums = [int(x) for x in vals.split(",")]
    if name not in FA.GPU_CFG or qual not in ("", _qualifier(name)) or not 4 <= len(nums) <= 7:
        raise SystemExit(f"--cfg {spec!r}: want [split:]kind=BLOCK_M,BLOCK_N,warps,stages"
                         f"[,tma[,ws[,atomic_dq]]] with kind in {sorted(FA.GPU_CFG)} "
                         "(causal:fwd_fp8=...: the causal FP8 forward)")
    keys = [(D, bool(qual))] if qual or name != "fwd_fp8" else [(D, True), (D, False)]
    return name, keys, Cfg(*nums[:4], *(bool(x) for x in nums[4:]))


def _cfg_arg(kind, cfg, flag=False):
    """cfg as the --cfg argument that sets it (flag: split, or causal for fwd_fp8)."""
    flags = [int(cfg.tma), int(cfg.ws), int(cfg.atomic_dq)]
    while flags and not flags[-1]:
        flags.pop()
    prefix = f"{_qualifier(kind)}:" if flag else ""
    return f"--cfg {prefix}{kind}=" + ",".join(map(str, [*cfg[:4], *flags]))


# speed mode (split=False), D=128: candidates around the defaults (Cfg(block_m, block_n, warps,
# stages, tma, ws, atomic_dq)). 8 warps only where each product has >= 128 output rows (forward
# and dq: block_m, dk/dv: block_n; see GPU_CFG's note); pointer loads (tma False) once per kernel;
# none above the sm90's 227 KB of shared memory (scripts/flash_regs.py).
T = True
SWEEP_FWD = [Cfg(128, 128, 8, 3, T), Cfg(128, 64, 8, 3, T), Cfg(64, 64, 4, 3, T),
             Cfg(128, 128, 8, 3, T, T), Cfg(128, 128, 8, 3)]
SWEEP_DKDV = [Cfg(64, 64, 4, 2, T), Cfg(64, 64, 4, 3, T), Cfg(32, 64, 4, 3, T),
              Cfg(64, 128, 8, 4, T), Cfg(64, 64, 4, 2)]
SWEEP_ATOMIC = [Cfg(64, 128, 8, 2, T, atomic_dq=T)]
SWEEP_DQ = [Cfg(128, 64, 8, 3, T), Cfg(128, 64, 8, 4, T), Cfg(128, 64, 8, 5, T),
            Cfg(128, 128, 8, 2, T), Cfg(64, 64, 4, 3, T), Cfg(128, 64, 8, 3)]
# split mode (context parallelism's exact mode): the TMA defaults (first) against pointer loads
# (ptxas: the pointer forward spills 556 bytes, dk/dv 1308) and other tiles; no atomic dq (exact
# mode's sums stay in a fixed order)
SWEEPS = {
    False: dict(fwd=SWEEP_FWD, dkdv=SWEEP_DKDV, dq=SWEEP_DQ, atomic=SWEEP_ATOMIC),
    True: dict(fwd=[Cfg(64, 64, 4, 3, T), Cfg(64, 64, 4, 3), Cfg(128, 64, 8, 3, T),
                    Cfg(128, 128, 8, 3, T)],
               dkdv=[Cfg(64, 64, 4, 2, T), Cfg(64, 64, 4, 2), Cfg(64, 64, 4, 3, T),
                     Cfg(32, 64, 4, 2, T)],
               dq=[Cfg(128, 64, 8, 4, T), Cfg(128, 64, 8, 3), Cfg(128, 64, 8, 3, T),
                   Cfg(64, 64, 4, 3, T)],
               atomic=[])}


# the FP8 forward, D=128: around the H100 sweeps' best (no mask 128 x 128, causal 64 x 128; 4
# warps, 3 stages). Dropped after the sweeps of 2026-11-28: 4 stages at 128 x 128 and 64 x 128
# (1.3-1.6x slower), 128 x 128 at 8 warps, with or without warp specialization (0.84 + 1.52 ms
# against 0.83 + 1.32), 256 x 128, pointer loads, grouped launch orders (within 3%); warp
# specialization at 4 warps fails to compile
SWEEP_FP8 = [Cfg(128, 128, 4, 3, T), Cfg(64, 128, 4, 3, T), Cfg(128, 128, 4, 2, T),
             Cfg(64, 128, 4, 2, T), Cfg(128, 64, 4, 3, T), Cfg(64, 64, 4, 4, T)]


def _rel_err(got, want):
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
               for a, b in zip(got, want))


def _time_cfgs(kind, split, cands, run, ref, tol=2e-2):
    """Time run(causal) for each candidate of `kind` (causal + no mask summed) -> (ms, best).
    A candidate whose results are off SDPA's (`ref[causal]`) by more than `tol` (bf16's error;
    FP8's for the FP8 forward) is out. The FP8 forward (keyed by mask) takes the best no-mask
    config and the best causal one of the same block_n (`flash_attention._fp8_cfg`); its
    `best` is then None."""
    per_mask = kind == "fwd_fp8"
    keys = [(D, True), (D, False)] if per_mask else [(D, split)]
    keep = {key: FA.GPU_CFG[kind][key] for key in keys}
    timed = []  # (causal ms, no-mask ms, cfg)
    for cfg in cands:
        for key in keys:
            FA.GPU_CFG[kind][key] = cfg
        try:
            err = max(_rel_err(run(c), ref[c]) for c in (True, False))
            ms = [time_ms(lambda: run(c), warmup=10, rep=40) for c in (True, False)]
            line = f"causal {ms[0]:.3f} + nomask {ms[1]:.3f} = {sum(ms):.3f} ms, err {err:.1e}"
            if err < tol:
                timed.append((*ms, cfg))
            else:
                line += " WRONG (not chosen)"
        except Exception as exc:
            line = f"ERROR {exc!r}"[:160]
        print(f"  {kind} {tuple(cfg)}: {line}", flush=True)
    FA.GPU_CFG[kind].update(keep)
    if not timed:
        return math.inf, None
    if not per_mask:
        ms_c, ms_n, cfg = min(timed, key=lambda t: t[0] + t[1])
        FA.GPU_CFG[kind][keys[0]] = cfg
        return ms_c + ms_n, cfg
    _, ms_n, nomask = min(timed, key=lambda t: t[1])
    ms_c, _, causal = min((t for t in timed if t[2].block_n == nomask.block_n),
                          key=lambda t: t[0])
    FA.GPU_CFG[kind][(D, True)], FA.GPU_CFG[kind][(D, False)] = causal, nomask
    return ms_c + ms_n, None


def sweep(split: bool):
    """Each kernel's candidates at B4 H32 S4096 D128 bf16, MHA, in one mode; sets the best."""
    mode = "split" if split else "nosplit"
    cands = SWEEPS[split]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = _tensors(4, 4096, 4096, 32, 32, g)
    scale, dt = 1 / math.sqrt(D), (None if split else q.dtype)
    ref_fwd, ref_bwd = {}, {}
    for c in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = _sdpa(*leaves, c, False)
        o.backward(do)
        ref_fwd[c] = (o.detach(),)
        ref_bwd[c] = tuple(t.grad for t in leaves)
    outs = {c: FA.flash_attention_fwd(q, k, v, c, scale, split=split, out_dtype=dt)
            for c in (True, False)}

    def fwd(c):
        return FA.flash_attention_fwd(q, k, v, c, scale, split=split, out_dtype=dt)[:1]

    def bwd(c):
        return FA.flash_attention_bwd(do, q, k, v, *outs[c], c, scale, split=split,
                                      grad_dtype=dt)
    print(f"sweep {mode}: the Triton kernels' configs (the sm90 Gluon kernels off)", flush=True)
    enabled, FA.sm90.ENABLED = FA.sm90.ENABLED, False
    try:
        print(f"sweep {mode}: fwd", flush=True)
        f_ms, _ = _time_cfgs("fwd", split, cands["fwd"], fwd, ref_fwd)
        print(f"sweep {mode}: dkdv (+ delta + dq at its config)", flush=True)
        sep_ms, sep = _time_cfgs("dkdv", split, cands["dkdv"], bwd, ref_bwd)
        print(f"sweep {mode}: dq (+ delta + dkdv at the best above)", flush=True)
        sep_ms, _ = _time_cfgs("dq", split, cands["dq"], bwd, ref_bwd)
        at_ms = math.inf
        if cands["atomic"]:
            print(f"sweep {mode}: dkdv with atomic dq (+ delta, no dq kernel)", flush=True)
            at_ms, _ = _time_cfgs("dkdv", split, cands["atomic"], bwd, ref_bwd)
            if not at_ms < sep_ms and sep is not None:
                FA.GPU_CFG["dkdv"][(D, split)] = sep
    finally:
        FA.sm90.ENABLED = enabled
    print(f"best {mode}: fwd {f_ms:.3f} ms, bwd {min(sep_ms, at_ms):.3f} ms (separate dq "
          f"{sep_ms:.3f}, atomic dq {at_ms:.3f}), causal + nomask summed; as arguments:")
    print(" ".join(_cfg_arg(kind, FA.GPU_CFG[kind][(D, split)], split)
                   for kind in ("fwd", "dkdv", "dq")), flush=True)
    del q, k, v, do, outs, ref_fwd, ref_bwd
    torch.cuda.empty_cache()


def sweep_fp8():
    """The FP8 forward's candidates at B4 H32 S4096 D128 (E4M3 q/k/v from current scaling, V
    keys-contiguous, bf16 out); sets the best. Off cuDNN's bf16 out by > 2^-3 of its max: out
    (FP8's own error on these inputs measures 7.5e-2 for every config on an H100, 2026-11-27; a
    wrong tiling errs by O(1))."""
    from tritium.attention import fp8 as F
    from tritium.fp8 import recipe
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, _ = _tensors(4, 4096, 4096, 32, 32, g)
    plan = F.FP8AttnPlan(recipe.Float8CurrentScaling(fp8_dpa=True), None, False)
    q8, k8, _, descale, v8_t = F.quantize(plan, q, k, v, v_keys_contiguous=True)
    ref = {c: (_sdpa(q, k, v, c, False).detach(),) for c in (True, False)}

    def fwd(c):
        return FA.flash_attention_fp8_fwd(q8, k8, v8_t, descale, c, 1 / math.sqrt(D),
                                          out_dtype=torch.bfloat16)[:1]
    print("sweep fp8: fwd", flush=True)
    ms, _ = _time_cfgs("fwd_fp8", False, SWEEP_FP8, fwd, ref, tol=2.0 ** -3)
    print(f"best fp8: fwd {ms:.3f} ms, causal + nomask summed (each its own config); as "
          "arguments:")
    print(" ".join(_cfg_arg("fwd_fp8", FA.GPU_CFG["fwd_fp8"][(D, m)], m) for m in (True, False)),
          flush=True)
    del q, k, v, q8, k8, v8_t, ref
    torch.cuda.empty_cache()


def kernels(cp: bool = False, rounds: int = 5, once: bool = False):
    """--kernels: the Hopper Gluon kernels one by one at B4 H32 S4096 D128 (MHA, GQA-8; causal,
    no mask; with --cp also the blocks one cp=2 rank computes at S=32768, B1 H12: the causal
    16384 x 16384 square and the no-mask 8192 x 16384 / 16384 x 8192 ones) in `rounds`
    interleaved rounds (median ms printed, nothing recorded): the forward, the dQ and dK/dV
    kernels, the two-kernel backward, the fused one, cuDNN's forward and fwd+bwd. once (--once):
    each launched one time per case, untimed, for a profiler (`scripts/gpu_check.sh ncu`)."""
    from tritium.kernels import flash_attention_sm90 as sm90, flash_attention_sm90_bwd as two
    from tritium.kernels import flash_attention_sm90_bwd_fused as fused
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = 1 / math.sqrt(D)
    cases = [(4, 4096, 4096, 32, h_kv, causal) for h_kv in (32, 8) for causal in (True, False)]
    if cp:
        cases += [(1, 16384, 16384, 12, 12, True), (1, 8192, 16384, 12, 12, False),
                  (1, 16384, 8192, 12, 12, False)]
    for b, s_q, s_kv, h, h_kv, causal in cases:
        q, k, v, do = _tensors(b, s_q, s_kv, h, h_kv, g)
        if not sm90.applies(q, k, v, q.dtype):
            print("--kernels: the sm90 Gluon kernels do not apply on this GPU / Triton")
            return
        out, lse = sm90.flash_attention_fwd(q, k, v, causal, scale)
        delta = torch.empty_like(lse)
        two._dq(q, k, v, out, do, lse, delta, causal, scale, q.dtype)   # delta for _dkdv
        cudnn_fwd, cudnn_fwd_bwd, _ = _sdpa_steps([(q, k, v, do, causal)])
        fns = {
            "fwd": lambda: sm90.flash_attention_fwd(q, k, v, causal, scale),
            "dq (+delta)": lambda: two._dq(q, k, v, out, do, lse, delta, causal, scale, q.dtype),
            "dkdv": lambda: two._dkdv(q, k, v, do, lse, delta, causal, scale, q.dtype),
            "bwd two kernels": lambda: two.flash_attention_bwd(do, q, k, v, out, lse, causal,
                                                               scale),
            "cudnn fwd": cudnn_fwd, "cudnn fwd+bwd": cudnn_fwd_bwd}
        if fused.AVAILABLE:
            fns["bwd fused"] = lambda: fused.flash_attention_bwd(do, q, k, v, out, lse, causal,
                                                                 scale)
        heads = f"H{h}" + ("" if h_kv == h else f" KV{h_kv}")
        lengths = f"S{s_q}" if s_q == s_kv else f"S{s_q}x{s_kv}"
        case = f"B{b} {heads} {lengths} D128 " + ("causal" if causal else "nomask")
        if once:
            for name, fn in fns.items():
                if not name.startswith("cudnn"):
                    fn()
            torch.cuda.synchronize()
            print(f"{case}: launched " + ", ".join(n for n in fns if not n.startswith("cudnn")),
                  flush=True)
            continue
        ms = median_ms(interleaved_rounds(fns, rounds=rounds))
        print(case + ": " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), flush=True)
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[],
                    help="also B1 H12 D128 causal at these sequence lengths")
    ap.add_argument("--cp", action="store_true",
                    help="also one cp=2 rank's blocks at S=32768 (with --kernels: its shapes)")
    ap.add_argument("--window", type=int, default=0,
                    help="also B1 H32 KV8 S16384 causal with a sliding window of this many keys")
    ap.add_argument("--varlen", action="store_true",
                    help="also packed sequences (thd, 16 of 512..4096 tokens)")
    ap.add_argument("--cfg", action="append", default=[],
                    help="[split: | causal:]kind=BLOCK_M,BLOCK_N,warps,stages"
                         "[,tma[,ws[,atomic_dq]]] (kind: fwd, dkdv, dq, fwd_fp8; D=128)")
    ap.add_argument("--sweep", nargs="?", const="both", choices=("both", "nosplit", "split"),
                    help="sweep the configs first (both modes, or the one named)")
    ap.add_argument("--sweep-fp8", action="store_true",
                    help="sweep the FP8 forward's configs first")
    ap.add_argument("--kernels", action="store_true",
                    help="time the Hopper Gluon kernels one by one, then stop")
    ap.add_argument("--once", action="store_true",
                    help="with --kernels: launch each one time, untimed (for a profiler)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_flash_attention: needs a CUDA GPU; nothing timed")
    for spec in args.cfg:
        kind, keys, cfg = _parse_cfg(spec)
        for key in keys:
            FA.GPU_CFG[kind][key] = cfg
    settle_gpu()
    if args.kernels:
        return kernels(args.cp, once=args.once)
    for split in (False, True):
        if args.sweep in ("both", "split" if split else "nosplit"):
            sweep(split)
    if args.sweep_fp8:
        sweep_fp8()
    rows = []
    _run(rows, args)
    finish("flash_attention", rows, baseline="sdpa cudnn")


if __name__ == "__main__":
    main()
