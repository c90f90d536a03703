"""Compile every launched Triton kernel for Hopper (sm_90a) on a machine without a GPU.

What: the cpu and interp tiers run kernels under TRITON_INTERPRET=1, which accepts code that
compiled Triton refuses (e.g. a plain Python module global read inside @triton.jit code:
"Cannot access global variable ... from within @jit'ed function"). This test imports triton
normally and runs `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` for each
top-level kernel of `tritium.kernels.*`, with the signature and constexprs its launcher uses at
Llama-ish sizes (hidden 4096, FFN 14336, head dim 128, vocab 32000, bf16 in, e4m3 out).
Triton's wheel ships ptxas, so each compile goes all the way to a cubin (TTIR, TTGIR, LLVM IR,
PTX, cubin; ~20 s for all on 2 cores): frontend errors, lowering errors and ptxas errors
(e.g. too much shared memory) fail here; without the wheel's ptxas the compiles are skipped.
Helpers called from kernels are compiled through their callers. A top-level kernel (a JIT
function no other JIT function of its module calls) missing from `KERNELS` fails the test.
Gluon kernels (`flash_attention_sm90`, `_sm90_bwd`, `_sm90_bwd_fused`) compile through
GluonASTSource; their warp_specialize partitions, handed over as `(fn, args)`, count as called.
Triton compiles only the branches the constexprs take: `VARIANTS` adds second constexpr sets
where large branches hide, and `test_jit_code_reads_only_constexpr_globals` checks the global
reads of every JIT function's whole source statically.
Does not check numerics (the interp and gpu tiers do) nor launch anything.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import types

import pytest

pytestmark = pytest.mark.cpu

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels: needs Triton without the interpreter", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
try:  # Gluon (Triton >= 3.5): tritium.kernels.flash_attention_sm90
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:
    GluonASTSource = None
from triton.runtime.jit import JITCallable, JITFunction  # noqa: E402

import tritium.kernels as kernels_pkg  # noqa: E402
from tritium.kernels import norm as _norm, rope as _rope, activation as _act  # noqa: E402
from tritium.kernels import cross_entropy as _ce, moe as _moe, adam as _adam  # noqa: E402
from tritium.kernels import norm_cast as _norm_cast, flash_attention as _fa  # noqa: E402

E4, E4MAX = tl.float8e4nv, 448.0
BF16P, F32P, E4P, I32P, I8P, U8P = "*bf16", "*fp32", "*fp8e4nv", "*i32", "*i8", "*u8"
HIDDEN, FFN, TOKENS = 4096, 14336, 8192
_NORM = _norm._tile(HIDDEN, False)
_NORM_BWD = _norm._tile(HIDDEN, False, backward=True)
_ACT = _act._tile(TOKENS, FFN, False, 2048)
_ROPE = _rope._tile(TOKENS * 32, 128, False)
_CE = _ce._config(32000, False)
_ROUTER = _moe._router_tile(8, True)
_ADAM = _adam.block_config(False)


def _desc(dtype: str, block: tuple) -> str:
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}]>"


# (module, kernel): (pointer / descriptor / float argument types (other `*_ptr` -> *fp32,
# everything else -> i32), constexprs, compile options). Values as the launchers pick them on
# CUDA for bf16 activations, e4m3 FP8 and delayed / current scaling.
KERNELS = {
    ("act_cast", "_act_fp8_fwd_kernel"): (
        {"x_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": U8P},
        dict(ACT=_act._CODE["swiglu"], GATED=True, WRITE_DATA=True, WRITE_T=True, TRANS_T=True,
             UPDATE_AMAX=True, FP8_MAX=E4MAX, OUT_DTYPE=E4, BLOCK_R=64, BLOCK_C=64),
        dict(num_warps=8)),
    ("act_cast", "_act_fp8_bwd_kernel"): (
        {"dy_ptr": BF16P, "x_ptr": BF16P, "dx_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": U8P},
        dict(ACT=_act._CODE["swiglu"], GATED=True, WRITE_HP=False, WRITE_DATA=True,
             WRITE_T=True, TRANS_T=True, UPDATE_AMAX=True, FP8_MAX=E4MAX, OUT_DTYPE=E4, BLOCK_R=64,
             BLOCK_C=64),
        dict(num_warps=8)),
    ("act_block_cast", "_act_block_cast_kernel"): (
        {"x_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": E4P},
        dict(ACT=_act._CODE["swiglu"], GATED=True, COLUMNWISE=True, FP8_MAX=E4MAX, OUT_DTYPE=E4,
             EPS=0.0, POW2=True, BLOCK=128, SUB=32),
        dict(num_warps=4)),
    ("act_block_cast", "_act_bwd_block_cast_kernel"): (
        {"dy_ptr": BF16P, "x_ptr": BF16P, "hp_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": E4P},
        dict(ACT=_act._CODE["swiglu"], GATED=True, WRITE_HP=True, COLUMNWISE=True,
             FP8_MAX=E4MAX, OUT_DTYPE=E4, EPS=0.0, POW2=True, BLOCK=128, SUB=32),
        dict(num_warps=4)),
    ("activation", "_fwd_kernel"): (
        {"x_ptr": BF16P, "y_ptr": BF16P},
        dict(ACT=_act._CODE["swiglu"], GATED=True, BLOCK_R=_ACT[0], BLOCK_C=_ACT[1]),
        dict(num_warps=_ACT[2])),
    ("activation", "_bwd_kernel"): (
        {"dy_ptr": BF16P, "x_ptr": BF16P, "dx_ptr": BF16P},
        dict(ACT=_act._CODE["gelu"], GATED=False, BLOCK_R=_ACT[0], BLOCK_C=_ACT[1]),
        dict(num_warps=_ACT[2])),
    ("adam", "_adam_kernel"): (
        {"table_ptr": "*i64", "chunks_ptr": "*i64"},
        dict(P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, M_DTYPE=tl.float32, V_DTYPE=tl.float32,
             HAS_MASTER=True, REMAINDER=False, FP8_MAX=0.0, DECAY_GRAD=False, DECAY_UPDATE=True,
             ALIGNED=True, CHUNK=_ADAM[0], BLOCK=_ADAM[1], PASS=0, M_SCALED=False,
             V_SCALED=False, W_DTYPE=tl.float32, W_SCALED=False, M_CLAMP=0.0, V_CLAMP=0.0),
        dict(num_warps=_ADAM[2], enable_fp_fusion=False)),
    ("block_cast", "_block_cast_kernel"): (
        {"x_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": E4P, "skip_ptr": "*i32"},
        dict(FP8_MAX=E4MAX, OUT_DTYPE=E4, EPS=0.0, POW2=True, ROWWISE=True, COLUMNWISE=True,
             BLOCK_2D=False, HAS_SKIP=True, BLOCK=128, SUB=64),
        dict(num_warps=4)),
    ("block_gemm", "_block_gemm_kernel"): (
        {"a_desc": _desc("fp8e4nv", (64, 128)), "b_desc": _desc("fp8e4nv", (128, 128)),
         "c_desc": _desc("bf16", (64, 128)), "bias_ptr": BF16P},
        dict(HAS_BIAS=True, B_2D=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=4, num_stages=3)),
    ("cast", "_cast_transpose_kernel"): (
        {"x_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": U8P, "skip_ptr": F32P},
        dict(FP8_MAX=E4MAX, OUT_DTYPE=E4, WRITE_DATA=True, WRITE_T=True, TRANS_T=True,
             UPDATE_AMAX=True,
             CURRENT=False, EPS=0.0, POW2=False, HAS_SKIP=False, BLOCK_M=64, BLOCK_N=128),
        dict(num_warps=4)),
    ("cast", "_cast_pair_kernel"): (
        {"a_ptr": BF16P, "a_data_ptr": E4P, "a_data_t_ptr": U8P,
         "b_ptr": F32P, "b_data_ptr": E4P, "b_data_t_ptr": E4P},
        dict(FP8_MAX=E4MAX, OUT_DTYPE=E4, A_DATA=True, A_T=True, A_TRANS=True, B_DATA=True,
             B_T=True, B_TRANS=False,
             A_AMAX=True, B_AMAX=True, CURRENT=True, EPS=0.0, POW2=False, BLOCK_M=64,
             BLOCK_N=128),
        dict(num_warps=4)),
    ("cast", "_amax_kernel"): ({"x_ptr": BF16P}, dict(BLOCK=4096), dict(num_warps=8)),
    ("cast", "_amax_pair_kernel"): (
        {"x_ptr": BF16P, "y_ptr": BF16P}, dict(BLOCK=4096), dict(num_warps=8)),
    ("cast", "_transpose_kernel"): (
        {"src_ptr": "*u8", "dst_ptr": "*u8"}, dict(BLOCK_M=128, BLOCK_N=128), dict(num_warps=8)),
    ("cast", "_dequantize_kernel"): (
        {"data_ptr": E4P, "out_ptr": BF16P}, dict(BLOCK=1024), dict(num_warps=4)),
    ("cross_entropy", "_ce_kernel"): (
        {"x_ptr": BF16P, "t_ptr": "*i64", "g_ptr": BF16P, "eps_over_v": "fp32",
         "one_minus_eps": "fp32", "z": "fp32"},
        dict(STATS=True, LOSS=True, GRAD=True, BLOCK=_CE[0]), dict(num_warps=_CE[1])),
    ("gemm", "_fp8_gemm_tn_kernel"): (
        {"a_desc": _desc("fp8e4nv", (128, 128)), "b_desc": _desc("fp8e4nv", (256, 128)),
         "c_desc": _desc("bf16", (128, 128)), "bias_ptr": BF16P, "c_ptr": BF16P},
        dict(HAS_BIAS=True, PRECISE=False, SPLIT_STORE=True, ACCUMULATE=False, BLOCK_M=128,
             BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=8, num_stages=3)),
    ("small_gemm", "_fp8_gemm_tn_pair_kernel"): (  # dgrad (bf16) and wgrad (fp32)
        {"a0_desc": _desc("fp8e5", (128, 128)), "b0_desc": _desc("fp8e4nv", (128, 128)),
         "c0_desc": _desc("bf16", (128, 128)), "a1_desc": _desc("fp8e5", (128, 128)),
         "b1_desc": _desc("fp8e4nv", (128, 128)), "c1_desc": _desc("fp32", (128, 64))},
        dict(PRECISE=True, SPLIT_STORE0=False, SPLIT_STORE1=True, BLOCK_M=128, BLOCK_N=128,
             BLOCK_K=128, GROUP_M=8),
        dict(num_warps=4, num_stages=2)),
    ("small_gemm", "_fp8_gemm_tn_cast_kernel"): (  # both operands bf16 (a Linear's proj)
        {"a_ptr": BF16P, "a_t_ptr": E4P, "b_ptr": BF16P, "b_t_ptr": E4P,
         "c_desc": _desc("bf16", (128, 128)), "bias_ptr": BF16P},
        dict(FP8_MAX=E4MAX, FP8_DTYPE=E4, CURRENT=False, EPS=0.0, POW2=False, A_HP=True,
             WRITE_A_T=True, WRITE_B_T=True,
             HAS_BIAS=True, SPLIT_STORE=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
             GROUP_M=8),
        dict(num_warps=8, num_stages=2)),
    ("small_gemm", "_fp8_dgrad_wgrad_kernel"): (
        {"dy_ptr": BF16P, "w_t_desc": _desc("fp8e4nv", (128, 128)),
         "dx_desc": _desc("bf16", (128, 128)), "x_t_desc": _desc("fp8e4nv", (128, 128)),
         "dw_desc": _desc("fp32", (128, 64)), "dbias_ptr": BF16P},
        dict(FP8_MAX=57344.0, FP8_DTYPE=tl.float8e5, CURRENT=False, EPS=0.0, POW2=False,
             SPLIT_DX=False, SPLIT_DW=True,
             HAS_DBIAS=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=4, num_stages=2)),
    ("grouped_gemm", "_grouped_cast_kernel"): (
        {"x_ptr": BF16P, "data_ptr": E4P, "data_t_ptr": E4P, "offs_ptr": I32P},
        dict(FP8_MAX=E4MAX, OUT_DTYPE=E4, WRITE_DATA=True, WRITE_T=True, UPDATE_AMAX=True,
             CURRENT=False, EPS=0.0, POW2=False, GP=16, BLOCK_M=64, BLOCK_N=128, COLS=1),
        dict(num_warps=4)),
    ("grouped_gemm", "_grouped_gemm_kernel"): (
        {"a_desc": _desc("fp8e4nv", (256, 128)), "b_desc": _desc("fp8e4nv", (128, 128)),
         "out_ptr": BF16P, "bias_ptr": BF16P, "offs_ptr": I32P},
        dict(HAS_BIAS=False, PRECISE=True, BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=8, num_stages=3)),
    ("grouped_gemm", "_grouped_wgrad_kernel"): (
        {"a_ptr": E4P, "b_ptr": E4P, "out_ptr": BF16P, "offs_ptr": I32P},
        dict(PRECISE=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=8, num_stages=3)),
    ("grouped_gemm", "_grouped_gemm_tma_kernel"): (
        {"a_desc": _desc("fp8e4nv", (128, 128)), "b_desc": _desc("fp8e4nv", (256, 128)),
         "out_ptr": BF16P, "bias_ptr": BF16P, "offs_ptr": I32P},
        dict(HAS_BIAS=False, PRECISE=False, SPLIT_STORE=True, FLATTEN=False, BLOCK_M=128,
             BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
        dict(num_warps=8, num_stages=3)),
    ("grouped_gemm", "_grouped_wgrad_tma_kernel"): (
        {"a_ptr": E4P, "b_ptr": E4P, "out_ptr": BF16P, "offs_ptr": I32P},
        dict(PRECISE=False, SPLIT_STORE=True, FLATTEN=False, BLOCK_M=128, BLOCK_N=128,
             BLOCK_K=128, GROUP_M=8),
        dict(num_warps=8, num_stages=3)),
    ("moe", "_permute_kernel"): (
        {"inp_ptr": BF16P, "map_ptr": I32P, "out_ptr": BF16P},
        dict(HAS_PROBS=True, BLOCK_H=_moe._block_h(HIDDEN, True)), dict(num_warps=4)),
    ("moe", "_unpermute_kernel"): (
        {"inp_ptr": BF16P, "map_ptr": I32P, "out_ptr": BF16P},
        dict(HAS_PROBS=True, BLOCK_H=_moe._block_h(HIDDEN, True)), dict(num_warps=4)),
    ("moe", "_unpermute_bwd_kernel"): (
        {"grad_ptr": BF16P, "inp_ptr": BF16P, "map_ptr": I32P, "d_inp_ptr": BF16P},
        dict(HAS_PROBS=True, BLOCK_H=_moe._block_h(HIDDEN, True)), dict(num_warps=4)),
    ("moe", "_router_fwd_kernel"): (
        {"map_ptr": I8P, "scaling": "fp32"},
        dict(SIGMOID=False, PRE=False, AUX=False, TOPK=2, NUM_GROUPS=0, GROUP_TOPK=1,
             HAS_BIAS=False, SCALE=False, GP=2, BLOCK_T=_ROUTER[0], EP=_ROUTER[1]),
        dict(num_warps=4)),
    ("moe", "_router_bwd_kernel"): (
        {"map_ptr": I8P, "scaling": "fp32"},
        dict(SIGMOID=False, AUX=False, TOPK=2, SCALE=False, BLOCK_T=_ROUTER[0],
             EP=_ROUTER[1]),
        dict(num_warps=4)),
    ("norm", "_norm_fwd_kernel"): (
        {"x_ptr": BF16P, "w_ptr": BF16P, "b_ptr": BF16P, "y_ptr": BF16P, "n": "fp32",
         "eps": "fp32"},
        dict(IS_RMS=True, HAS_BIAS=False, ZERO_CENTERED=False, BLOCK_ROWS=_NORM[0],
             BLOCK_N=_NORM[1]),
        dict(num_warps=_NORM[2])),
    ("norm", "_norm_bwd_kernel"): (
        {"dy_ptr": BF16P, "x_ptr": BF16P, "w_ptr": BF16P, "dx_ptr": BF16P, "n": "fp32"},
        dict(IS_RMS=False, HAS_DB=True, ZERO_CENTERED=False, BLOCK_ROWS=_NORM_BWD[0],
             BLOCK_N=_NORM_BWD[1], PREFETCH=_norm._BWD_PREFETCH),
        dict(num_warps=_NORM_BWD[2])),
    ("norm", "_partial_sum_kernel"): (
        {}, dict(HAS_DB=True, BLOCK_G=_norm._SUM_BLOCK_G, BLOCK_N=_norm._SUM_BLOCK_N),
        dict(num_warps=4)),
    ("norm_cast", "_norm_fp8_fwd_kernel"): (
        {"x_ptr": BF16P, "w_ptr": BF16P, "b_ptr": BF16P, "y_ptr": BF16P, "data_ptr": E4P,
         "data_t_ptr": E4P, "n": "fp32", "eps": "fp32"},
        dict(IS_RMS=True, HAS_BIAS=False, ZERO_CENTERED=False, WRITE_HP=False, WRITE_T=True,
             UPDATE_AMAX=True, FP8_MAX=E4MAX, OUT_DTYPE=E4, BLOCK_ROWS=_NORM[0],
             BLOCK_N=_NORM[1], BLOCK_M=max(_norm_cast._BLOCK_M, _NORM[0]),
             BLOCK_TN=_norm_cast._BLOCK_TN),
        dict(num_warps=_NORM[2])),
    ("norm_block_cast", "_norm_stats_kernel"): (
        {"x_ptr": BF16P, "w_ptr": BF16P, "b_ptr": BF16P, "n": "fp32", "eps": "fp32"},
        dict(IS_RMS=False, BLOCK_ROWS=_NORM[0], BLOCK_N=_NORM[1]),
        dict(num_warps=_NORM[2])),
    ("norm_block_cast", "_norm_block_cast_kernel"): (
        {"x_ptr": BF16P, "w_ptr": BF16P, "b_ptr": BF16P, "y_ptr": BF16P, "data_ptr": E4P,
         "data_t_ptr": E4P},
        dict(IS_RMS=False, HAS_BIAS=True, ZERO_CENTERED=False, WRITE_HP=True, COLUMNWISE=True,
             FP8_MAX=E4MAX, OUT_DTYPE=E4, EPS=0.0, POW2=True, BLOCK=128, SUB=32),
        dict(num_warps=4)),
    ("rope", "_rope_kernel"): (
        {"x_ptr": BF16P, "pos_ptr": I32P, "y_ptr": BF16P},
        dict(INTERLEAVED=False, TRANSPOSE=False, BLOCK_R=_ROPE[0], BLOCK_D=_ROPE[1]),
        dict(num_warps=_ROPE[2], enable_fp_fusion=False)),
    ("scaling", "_delayed_update_kernel"): (
        {}, dict(FP8_MAX=E4MAX, MARGIN_DIV=1.0, MOST_RECENT=False, BLOCK_L=1024),
        dict(num_warps=4)),
    ("scaling", "_delayed_update_many_kernel"): (
        {"table_ptr": "*i64"}, dict(FP8_MAX=E4MAX, MARGIN_DIV=1.0, MOST_RECENT=False, BLOCK_L=16),
        dict(num_warps=4)),
    ("sgd", "_sgd_kernel"): (
        {"table_ptr": "*i64", "chunks_ptr": "*i64"},
        dict(P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, HAS_MASTER=True, FP8_MAX=0.0,
             DECAY=True, DECAY_AFTER=False, MOMENTUM=True, NESTEROV=False, FIRST=False,
             ALIGNED=True, CHUNK=_ADAM[0], BLOCK=_ADAM[1]),
        dict(num_warps=_ADAM[2], enable_fp_fusion=False)),
}
_FA_TYPES = {"qk_scale": "fp32", "scale": "fp32", "o_ptr": BF16P, "dq_ptr": BF16P,
             "dk_ptr": BF16P, "dv_ptr": BF16P, "do_ptr": BF16P, "cu_q_ptr": I32P,
             "cu_k_ptr": I32P}
_FA_KINDS = {"_fwd_kernel": "fwd", "_dkdv_kernel": "dkdv", "_dq_kernel": "dq"}


def _fa_types(name: str, cfg, split: bool = False, d: int = 128) -> dict:
    """Argument types of a flash kernel: q/k/v/dO as TMA descriptors of the [b, s, h * d] view
    ([1, rows, d] boxes: BLOCK_M rows for q / dO, BLOCK_N for k / v) where the config asks
    for them, bf16 pointers otherwise; 16-bit outputs in the speed mode, fp32 in split mode
    (dk/dv's atomic dq is always fp32)."""
    types = dict(_FA_TYPES)
    for src, rows in (("q_src", cfg.block_m), ("k_src", cfg.block_n), ("v_src", cfg.block_n),
                      ("do_src", cfg.block_m)):
        types[src] = f"tensordesc<bf16[1, {rows}, {d}]>" if cfg.tma else BF16P
    if split:
        types.update({n: F32P for n in ("o_ptr", "dq_ptr", "dk_ptr", "dv_ptr")})
    if name == "_dkdv_kernel":
        types["dq_ptr"] = F32P
    return {k: v for k, v in types.items() if k in getattr(_fa, name).arg_names}


# the speed mode (split=False, 16-bit out/grads) with its GPU config; VARIANTS below compile the
# other loads (TMA <-> pointers) and the split, fp32-output mode at its own config
_FA_CFG = {}
for _name, _kind in _FA_KINDS.items():
    _c = _FA_CFG[_name] = _fa.GPU_CFG[_kind][(128, False)]
    _extra = {"fwd": dict(WS=_c.ws and _c.tma, FP8=False, VT=False, WINDOW=False, VARLEN=False,
                          O8=False, O8_AMAX=False, O_HP=True),
              "dkdv": dict(ATOMIC_DQ=_c.atomic_dq, WINDOW=False, VARLEN=False),
              "dq": dict(WINDOW=False, VARLEN=False)}
    KERNELS[("flash_attention_tiles", _name)] = (
        _fa_types(_name, _c),
        dict(CAUSAL=True, SPLIT=False, PREC="tf32", D=128, BLOCK_M=_c.block_m,
             BLOCK_N=_c.block_n, TMA=_c.tma, **_extra[_kind]),
        dict(num_warps=_c.warps, num_stages=_c.stages))
KERNELS[("flash_attention_tiles", "_delta_kernel")] = (
    {"do_ptr": BF16P, "o_ptr": BF16P}, dict(D=128, BLOCK_M=_FA_CFG["_dq_kernel"].block_m),
    dict(num_warps=4))
_FA256 = _fa.GPU_CFG["fwd"][(256, False)]  # head dim 256: the forward alone


def _sm90_types(fp32_out: bool = False) -> dict:
    """The Gluon kernels' descriptor types (their layouts are part of the type) as their
    launchers make them: bf16 [b * s, h * d] views, GQA-4, on CPU tensors (nothing launched);
    the destinations (`_dst`) TMA descriptors, or fp32 pointers (fp32_out)."""
    import torch
    from triton.runtime.jit import mangle_type
    sm90, bwd = _fa.sm90, _fa.sm90_bwd
    q = torch.empty(2, 1024, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 1024, 2, 128, dtype=torch.bfloat16)
    q_d, k_d, v_d = (mangle_type(d) for d in sm90._descriptors(q, k, k))
    b_d = (mangle_type(d) for d in bwd._bwd_descriptors(q, k, k, q))
    rows, keys = (F32P,) * 2 if fp32_out else (
        mangle_type(sm90.output(x, box)) for x, box in ((q, sm90.BLOCK_M // 2),
                                                       (k, sm90.BLOCK_N // 2)))
    return dict(q_desc=q_d, k_desc=k_d, v_desc=v_d, do_desc=mangle_type(sm90._desc(q, 128)),
                o_dst=rows, dq_dst=rows, dk_dst=keys, dv_dst=keys, o_ptr=BF16P,
                qk_scale="fp32", scale="fp32",
                bwd=dict(zip(("q_desc", "k_desc", "v_desc", "do_desc"), b_d)))


def _sm90_kernel_types(name: str, fp32_out: bool = False) -> dict:
    """`_sm90_types` for kernel `name` of the Gluon modules (the key-block kernels read the
    backward's descriptors)."""
    t = _sm90_types(fp32_out)
    bwd = t.pop("bwd")
    if name in ("_dkdv_kernel", "_bwd_kernel"):
        t.update(bwd)
    if name == "_bwd_kernel":
        import torch
        from triton.runtime.jit import mangle_type
        dq = torch.empty(2, 1024, 8, 128, dtype=torch.float32)
        t["dq_desc"] = mangle_type(_fa.sm90_bwd_fused._dq_desc(dq))
    fn = getattr({"_fwd_kernel": _fa.sm90, "_bwd_kernel": _fa.sm90_bwd_fused}.get(
        name, _fa.sm90_bwd), name)
    return {n: t[n] for n in fn.arg_names if n in t}


# the Gluon kernels (those this Triton has) at their launchers' constants: (BM, NSTAGE)
SM90_KERNELS = {} if _fa.sm90.gluon is None else {
    ("flash_attention_sm90", "_fwd_kernel"): (_fa.sm90.BLOCK_M, _fa.sm90.STAGES),
    ("flash_attention_sm90_bwd", "_dq_kernel"): (_fa.sm90.BLOCK_M, _fa.sm90.STAGES),
    ("flash_attention_sm90_bwd", "_dkdv_kernel"): (_fa.sm90_bwd.BWD_BLOCK_M,
                                                   _fa.sm90_bwd.BWD_STAGES),
    **({("flash_attention_sm90_bwd_fused", "_bwd_kernel"): (_fa.sm90_bwd.BWD_BLOCK_M,
                                                             _fa.sm90_bwd.BWD_STAGES)}
       if _fa.sm90_bwd_fused.AVAILABLE else {})}
for (_mod, _name), (_bm, _stages) in SM90_KERNELS.items():
    KERNELS[(_mod, _name)] = (
        _sm90_kernel_types(_name),
        dict(BN=_fa.sm90.BLOCK_N, D=128, CONSUMER_REGS=_fa.sm90.CONSUMER_REGS,
             LOADER_REGS=_fa.sm90.LOADER_REGS, CAUSAL=True, BM=_bm, NSTAGE=_stages),
        dict(num_warps=4))


def _fa_fp8(d: int, tma: bool = True, causal: bool = True) -> dict:
    """The FP8 forward (fp8_dpa) at its config for the mask: E4M3 q/k descriptors of the
    [b, s, h * d] view, V keys-contiguous (VT) through a descriptor of its [b, h, d, s] view,
    bf16 out; tma=False: pointer loads."""
    c = _fa.GPU_CFG["fwd_fp8"][(d, causal)]
    c = c._replace(tma=c.tma and tma)
    types = dict(_fa_types("_fwd_kernel", c, d=d))
    for src, rows in (("q_src", c.block_m), ("k_src", c.block_n)):
        types[src] = f"tensordesc<fp8e4nv[1, {rows}, {d}]>" if c.tma else E4P
    types["v_src"] = f"tensordesc<fp8e4nv[1, 1, {d}, {c.block_n}]>" if c.tma else E4P
    return dict(FP8=True, VT=True, SPLIT=False, D=d, TMA=c.tma, WS=c.ws and c.tma,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, _types=types,
                _options=dict(num_warps=c.warps, num_stages=c.stages))


def _fa_fp8_out(variant: dict, **flags) -> dict:
    """An FP8 forward variant that also writes the E4M3 out (fp8_mha)."""
    return dict(variant, O8=True, _types=dict(variant["_types"], o8_ptr=E4P), **flags)


def _fa_variants(name: str) -> list:
    """The other loads (TMA <-> pointers; the forward's TMA also warp-specialized), the split
    mode with fp32 outputs at its own config, a band (sliding window) and packed sequences
    (varlen: pointer loads, with a band)."""
    kind, c = _FA_KINDS[name], _FA_CFG[name]
    flip = c._replace(tma=not c.tma)
    ws = dict(WS=flip.tma) if kind == "fwd" else {}
    s = _fa.GPU_CFG[kind][(128, True)]
    ptrs = c._replace(tma=False)
    return [dict(WINDOW=True, CAUSAL=False),
            dict(VARLEN=True, WINDOW=True, CAUSAL=False, TMA=False,
                 _types=_fa_types(name, ptrs), **(dict(WS=False) if kind == "fwd" else {})),
            dict(TMA=flip.tma, _types=_fa_types(name, flip), **ws),
            dict(SPLIT=True, TMA=s.tma, BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                 _types=_fa_types(name, s, split=True),
                 _options=dict(num_warps=s.warps, num_stages=s.stages),
                 **(dict(WS=s.ws and s.tma) if kind == "fwd" else {}))]


# Second constexpr sets for kernels whose constexpr branches prune large parts of the code
# (Triton compiles only the taken branch): (module, kernel) -> [constexpr overrides, with
# optional "_types" (argument types) and "_options" (compile options) overrides].
VARIANTS = {
    ("adam", "_adam_kernel"): [  # FP8 / fp16 moments and fp16 masters, scaled (both passes)
        dict(M_DTYPE=E4, V_DTYPE=tl.float16, M_SCALED=True, V_SCALED=True, W_DTYPE=tl.float16,
             W_SCALED=True, M_CLAMP=E4MAX, PASS=pass_) for pass_ in (1, 2)]
    + [dict(P_DTYPE=E4, HAS_MASTER=True, FP8_MAX=E4MAX)],  # FP8 params (fp8_model_init)
    ("cast", "_cast_transpose_kernel"): [
        dict(CURRENT=True, POW2=True, HAS_SKIP=True),
        dict(TRANS_T=False, _types={"x_ptr": F32P, "data_t_ptr": E4P})],
    ("small_gemm", "_fp8_gemm_tn_cast_kernel"): [  # a in fp8 already (a fused norm's cast)
        dict(A_HP=False, WRITE_A_T=False, _types={"a_ptr": E4P}),
        dict(CURRENT=True, POW2=True)],  # Float8CurrentScaling: scales from measured amaxes
    ("small_gemm", "_fp8_dgrad_wgrad_kernel"): [dict(CURRENT=True)],
    # fp32 inputs: data_t from a transposed re-read, not the tile's bytes transposed
    ("act_cast", "_act_fp8_fwd_kernel"): [
        dict(TRANS_T=False, _types={"x_ptr": F32P, "data_t_ptr": E4P})],
    ("act_cast", "_act_fp8_bwd_kernel"): [
        dict(TRANS_T=False, WRITE_HP=True, _types={"dy_ptr": F32P, "x_ptr": F32P,
                                                   "dx_ptr": F32P, "data_t_ptr": E4P})],
    ("gemm", "_fp8_gemm_tn_kernel"): [  # accumulating into an fp32 main_grad and into bf16
        dict(ACCUMULATE=True, PRECISE=True, SPLIT_STORE=split, HAS_BIAS=False, BLOCK_M=128,
             BLOCK_N=128, _types={"b_desc": _desc("fp8e4nv", (128, 128)),
                                  "c_desc": _desc(dt, (128, 64 if split else 128)),
                                  "c_ptr": f"*{dt}"})
        for dt, split in (("fp32", True), ("bf16", False))],
    ("block_cast", "_block_cast_kernel"): [  # the 128x128 default
        dict(BLOCK_2D=True, SUB=128, _options=dict(num_warps=8))],
    # the Gluon kernels: no mask, and fp32 outputs (CP's fp32 partials) stored from registers
    **{key: [dict(CAUSAL=False), dict(CAUSAL=False, _types=_sm90_kernel_types(key[1], True)),
             dict(_types=_sm90_kernel_types(key[1], True))] for key in SM90_KERNELS},
    # the forward merging into a CP rank's running fp32 partials, with their bf16 copy
    ("flash_attention_sm90", "_fwd_kernel"): [
        dict(CAUSAL=False), dict(CAUSAL=False, _types=_sm90_kernel_types("_fwd_kernel", True)),
        dict(_types=_sm90_kernel_types("_fwd_kernel", True)),
        dict(CAUSAL=False, _types={**_sm90_kernel_types("_fwd_kernel", True),
                                   "o16_ptr": "*bf16"})],
    ("flash_attention_tiles", "_fwd_kernel"): _fa_variants("_fwd_kernel") + [
        dict(CAUSAL=False),
        dict(D=256, TMA=_FA256.tma, WS=_FA256.ws and _FA256.tma, BLOCK_M=_FA256.block_m,
             BLOCK_N=_FA256.block_n, _types=_fa_types("_fwd_kernel", _FA256, d=256),
             _options=dict(num_warps=_FA256.warps, num_stages=_FA256.stages))]
    + [_fa_fp8(128), dict(_fa_fp8(128, causal=False), CAUSAL=False),
       dict(_fa_fp8(64, causal=False), CAUSAL=False), _fa_fp8(128, tma=False),
       dict(_fa_fp8(128, causal=False), WINDOW=True, CAUSAL=False),
       _fa_fp8_out(_fa_fp8(128), O8_AMAX=True),      # fp8_mha: E4M3 out + amax in the epilogue
       _fa_fp8_out(dict(_fa_fp8(128, causal=False), CAUSAL=False), O_HP=False)],
    ("flash_attention_tiles", "_dkdv_kernel"): _fa_variants("_dkdv_kernel")
    + [dict(ATOMIC_DQ=not _FA_CFG["_dkdv_kernel"].atomic_dq)],
    ("flash_attention_tiles", "_dq_kernel"): _fa_variants("_dq_kernel"),
    ("norm", "_norm_fwd_kernel"): [dict(IS_RMS=False, HAS_BIAS=True, ZERO_CENTERED=True)],
    ("moe", "_router_fwd_kernel"): [dict(SIGMOID=True, PRE=True, AUX=True, NUM_GROUPS=4,
                                         GROUP_TOPK=2, HAS_BIAS=True, SCALE=True, GP=4)],
    ("sgd", "_sgd_kernel"): [dict(P_DTYPE=E4, FP8_MAX=E4MAX, NESTEROV=True, FIRST=True)],
}
CASES = [(key, i) for key in sorted(KERNELS) for i in range(1 + len(VARIANTS.get(key, [])))]


def _jit_functions() -> dict:
    """{(module, name): JITFunction} of every JIT function defined in tritium.kernels.*."""
    found = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        found.update({(info.name, n): v for n, v in vars(mod).items()
                      if isinstance(v, JITFunction) and v.__module__ == mod.__name__})
    return found


def _launched_kernels() -> dict:
    """The JIT functions no JIT function of the package calls (the ones launchers launch)."""
    jits = _jit_functions()

    def called(name, fn):   # or handed to Gluon's warp_specialize as a partition: (name, args)
        call = re.compile(rf"(?<![\w.]){re.escape(name)}\s*\(|\(\s*{re.escape(name)}\s*,")
        return any(other is not fn and other.__globals__.get(name) is fn and call.search(other.src)
                   for other in jits.values())
    return {key: fn for key, fn in jits.items() if not called(key[1], fn)}


LAUNCHED = _launched_kernels()
_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_HAS_PTXAS = os.access(_PTXAS, os.X_OK)


def test_every_launched_kernel_has_a_signature():
    missing = sorted(set(LAUNCHED) - set(KERNELS))
    stale = sorted(set(KERNELS) - set(LAUNCHED))
    assert not missing, (f"kernels {missing} are not in {__name__}.KERNELS: add each with the "
                         "signature and constexprs its launcher uses, so it is compiled for sm_90")
    assert not stale, f"KERNELS lists {stale}, which are no longer launched kernels"


def _signature(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            assert p.name in constexprs, f"{fn.__name__}: constexpr {p.name} has no value"
            sig[p.name] = "constexpr"
        elif p.name in types:
            sig[p.name] = types[p.name]
        else:
            assert not p.name.endswith("_desc"), f"{fn.__name__}: give {p.name}'s descriptor type"
            sig[p.name] = F32P if p.name.endswith("_ptr") else "i32"
    unknown = set(types) - {p.name for p in fn.params}
    assert not unknown, f"{fn.__name__}: no parameters {sorted(unknown)}"
    return sig


@pytest.mark.parametrize("key,variant", CASES, ids=[f"{m}.{k}-{i}" for (m, k), i in CASES])
def test_compiles_for_sm90(key, variant, monkeypatch, tmp_path):
    if key not in LAUNCHED:
        pytest.skip(f"{key} is not a launched kernel (test_every_launched_kernel_has_a_signature)")
    if not _HAS_PTXAS:
        pytest.skip(f"no executable ptxas at {_PTXAS}: cannot build the cubin")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, every run
    fn = LAUNCHED[key]
    types, constexprs, options = KERNELS[key]
    if variant:  # constexprs, plus argument types ("_types") and options ("_options")
        over = dict(VARIANTS[key][variant - 1])
        types = {**types, **over.pop("_types", {})}
        options = {**options, **over.pop("_options", {})}
        constexprs = {**constexprs, **over}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    src = source(fn, _signature(fn, types, constexprs), constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], f"{key}: empty cubin"
    assert ".target sm_90a" in compiled.asm["ptx"]


def _allowed_global(val) -> bool:
    """What compiled Triton lets @jit code read from module globals (code_generator's
    global_lookup in Triton 3.6): constexprs, JIT functions, modules, dtypes, triton.language."""
    return (isinstance(val, (tl.constexpr, tl.dtype, types.ModuleType))
            or hasattr(val, "__triton_builtin__") or hasattr(val, "__triton_aggregate__")
            or isinstance(val, JITCallable)
            or getattr(val, "__module__", "").startswith("triton.language"))


def test_jit_code_reads_only_constexpr_globals():
    """Every @triton.jit function, helpers and constexpr-pruned branches included (which the
    compiles above do not all reach): a name read that is not a parameter nor assigned in the
    function must be a global compiled Triton accepts (a plain int is not: use tl.constexpr)."""
    bad = []
    for (module, name), fn in _jit_functions().items():
        tree = ast.parse(fn.src)
        local = set(fn.arg_names) | {n.id for n in ast.walk(tree)
                                     if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                    and node.id not in local and node.id in fn.__globals__
                    and not _allowed_global(fn.__globals__[node.id])):
                bad.append(f"{module}.{name} reads {node.id} "
                           f"({type(fn.__globals__[node.id]).__name__})")
    assert not bad, ("@triton.jit code reads plain Python globals, which compiled Triton refuses "
                     "(wrap them in tl.constexpr): " + "; ".join(sorted(set(bad))))
