"""Usage: python scripts/flash_regs.py [nosplit|split] [fwd|dkdv|dq ...]
       python scripts/flash_regs.py fp8
       python scripts/flash_regs.py sm90

Registers, spills and shared memory of the flash attention kernels (tritium/kernels/
flash_attention.py) for sm90, without a GPU: each candidate config of benchmarks/
bench_flash_attention.py's --sweep (and the current GPU_CFG entry) is compiled to PTX by Triton
(bf16, D=128, causal) and assembled by the wheel's ptxas with -v. A config that spills runs
slower on the GPU; one whose shared memory exceeds 227 KB does not launch. This is how the
speed-mode defaults in GPU_CFG were chosen before any GPU timing; the sweep has the last word.
"WGMMA SERIALIZED" after the spill count: ptxas issues each wgmma only once the previous one has
ended (its C7511 note: too few registers for the wgmma pipeline; the FP8 forward's 128 x 128
no-mask config, 2026-11-30).
Also prints whether Triton warp-specialized the forward's loop (a ttg.warp_specialize op) and
flags products whose output rows are fewer than the MMA layout's warps cover (8 warps on 64
rows: the second warpgroup repeats the first's wgmma).
`fp8`: the FP8 forward (E4M3 q/k/v, V keys-contiguous through TMA, bf16 out) at its GPU_CFG
entries and bench_flash_attention.py's --sweep-fp8 candidates, causal and no mask, with the same
figures plus the most wgmma groups any `wgmma.wait_group N` of the PTX leaves in flight (0:
every wait drains the tensor cores, so inside one program a block's softmax never overlaps a
product; what Triton 3.6 makes of this kernel, 2026-11-28, docs/attention.md); the GPU_CFG
entries also with fp8_mha's epilogue (the E4M3 out and its amax beside the bf16 out).
`sm90`: the Gluon kernels of tritium/kernels/flash_attention_sm90{,_bwd,_bwd_fused}.py (bf16,
D=128, GQA-4 descriptors, causal and no mask, 16-bit and fp32 outputs) at their module
constants: registers at launch (the partitions then move theirs with setmaxnreg), bytes
spilled, shared memory.
"""
from __future__ import annotations

import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import bench_flash_attention as B  # noqa: E402
from tritium.kernels import flash_attention as FA  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
KERNELS = {"fwd": FA._fwd_kernel, "dkdv": FA._dkdv_kernel, "dq": FA._dq_kernel}


def _signature(fn, cfg, split):
    out16 = "*fp32" if split else "*bf16"
    types = {"qk_scale": "fp32", "scale": "fp32", "o_ptr": out16, "dk_ptr": out16,
             "dv_ptr": out16, "dq_ptr": "*fp32" if fn is FA._dkdv_kernel else out16}
    for name, rows in (("q_src", cfg.block_m), ("k_src", cfg.block_n), ("v_src", cfg.block_n),
                       ("do_src", cfg.block_m)):
        types[name] = f"tensordesc<bf16[1, {rows}, {B.D}]>" if cfg.tma else "*bf16"
    return {p.name: "constexpr" if p.is_constexpr else
            types.get(p.name, "*fp32" if p.name.endswith("_ptr") else "i32") for p in fn.params}


def probe(kind, cfg, split):
    fn = KERNELS[kind]
    cx = dict(CAUSAL=True, SPLIT=split, PREC="tf32", D=B.D, BLOCK_M=cfg.block_m,
              BLOCK_N=cfg.block_n, TMA=cfg.tma)
    cx.update({"fwd": dict(WS=cfg.ws and cfg.tma), "dkdv": dict(ATOMIC_DQ=cfg.atomic_dq),
               "dq": {}}[kind])
    c = _compile(fn, _signature(fn, cfg, split), cx, cfg)
    if isinstance(c, str):
        return c
    regs, spill, serial = _ptxas(c.asm["ptx"])
    ttgir = c.asm["ttgir"]
    ws = ", warp-specialized" if "ttg.warp_specialize" in ttgir else ""
    return (f"{regs} registers, {spill} bytes spilled{serial}, {c.metadata.shared} bytes shared"
            f"{ws}{_repeated(ttgir)}")


def probe_fp8(cfg, causal: bool, fp8_out: bool = False) -> str:
    """probe() for the FP8 forward (kind fwd_fp8) at one mask; fp8_out: with fp8_mha's
    epilogue (the E4M3 out and its amax beside the bf16 out)."""
    fn, d = FA._fwd_kernel, B.D
    types = {"qk_scale": "fp32", "o_ptr": "*bf16", "descale_ptr": "*fp32", "o8_ptr": "*fp8e4nv",
             "q_src": f"tensordesc<fp8e4nv[1, {cfg.block_m}, {d}]>",
             "k_src": f"tensordesc<fp8e4nv[1, {cfg.block_n}, {d}]>",
             "v_src": f"tensordesc<fp8e4nv[1, 1, {d}, {cfg.block_n}]>"}
    sig = {p.name: "constexpr" if p.is_constexpr else
           types.get(p.name, "*fp32" if p.name.endswith("_ptr") else "i32") for p in fn.params}
    cx = dict(CAUSAL=causal, SPLIT=False, PREC="tf32", D=d, BLOCK_M=cfg.block_m,
              BLOCK_N=cfg.block_n, TMA=True, WS=cfg.ws, FP8=True, VT=True, O8=fp8_out,
              O8_AMAX=fp8_out)
    c = _compile(fn, sig, cx, cfg)
    if isinstance(c, str):
        return c
    ptx = c.asm["ptx"]
    regs, spill, serial = _ptxas(ptx)
    in_flight = max((int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)),
                    default=0)
    return (f"{regs} registers, {spill} bytes spilled{serial}, {c.metadata.shared} bytes "
            f"shared, wgmma groups left in flight by a wait: {in_flight}")


def _compile(fn, signature: dict, constexprs: dict, cfg):
    """The kernel compiled for sm90 at cfg's warps and stages, or why it does not compile.
    Constexprs not given take the kernel's defaults (ASTSource would leave them None)."""
    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}
    try:
        return triton.compile(ASTSource(fn, signature, constexprs={**defaults, **constexprs}),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.warps, num_stages=cfg.stages))
    except Exception as exc:
        return f"does not compile ({str(exc).splitlines()[0][:80]})"


def _ptxas(ptx: str) -> tuple:
    """(registers, bytes spilled, ", WGMMA SERIALIZED" where ptxas issues each wgmma only after
    the previous one ended for want of registers (its C7511 note), else "") of sm_90a PTX, from
    the wheel's ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    serialized = ", WGMMA SERIALIZED" if "C7511" in log else ""
    return regs.group(1) if regs else "?", spill.group(1) if spill else "?", serialized


def _repeated(ttgir: str) -> str:
    """", REPEATED wgmma" where a product has fewer output rows than its MMA layout's warps
    cover (16 rows a warp along M): the extra warpgroups recompute the same rows."""
    warps_m = {name: int(m) for name, m in re.findall(
        r"#(mma\d*) = #ttg.nvidia_mma<\{versionMajor = 3, versionMinor = 0, "
        r"warpsPerCTA = \[(\d+), \d+\]", ttgir)}
    dots = re.findall(r"warp_group_dot .*-> tensor<(\d+)x\d+xf32, #(mma\d*)>", ttgir)
    bad = {int(rows) for rows, name in dots if int(rows) < 16 * warps_m.get(name, 0)}
    return f", REPEATED wgmma ({sorted(bad)}-row products)" if bad else ""


def main_fp8():
    for causal in (True, False):
        cands = [FA.GPU_CFG["fwd_fp8"][(B.D, causal)]] + B.SWEEP_FP8
        for i, cfg in enumerate(dict.fromkeys(cands)):
            tag = " (GPU_CFG)" if i == 0 else ""
            print(f"fp8 fwd {'causal' if causal else 'nomask'} {tuple(cfg)}{tag}: "
                  f"{probe_fp8(cfg, causal)}", flush=True)
            if i == 0:
                print(f"  with fp8_mha's E4M3 out: {probe_fp8(cfg, causal, fp8_out=True)}",
                      flush=True)


def main_sm90():
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from tritium.kernels import flash_attention_sm90 as sm90, flash_attention_sm90_bwd as sm90_bwd
    from tritium.kernels import flash_attention_sm90_bwd_fused as fused
    q = torch.empty(2, 1024, 8, B.D, dtype=torch.bfloat16)
    k = torch.empty(2, 1024, 2, B.D, dtype=torch.bfloat16)
    q_d, k_d, v_d = (mangle_type(d) for d in sm90._descriptors(q, k, k))
    do_d = mangle_type(sm90._desc(q, sm90.BLOCK_M))
    bq_d, bk_d, bv_d, bdo_d = (mangle_type(d) for d in sm90_bwd._bwd_descriptors(q, k, k, q))
    bwd = dict(lse_ptr="*fp32", delta_ptr="*fp32", qk_scale="fp32", scale="fp32", S_Q="i32",
               S_KV="i32", G="i32", kv_ss="i32")

    def outputs(fp32, x, box, *names):   # the destinations: TMA descriptors or fp32 pointers
        return {n: "*fp32" if fp32 else mangle_type(sm90.output(x, box)) for n in names}
    # name: (kernel, its runtime types given fp32 outputs or not, BM, stages)
    kernels = {
        "fwd": (sm90._fwd_kernel, lambda f: dict(
            q_desc=q_d, k_desc=k_d, v_desc=v_d, **outputs(f, q, sm90.BLOCK_M // 2, "o_dst"),
            o_ss="i32", lse_ptr="*fp32", S_Q="i32", S_K="i32", H="i32", G="i32",
            qk_scale="fp32", S_O="i32", row0="i32", o16_ptr="*bf16", flags="i32"),
            sm90.BLOCK_M, sm90.STAGES),
        "dkdv": (sm90_bwd._dkdv_kernel, lambda f: dict(
            bwd, q_desc=bq_d, k_desc=bk_d, v_desc=bv_d, do_desc=bdo_d, H_KV="i32",
            **outputs(f, k, sm90.BLOCK_N // 2, "dk_dst", "dv_dst")),
            sm90_bwd.BWD_BLOCK_M, sm90_bwd.BWD_STAGES),
        "dq": (sm90_bwd._dq_kernel, lambda f: dict(
            bwd, q_desc=q_d, do_desc=do_d, k_desc=k_d, v_desc=v_d, o_ptr="*bf16", o_sb="i32",
            o_ss="i32", o_sh="i32", H="i32", dq_ss="i32",
            **outputs(f, q, sm90.BLOCK_M // 2, "dq_dst")), sm90.BLOCK_M, sm90.STAGES)}
    dq32 = torch.empty(q.shape, dtype=torch.float32)
    kernels["fused"] = (fused._bwd_kernel, lambda f: dict(
        bwd, q_desc=bq_d, k_desc=bk_d, v_desc=bv_d, do_desc=bdo_d, H_KV="i32",
        dq_desc=mangle_type(fused._dq_desc(dq32)),
        **outputs(f, k, sm90.BLOCK_N // 2, "dk_dst", "dv_dst")),
        sm90_bwd.BWD_BLOCK_M, sm90_bwd.BWD_STAGES)
    for name, (fn, types, bm, stages) in kernels.items():
        for fp32, causal in itertools.product((False, True), (True, False)):
            constexprs = dict(BM=bm, BN=sm90.BLOCK_N, D=B.D, NSTAGE=stages, CAUSAL=causal,
                              CONSUMER_REGS=sm90.CONSUMER_REGS, LOADER_REGS=sm90.LOADER_REGS)
            sig = {p.name: "constexpr" if p.name in constexprs else types(fp32)[p.name]
                   for p in fn.params}
            kernel = triton.compile(GluonASTSource(fn, sig, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            regs, spill, serial = _ptxas(kernel.asm["ptx"])
            print(f"sm90 {name} {'causal' if causal else 'nomask'}, "
                  f"{'fp32' if fp32 else '16-bit'} out: {regs} registers at launch, {spill} "
                  f"bytes spilled{serial}, {kernel.metadata.shared} bytes of shared memory",
                  flush=True)


def main():
    if "fp8" in sys.argv[1:]:
        return main_fp8()
    if "sm90" in sys.argv[1:]:
        return main_sm90()
    modes = [a == "split" for a in sys.argv[1:] if a in ("split", "nosplit")] or [False, True]
    kinds = [a for a in sys.argv[1:] if a in KERNELS] or list(KERNELS)
    for split in modes:
        sweeps = B.SWEEPS[split]
        for kind in kinds:
            cands = [FA.GPU_CFG[kind][(B.D, split)]] + sweeps[kind]
            if kind == "dkdv":
                cands += sweeps["atomic"]
            for i, cfg in enumerate(dict.fromkeys(cands)):
                tag = " (GPU_CFG)" if i == 0 else ""
                print(f"{'split' if split else 'nosplit'} {kind} {tuple(cfg)}{tag}: "
                      f"{probe(kind, cfg, split)}", flush=True)


if __name__ == "__main__":
    main()
