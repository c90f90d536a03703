"""`python -m tritium numerics`: the margin of error of every module against float64 PyTorch.

Design note. For each module (LayerNorm, RMSNorm, Linear, LayerNormLinear with either norm,
LayerNormMLP with RMSNorm for every activation) and each mode:

    fp32         params, input and grad_output in fp32 (TF32 off)
    bf16, fp16   params, input and grad_output in that dtype
    fp8 delayed  bf16 params, under fp8_autocast(DelayedScaling(amax_history_len=16)); three
                 warm-up steps on fresh data of the same distribution settle the scales, the
                 fourth step is measured (so the scales come from other batches, as in training)
    fp8 current  bf16 params, under fp8_autocast(Float8CurrentScaling())
    fp8 block    bf16 params, under fp8_autocast(Float8BlockScaling()) (1x128 / 128x128 blocks,
                 E4M3 in both passes)
    fp8 mxfp8    bf16 params, under fp8_autocast(MXFP8BlockScaling()) (emulated)

one forward and one backward run, and the output and EVERY gradient (input and each parameter)
is compared with a reference computed in float64 by plain torch ops (F.layer_norm, the RMSNorm
formula, F.linear, the activation formulas written out below) from the very same values: the
parameters, input and grad_output as the module saw them (already rounded to the mode's dtype).
So a table entry is the error of the module's arithmetic alone, and for FP8 it is the total
error (quantization of GEMM operands plus the bf16 roundings), not the distance to bf16.

Error measures, per tensor: abs = max|a - r|; rel = max|a - r| / max|r| (the largest error over
the largest reference value, not the elementwise max |a - r| / |r|, which near zeros of r is
meaningless). Every entry is the max over seeds. Data: x ~ N(0, 1), grad_output ~ N(0, 1),
GEMM weights ~ N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1), biases 0.1 N(0, 1), drawn on the
CPU from a seeded generator, so every device measures the same numbers' errors.

LayerNorm and RMSNorm have no FP8 path: under fp8_autocast they run in bf16, and their FP8
rows equal the bf16 row. The last GEMM's bias gradient is the sum of the unquantized
grad_output in FP8 too, so it also equals bf16's.

Two effects make some entries large without an arithmetic error; INTRO (the text heading
docs/numerics.md) explains them: relu/reglu's derivative jumps at 0, so the module's rounding of
the norm output flips a few elements of fc1's gradient; and delayed scaling saturates a batch
whose amax exceeds the history (srelu's heavy-tailed gradient at --quick shapes).

Use `measure(...)` for the numbers and `render(...)` for the markdown; `main(args)` is the CLI.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import tritium as te
from .ref.activation import ACTIVATIONS

MODES = ("fp32", "bf16", "fp16", "fp8 delayed", "fp8 current", "fp8 block", "fp8 mxfp8")
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
         "fp8 delayed": torch.bfloat16, "fp8 current": torch.bfloat16,
         "fp8 block": torch.bfloat16, "fp8 mxfp8": torch.bfloat16}
WARMUP_STEPS = 3  # fp8 delayed: steps before the measured one
EPS = 1e-5


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq: int
    hidden: int
    ffn: int

    def __str__(self) -> str:
        return (f"input [{self.batch}, {self.seq}, hidden={self.hidden}], "
                f"ffn={self.ffn} (Linear: {self.hidden} -> {self.ffn})")


FULL = Shapes(2, 256, 512, 1024)
QUICK = Shapes(2, 64, 64, 128)


# float64 references: plain torch ops, written from the formulas, not from tritium's code.
def _ln(x, P, w="weight", b="bias"):
    return F.layer_norm(x, (x.shape[-1],), P[w], P[b], EPS)


def _rms(x, P, w="weight"):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * P[w]


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


_BASE = {"gelu": _gelu_tanh, "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
         "relu": torch.relu, "srelu": lambda x: torch.relu(x) ** 2,
         "silu": lambda x: x * torch.sigmoid(x), "sigmoid": torch.sigmoid}
_GATE_OF = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
            "swiglu": "silu", "glu": "sigmoid"}  # gated: FIRST half through it, SECOND multiplies


def _act(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind not in _GATE_OF:
        return _BASE[kind](h)
    a, b = h.chunk(2, dim=-1)
    return _BASE[_GATE_OF[kind]](a) * b


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # (dtype, device) -> module
    ref: Callable    # (x float64, params dict float64) -> out float64
    wide: bool = False  # the output has ffn features (Linear, LayerNormLinear), else hidden


def cases(shapes: Shapes) -> list[Case]:
    H, Fh = shapes.hidden, shapes.ffn
    if set(ACTIVATIONS) != set(_BASE) - {"sigmoid"} | set(_GATE_OF):
        raise RuntimeError("tritium's activation list changed: add the new formula here")
    out = [
        Case("LayerNorm", lambda dt, d: te.LayerNorm(H, params_dtype=dt, device=d), _ln),
        Case("RMSNorm", lambda dt, d: te.RMSNorm(H, params_dtype=dt, device=d), _rms),
        Case("Linear", lambda dt, d: te.Linear(H, Fh, params_dtype=dt, device=d),
             lambda x, P: F.linear(x, P["weight"], P["bias"]), wide=True),
    ]
    for norm, f in (("LayerNorm", lambda x, P: _ln(x, P, "layer_norm_weight", "layer_norm_bias")),
                    ("RMSNorm", lambda x, P: _rms(x, P, "layer_norm_weight"))):
        out.append(Case(f"LayerNormLinear ({norm})",
                        lambda dt, d, n=norm: te.LayerNormLinear(
                            H, Fh, normalization=n, params_dtype=dt, device=d),
                        lambda x, P, f=f: F.linear(f(x, P), P["weight"], P["bias"]), wide=True))
    for kind in ACTIVATIONS:
        def ref(x, P, kind=kind):
            h = F.linear(_rms(x, P, "layer_norm_weight"), P["fc1_weight"], P["fc1_bias"])
            return F.linear(_act(kind, h), P["fc2_weight"], P["fc2_bias"])
        out.append(Case(f"LayerNormMLP ({kind}, RMSNorm)",
                        lambda dt, d, k=kind: te.LayerNormMLP(
                            H, Fh, normalization="RMSNorm", activation=k, params_dtype=dt,
                            device=d), ref))
    return out


def _master_params(module: torch.nn.Module, gen: torch.Generator) -> dict:
    params = {}
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.dim() == 2:
            params[name] = r / math.sqrt(p.shape[1])
        elif name.endswith("weight"):
            params[name] = 1 + 0.1 * r
        else:
            params[name] = 0.1 * r
    return params


def _run_module(case, mode, master, batches, device):
    """Output and grads (input, then each parameter) of the last batch in `batches`."""
    dt = DTYPE[mode]
    m = case.build(dt, device)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(master[n].to(device=device, dtype=dt))
    recipe = {"fp8 delayed": te.recipe.DelayedScaling(amax_history_len=16),
              "fp8 current": te.recipe.Float8CurrentScaling(),
              "fp8 block": te.recipe.Float8BlockScaling(),
              "fp8 mxfp8": te.recipe.MXFP8BlockScaling()}.get(mode)
    for x, dy in batches:
        xi = x.to(device=device, dtype=dt).clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = m(xi)
        out.backward(dy.to(device=device, dtype=dt))
    return {"out": out.detach(), "x": xi.grad, **{n: p.grad for n, p in m.named_parameters()}}


def _reference(case, master, x, dy, dt, device):
    P = {n: t.to(dt).to(device=device, dtype=torch.float64).clone().requires_grad_()
         for n, t in master.items()}
    xr = x.to(dt).to(device=device, dtype=torch.float64).clone().requires_grad_()
    out = case.ref(xr, P)
    out.backward(dy.to(dt).to(device=device, dtype=torch.float64))
    return {"out": out.detach(), "x": xr.grad, **{n: p.grad for n, p in P.items()}}


def _errors(got: dict, ref: dict) -> dict:
    res = {}
    for k, r in ref.items():
        d = (got[k].double() - r).abs().max().item()
        res[k] = (d, d / max(r.abs().max().item(), 1e-300))
    return res


def _worst(u: float, v: float) -> float:
    """max that keeps a NaN (Python's max(nan, x) depends on the argument order)."""
    return math.nan if math.isnan(u) or math.isnan(v) else max(u, v)


def measure(device="cpu", seeds: int = 3, shapes: Shapes = FULL, names=None, modes=MODES,
            log=None) -> dict:
    """{module name: {mode: {tensor: (max abs, max rel)}}}, each the max over `seeds` seeds.
    `names` picks modules by Case.name (default: all)."""
    device = torch.device(device)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    results = {}
    try:
        for case in cases(shapes):
            if names is not None and case.name not in names:
                continue
            t0, table = time.perf_counter(), {mode: {} for mode in modes}
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(1000 * seed + 17)
                master = _master_params(case.build(torch.float32, "cpu"), gen)
                shape = (shapes.batch, shapes.seq, shapes.hidden)
                dy_shape = (*shape[:-1], shapes.ffn if case.wide else shapes.hidden)
                batches = [(torch.randn(shape, generator=gen), torch.randn(dy_shape, generator=gen))
                           for _ in range(WARMUP_STEPS + 1)]
                refs = {}
                for mode in modes:
                    dt = DTYPE[mode]
                    if dt not in refs:
                        refs[dt] = _reference(case, master, *batches[-1], dt, device)
                    run = batches if mode == "fp8 delayed" else batches[-1:]
                    errs = _errors(_run_module(case, mode, master, run, device), refs[dt])
                    for k, (a, r) in errs.items():
                        a0, r0 = table[mode].get(k, (0.0, 0.0))
                        table[mode][k] = (_worst(a, a0), _worst(r, r0))
            results[case.name] = table
            if log:
                log(f"{case.name}: {time.perf_counter() - t0:.1f} s")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
    return results


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"CPU: {name} ({torch.get_num_threads()} threads)"


def _fmt(v: float) -> str:
    return "0" if v == 0 else f"{v:.2e}"


def render(results: dict, device, seeds: int, shapes: Shapes, seconds: float,
           intro: str = "", appendix: str = "") -> str:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = "not installed"
    lines = ["# Numerics: the margin of error of every module", "",
             "Generated by `python -m tritium numerics`; do not edit by hand "
             "(rerun it after changing the math).", "",
             f"- device: {device_name(device)}",
             f"- torch {torch.__version__}, triton {triton_version}, Python "
             f"{platform.python_version()}; TF32 off",
             f"- date: {datetime.date.today().isoformat()}; measured in {seconds:.0f} s",
             f"- shapes: {shapes}; eps {EPS}",
             f"- seeds: {seeds} (each entry is the max over seeds)", ""]
    if intro:
        lines += [intro.strip(), ""]
    modes = list(next(iter(results.values())).keys()) if results else []
    lines += ["## Summary: max rel of the output / worst max rel over all gradients", "",
              "| module | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name, table in results.items():
        cells = [f"{_fmt(table[m]['out'][1])} / "
                 f"{_fmt(max(r for k, (_, r) in table[m].items() if k != 'out'))}" for m in modes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, table in results.items():
        cols = list(next(iter(table.values())).keys())
        head = ["output" if c == "out" else "grad input" if c == "x" else f"grad {c}"
                for c in cols]
        lines += ["", f"## {name}", "", "Each cell: max abs / max rel.", "",
                  "| mode | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
        for mode, errs in table.items():
            lines.append(f"| {mode} | " + " | ".join(
                f"{_fmt(errs[c][0])} / {_fmt(errs[c][1])}" for c in cols) + " |")
    if appendix:
        lines += ["", appendix.strip()]
    return "\n".join(lines) + "\n"


CP_TABLE = "cp_accuracy_gpu.md"   # next to the output file: the measured multi-GPU table


def cp_appendix(out_path: str) -> str:
    """The context-parallel section: the multi-GPU tables (CP_TABLE; this command cannot
    remeasure them) and how to read them; empty when the file is missing."""
    path = os.path.join(os.path.dirname(os.path.abspath(out_path)), CP_TABLE)
    if not os.path.exists(path):
        return ""
    table = "\n".join(line for line in open(path).read().splitlines()
                      if not line.startswith("<!--")).strip()
    return CP_INTRO + "\n" + table + "\n"


LCE_TABLE = "lce_accuracy.md"   # next to the output file: written by scripts/lce_accuracy.py


def lce_appendix(out_path: str) -> str:
    """The linear_cross_entropy section (LCE_TABLE, measured by its own script); empty when
    the file is missing."""
    path = os.path.join(os.path.dirname(os.path.abspath(out_path)), LCE_TABLE)
    return open(path).read() if os.path.exists(path) else ""


OUTLIER_MODES = ("bf16", "fp8 delayed", "fp8 current", "fp8 block", "fp8 mxfp8")


def outlier_appendix(seeds: int = 3, tokens: int = 512, k: int = 512, n: int = 1024) -> str:
    """Per-token error of a Linear on tokens whose magnitudes span 10^6 (each row of x and of
    grad_output scaled by 10^(6u - 3), u uniform), each mode against float64: the mean over
    tokens of |y_t - r_t| / |r_t| (L2 norms per row) for the output and the input gradient, and
    the max rel of the weight gradient. CPU, deterministic seeds; a few seconds."""
    rows = {mode: [0.0, 0.0, 0.0] for mode in OUTLIER_MODES}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(7000 + seed)
        w = torch.randn(n, k, generator=gen) / math.sqrt(k)

        def spread(rows, cols):   # N(0, 1) rows times 10^(6u - 3)
            return (torch.randn(rows, cols, generator=gen)
                    * 10 ** (6 * torch.rand(rows, 1, generator=gen) - 3))
        data = [(spread(tokens, k), spread(tokens, n)) for _ in range(WARMUP_STEPS + 1)]
        for mode in OUTLIER_MODES:
            m = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cpu")
            with torch.no_grad():
                m.weight.copy_(w)
            recipe = {"fp8 delayed": te.recipe.DelayedScaling(amax_history_len=16),
                      "fp8 current": te.recipe.Float8CurrentScaling(),
                      "fp8 block": te.recipe.Float8BlockScaling(),
                      "fp8 mxfp8": te.recipe.MXFP8BlockScaling()}.get(mode)
            for x, dy in (data if mode == "fp8 delayed" else data[-1:]):
                xi = x.bfloat16().requires_grad_()
                m.weight.grad = None
                with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                    y = m(xi)
                y.backward(dy.bfloat16())
            xd, dyd, wd = xi.detach().double(), dy.bfloat16().double(), m.weight.detach().double()
            ref_y, ref_dx, ref_dw = xd @ wd.t(), dyd @ wd, dyd.t() @ xd

            def per_token(a, r):
                return ((a.double() - r).norm(dim=1) / r.norm(dim=1)).mean().item()
            errs = (per_token(y.detach(), ref_y), per_token(xi.grad, ref_dx),
                    ((m.weight.grad.double() - ref_dw).abs().max() / ref_dw.abs().max()).item())
            rows[mode] = [max(a, b) for a, b in zip(rows[mode], errs)]
    lines = [OUTLIER_INTRO.format(tokens=tokens, k=k, n=n, seeds=seeds),
             "| mode | output (mean per token) | grad input (mean per token) "
             "| grad weight (max rel) |", "|---|---|---|---|"]
    lines += [f"| {mode} | " + " | ".join(_fmt(v) for v in vals) + " |"
              for mode, vals in rows.items()]
    return "\n".join(lines) + "\n"


OUTLIER_INTRO = """\
## Outlier-heavy tokens: Linear, per-token error

Tokens whose magnitudes span 10^6: each row of the input and of grad_output is N(0, 1) times
10^(6u - 3), u uniform, as a few huge and many tiny activations do. Linear {k} -> {n}, {tokens}
tokens, bf16 params; each entry is the mean over tokens of |a_t - r_t| / |r_t| (row norms)
against float64 from the same bf16 values, the worst of {seeds} seeds (weight gradient: max rel
as above). One scale per tensor serves the largest tokens and flushes the small ones toward
FP8's underflow (delayed and current scaling; their input gradients lose less, grad_output being
E5M2 with its wider range under HYBRID); 1x128 tiles (Float8BlockScaling) and 32-element
blocks (MXFP8, emulated) scale every token on its own, so their per-token error stays at the
well-scaled level. Measured on the CPU (the GPU's block GEMM differs only in summation order).
"""


CP_INTRO = f"""\
## Context-parallel attention vs single-device attention (2, 4 and 8 GPUs)

Not remeasured by this command (it needs several GPUs): copied from `docs/{CP_TABLE}`, written
by `scripts/cp_accuracy.py --gpu --no-cpu --seq 8192 32768` (cp=2, 12 heads) and
`benchmarks/bench_cp_scale.py` (cp=2 and 4 on 4 GPUs, cp=8 on 8, a 2-head slice); see
`docs/context_parallel.md` for the CPU/gloo tables (cp=2, 4, 8) and the speed of each mode.
Each cell: max abs error vs an fp64 reference (as a multiple of single-GPU bf16 cuDNN's; the
cp=2 tables also the root-mean-square error's multiple: a bf16 output's max error is one
element's rounding) | fraction of elements outside fp32 tolerance of fp64 / fraction differing
from the single-GPU result beyond it. **exact** blocks return fp32 partials (Triton flash
kernel, split products); **fp32 partials** blocks too, with P / dS rounded once as cuDNN's (the
Gluon kernels on Hopper); **fast** blocks are cuDNN's bf16 partials; **fp32 acc** sums partials
in fp32 and rounds once. Exact + fp32 accumulation stays within 1.1x of single-device error on
every tensor at cp=2, 4 and 8 (rms 0.68-0.78x at cp=2); fp32 partials errs as single device
(rms 0.98-1.00x); fast mode costs dk/dv up to ~1.75x (rms 1.23-1.25x), and at cp=4 and 8
16-bit accumulation moves more elements off the single-device result than fp32.
"""


INTRO = """\
How to read it. Each module runs one forward and one backward pass in each mode, and the output
and every gradient (the input's, then each parameter's, by TE's parameter names) are compared
with a float64 computation in plain PyTorch from the same parameter values, input and
grad_output (rounded to the mode's dtype first, so only the module's arithmetic is measured; for
FP8 the table shows the total FP8 error, not the distance to bf16). A cell is `abs / rel`, where
max rel = max|a - r| / max|r| over the whole tensor: the largest error relative to the tensor's
scale, not an elementwise ratio (meaningless next to zeros of r). Every entry is the worst over
the seeds. The summary gives the output's max rel and the worst max rel over all gradients.

What dominates each mode. **fp32**: accumulation order only, below 1e-6 relative (TF32 is off;
with it on, fp32 matmuls on a GPU err by about 1e-3). **bf16 / fp16**: norms and activations
compute in fp32 and round once at the end, GEMMs accumulate in fp32, so the error is about one
rounding of each op's output, at most 2^-8 = 3.9e-3 of a value in bf16 (8 significant bits) and
2^-11 = 4.9e-4 in fp16 (11 bits); roundings of intermediates (the norm's output, fc1's, the
activation's) that feed the next GEMM add up to about twice that in LayerNormMLP. **FP8**: the
quantization of GEMM operands dominates: input and weight in E4M3 in the forward (4 significant
bits: up to 6% per element, partly averaging out over a dot product), grad_output in E5M2 in the
backward (3 bits: up to 12.5%), so gradients err more than the output: about 4-8% of max for
outputs, 7-16% for gradients here (relu and reglu aside, below). Current scaling fits each
tensor's own amax. Delayed scaling takes the scale from the amax history of earlier batches
(margin 0), so a batch whose amax exceeds the history's saturates there: rare and small for
Gaussian-like tensors at these shapes, larger for heavy-tailed ones (at `--quick` shapes one
seed of srelu clipped fc1's grad_output from an amax of 22.4 to the history's 13.7 and the input
gradient erred by 45%). LayerNorm and RMSNorm have no FP8 GEMM, so their FP8 rows are the bf16
computation; so is the last GEMM's bias gradient (a sum of the unquantized grad_output).
**fp8 block** (Float8BlockScaling: 1x128 tiles for inputs and gradients, 128x128 weight
blocks, E4M3 in both passes) fits every tile's own amax and keeps gradients in E4M3: its
outputs err like the tensorwise recipes' and its gradients less (about 4-9% here). **fp8
mxfp8** (MXFP8BlockScaling, emulated) uses 32-element blocks with OCP's power-of-2 scale
2^(floor(log2 amax) - 8), under which a block's largest values can saturate at 448 (up to
12.5% low): its errors sit a little above block scaling's. On the Gaussian data here one scale
per tensor loses little; the outlier table at the end shows where block scales matter.

relu and reglu: their derivative jumps at 0. The module rounds the norm's output to the mode's
dtype before fc1 (the reference does not), which moves a few pre-activations next to 0 across it
(a few dozen of 524288 in one fp16 run); each flips one entry of fc1's grad_output between 0 and
O(1), so the gradients of the input, the norm weight and fc1 differ from the reference by 10-13%
of their max in fp16 and up to 26% in bf16. That is the derivative taken at a point one rounding
away, not an arithmetic error: against a reference that rounds the norm's output the same way
the fp16 error falls to the usual 3e-4 to 6e-4. srelu's derivative is continuous and has no such
jump. A Llama port's 16-bit numbers also differ from Hugging Face's for the reasons in
`docs/porting.md`. Context-parallel attention's error against single-device attention (fp32
accumulation on and off, exact and fast blocks) is at the end, measured on 2 and 4 GPUs; the
CPU/gloo tables are in `docs/context_parallel.md`.
"""


# --- FP8 attention (recipe fp8_dpa) -----------------------------------------------------------
# (b, s, h, h_kv, d, mask, layout)
ATTN_SHAPES = ((2, 128, 4, 2, 64, "causal", "bshd"), (1, 256, 2, 2, 128, "no_mask", "sbhd"),
               (2, 96, 4, 1, 128, "causal", "bshd"))
ATTN_MODES = ("bf16", "fp8 delayed", "fp8 current", "fp8_mha delayed")


def _attn_data(shape, gen):
    b, s, h, h_kv, d, _, layout = shape

    def one(heads):
        x = torch.randn(b, s, heads, d, generator=gen).to(torch.bfloat16)
        return x.transpose(0, 1).contiguous() if layout == "sbhd" else x
    return one(h), one(h_kv), one(h_kv), torch.randn(
        *(one(h).shape[:-2]), h * d, generator=gen).to(torch.bfloat16)


def _attn_run(module, q, k, v, dy, recipe=None) -> dict:
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(q, k, v)
    out.backward(dy.to(out.dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_fp8_errors(shapes=ATTN_SHAPES, seed: int = 0) -> dict:
    """{(shape, mode): {tensor: (max rel, mean rel)}} of DotProductAttention vs float64 on the
    same bf16 inputs: bf16 attention, and FP8 attention (fp8_dpa) under delayed scaling (after
    WARMUP_STEPS steps on fresh data of the same distribution) and current scaling, and
    fp8_mha under delayed scaling (its output: the E4M3 values the projection takes). max rel =
    max|a - r| / max|r|, mean rel = mean|a - r| / mean|r|. CPU: the FP8 emulation."""
    from .attention import DotProductAttention
    from .fp8 import recipe as R
    rows = {}
    for shape in shapes:
        b, s, h, h_kv, d, mask, layout = shape
        gen = torch.Generator().manual_seed(seed + s + d)
        m = DotProductAttention(h, d, num_gqa_groups=h_kv, qkv_format=layout,
                                attn_mask_type=mask)
        q, k, v, dy = _attn_data(shape, gen)
        exact = _attn_run(m, *(x.double() for x in (q, k, v)), dy.double())
        delayed = R.DelayedScaling(fp8_dpa=True, amax_history_len=16)
        mha = R.DelayedScaling(fp8_mha=True, amax_history_len=16)
        for _ in range(WARMUP_STEPS):   # the q/k/v state and fp8_mha's output state
            _attn_run(m, *_attn_data(shape, gen), mha)
        recipes = {"bf16": None, "fp8 delayed": delayed,
                   "fp8 current": R.Float8CurrentScaling(fp8_dpa=True), "fp8_mha delayed": mha}
        for mode in ATTN_MODES:
            got = _attn_run(m, q, k, v, dy, recipes[mode])
            rows[(shape, mode)] = {
                n: (((got[n].double() - r).abs().max() / r.abs().max()).item(),
                    ((got[n].double() - r).abs().mean() / r.abs().mean()).item())
                for n, r in exact.items()}
    return rows


def attention_fp8_appendix(seed: int = 0) -> str:
    """The FP8 attention section of docs/numerics.md (CPU emulation; a few seconds)."""
    lines = ["## DotProductAttention: bf16 vs FP8 attention (fp8_dpa, fp8_mha)", "",
             ATTN_INTRO.strip(),
             "",
             "| shape (b, s, h, h_kv, d, mask, layout) | mode | output | grad q | grad k | "
             "grad v |", "|---|---|---|---|---|---|"]
    for (shape, mode), errs in attention_fp8_errors(seed=seed).items():
        b, s, h, h_kv, d, mask, layout = shape
        cells = " | ".join(f"{_fmt(mx)} / {_fmt(mean)}" for mx, mean in errs.values())
        lines.append(f"| {b}, {s}, {h}, {h_kv}, {d}, {mask}, {layout} | {mode} | {cells} |")
    lines += ["", ATTN_NOTE.strip()]
    return "\n".join(lines) + "\n"


ATTN_INTRO = """
Against float64 attention of the same bf16 inputs (q, k, v, dO ~ N(0, 1)), on the CPU, where
the FP8 path is the emulation `torch_fp8`: the Triton kernel's math, except that P is quantized
against the exact row max instead of the running one. FP8: q, k, v per-tensor E4M3 (delayed:
after 3 warm-up steps on fresh data; current: this call's amax), P in E4M3 with the fixed
scale 448, backward in bf16 from the dequantized q, k, v. Each cell: max rel / mean rel
(max|a - r| / max|r|, mean|a - r| / mean|r|). E4M3's unit roundoff is u = 2^-4 = 6.25e-2:
tests/test_fp8_attention.py holds FP8 below 2u (max) and u (mean), bf16 below 2^-7 and 2^-8.
"""

ATTN_NOTE = """
FP8 attention's backward is bf16 (the flash backward on the dequantized q, k, v with the
forward's out and lse). TE's FP8 backward also quantizes dO and dS; this one does not: accuracy
first, and the speed target (issue 26) is the forward. Its gradients carry the error of the
quantized q, k, v (and of out, through rowsum(dO * out)), not that of FP8 backward products.
The Triton kernel quantizes P against the running row max of its key tile (the CPU emulation
against the exact one): that changes which values round where, not the size of the error;
tests/interp/test_flash_attention_fp8_kernel.py holds the kernel to its twin.

"fp8_mha delayed" measures the E4M3 output the output projection takes (fp8_mha: the fp32
output rounded once at the delayed output scale); its gradients are fp8_dpa's. Its mean error
adds the output's E4M3 rounding to the attention's; its max adds saturation where this call's
output exceeds the amax history of the warm-up steps (a delayed scale's known limit: in the
sbhd row the warm-up's output amax was 0.616, this call's 0.726, which saturates to 448 / scale).
Under fp8_dpa the projection's own delayed-scaling cast of the 16-bit output rounds and
saturates the same way; the fp8_dpa rows stop before it.
"""


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda given but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("--seeds must be >= 1", file=sys.stderr)
        return 2
    shapes = QUICK if args.quick else FULL
    print(f"tritium numerics on {device_name(device)}: {shapes}, {args.seeds} seeds", flush=True)
    t0 = time.perf_counter()
    results = measure(device, args.seeds, shapes, log=lambda s: print(s, flush=True))
    seconds = time.perf_counter() - t0
    text = render(results, device, args.seeds, shapes, seconds, INTRO,
                  outlier_appendix() + "\n" + attention_fp8_appendix() + "\n"
                  + cp_appendix(args.out) + "\n" + lce_appendix(args.out))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({seconds:.1f} s)")
    return 0
