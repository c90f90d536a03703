"""cpu tier: `scripts/profile_host.py model-cpu-graphs` runs bench_graphs' eager step, and
`model-cpu-tp` bench_tp's TP=2 + SP TransformerLayer step (fake process group), on the CPU with
their GPU calls stubbed and print the three variants with their per-step counts;
`model-cpu-llama --kept` lists what a converted Llama's forward keeps for backward. In a
subprocess: the tool replaces ATen CPU kernels for its whole process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def _rows(command: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_host.py"),
                          command, "--repeats", "1", "--steps", "1"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    rows = {m[0]: [int(v) for v in m[1:]] for m in re.findall(
        r"^\s+(bf16|fp8 delayed|fp8 current)\s+[\d.]+ ms/step\s+\([\d.]+x bf16\)\s+Triton "
        r"launches\s+(\d+), _scaled_mm\s+(\d+), Python-level calls\s+(\d+)$", out, re.M)}
    assert list(rows) == ["bf16", "fp8 delayed", "fp8 current"], out
    return rows


def test_model_cpu_graphs_prints_ratios_and_counts():
    rows = _rows("model-cpu-graphs")
    # bf16's GEMMs are ATen's; FP8's (at most ops.gemm.HOST_BOUND_MACS each here: 256 tokens,
    # hidden 512) all the Triton kernel's, none cuBLASLt's
    assert rows["bf16"][1] == rows["fp8 delayed"][1] == rows["fp8 current"][1] == 0
    # 4 layers x 4 Linears x (fprop + dgrad and wgrad, one launch: small GEMMs)
    assert rows["fp8 delayed"][0] >= rows["bf16"][0] + 4 * 4 * 2
    # current scaling measures each amax before its cast: more launches than delayed
    assert rows["fp8 delayed"][0] < rows["fp8 current"][0]


def test_model_cpu_tp_prints_ratios_and_counts():
    """The TP step takes the CUDA path: its FP8 GEMMs are tensor-core calls (4 Linears, 12
    GEMMs, each at most ops.gemm.HOST_BOUND_MACS at this size: all on the Triton kernel) and
    its casts, norms, RoPE and scale updates Triton launches."""
    rows = _rows("model-cpu-tp")
    assert rows["bf16"][1] == rows["fp8 delayed"][1] == rows["fp8 current"][1] == 0
    assert rows["fp8 delayed"][0] >= rows["bf16"][0] + 12
    assert rows["bf16"][0] < rows["fp8 delayed"][0] < rows["fp8 current"][0]
    assert rows["bf16"][2] < rows["fp8 delayed"][2]


def test_model_cpu_llama_kept_lists_no_fp8_weight():
    """`model-cpu-llama --kept`: what a converted Llama's forward keeps for backward, bf16 and
    FP8. FP8 keeps less, and no fp8 copy of a GEMM weight (backward casts w8^T again; a
    LayerNormMLP's pair cast once left fc1's and fc2's w8 on the plan kept for backward)."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_host.py"),
                          "model-cpu-llama", "--kept", "--layers", "2"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    totals = dict(re.findall(r"^(bf16|fp8 delayed): ([\d.]+) MiB kept", out, re.M))
    assert list(totals) == ["bf16", "fp8 delayed"], out
    assert 0 < float(totals["fp8 delayed"]) < float(totals["bf16"])
    fp8_shapes = re.findall(r"float8_e4m3fn\s+(\(.*\))$", out, re.M)
    assert fp8_shapes, out  # the activations' fp8 transposes for wgrad
    # hidden 256, 4/2 heads of 64, ffn 1024 (swiglu: fc1 [2048, 256]), 128 tokens
    weights = {"(512, 256)", "(256, 256)", "(2048, 256)", "(256, 1024)"}
    assert not weights & set(fp8_shapes), out
    # the final norm is te.RMSNorm (HF's kept an fp32 copy of the last hidden states)
    assert not re.search(r"float32\s+\(1, 128, 256\)$", out, re.M), out
