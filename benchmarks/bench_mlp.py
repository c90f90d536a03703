"""LayerNormMLP (RMSNorm, swiglu) fwd+bwd: tritium FP8 and bf16 vs an eager bf16 Llama MLP.

Shape from the issue: T=8192 tokens, hidden 4096, ffn 14336, bf16, no bias. The baseline is
plain PyTorch: RMSNorm in fp32 (cast back), gate/up/down nn.Linear, SiLU, eager; also
torch.compile of it. FLOPs counted: 6*T*H*F*3 (three GEMMs, fwd+bwd). The "casts unfused" row
runs the same FP8 module with the fused norm/activation casts switched off (A/B of that fusion).
"""
from __future__ import annotations

import contextlib
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, measure_fwd_bwd  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402
from tritium.functional.fused_cast import fused_casts  # noqa: E402

T, H, F = 8192, 4096, 14336


class LlamaMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
        self.norm_weight = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=torch.bfloat16))
        self.gate = torch.nn.Linear(H, F, **kw)
        self.up = torch.nn.Linear(H, F, **kw)
        self.down = torch.nn.Linear(F, H, **kw)

    def forward(self, x):
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.norm_weight
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


@contextlib.contextmanager
def _unfused(rec):
    with fused_casts(False), te.fp8_autocast(fp8_recipe=rec):
        yield


def main():
    if not torch.cuda.is_available():
        print("bench_mlp needs a CUDA GPU")
        return
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ref = LlamaMLP()
    mlp = te.LayerNormMLP(H, F, bias=False, normalization="RMSNorm", activation="swiglu",
                          params_dtype=torch.bfloat16, device="cuda")
    delayed = recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    variants = [("bf16 eager Llama MLP", ref, None),
                ("bf16 Llama MLP compiled", torch.compile(ref), None),
                ("tritium LayerNormMLP bf16", mlp, None),
                ("tritium LayerNormMLP fp8 delayed", mlp,
                 lambda: te.fp8_autocast(fp8_recipe=delayed)),
                # A/B of the fused norm/activation casts (bit-identical results)
                ("tritium LayerNormMLP fp8 delayed, casts unfused", mlp,
                 lambda: _unfused(delayed)),
                ("tritium LayerNormMLP fp8 current", mlp,
                 lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()))]
    rows = []
    for name, module, ctx in variants:
        try:
            res = measure_fwd_bwd(module, x, dy, ctx)
        except Exception as exc:
            rows.append({"case": f"T{T} {H}->{F}", "variant": name, "error": repr(exc)})
            continue
        rows.append({"case": f"T{T} {H}->{F}", "variant": name, "ms": res["ms"],
                     "tflops": round(18 * T * H * F / res["ms"] / 1e9, 1),
                     "peak_mb": res["peak_mb"]})
        print(rows[-1], flush=True)
    finish("mlp", rows, baseline="bf16 eager Llama MLP")


if __name__ == "__main__":
    main()
