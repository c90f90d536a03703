"""A Llama-3-8B-shaped TransformerLayer, fwd+bwd: tritium FP8 vs eager bf16 PyTorch and torchao.

Shape (issue 4, BASELINE.md): B2 x S4096 tokens, hidden 4096, 32 heads, 8 KV groups, head dim
128, ffn 14336 SwiGLU, RMSNorm, no bias, causal, RoPE. Variants, one run:
  * "bf16 eager Llama block": plain PyTorch (q/k/v/o/gate/up/down nn.Linear, fp32 RMSNorm cast
    back, rotate-half RoPE, causal SDPA with GQA), eager: the baseline;
  * the same block under torch.compile; under torchao float8 tensorwise (convert_to_float8_training)
    eager and compiled;
  * tritium TransformerLayer in bf16 and under fp8_autocast (DelayedScaling HYBRID, history 16,
    "max"; and Float8CurrentScaling).
Reported: ms, tokens/s, peak MiB with the input resident and with the input made in the step.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, measure_fwd_bwd  # noqa: E402

import tritium as te  # noqa: E402
from tritium import recipe  # noqa: E402

B, S, H, HEADS, GROUPS, FFN = 2, 4096, 4096, 32, 8, 14336
D = H // HEADS
EPS = 1e-5


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


def main():
    if not torch.cuda.is_available():
        print("bench_block needs a CUDA GPU")
        return
    x = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16)
    ref = LlamaBlock()
    ours = TritiumBlock()
    delayed = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                    amax_compute_algo="max")
    variants = [("bf16 eager Llama block", lambda: ref, None),
                ("bf16 Llama block compiled", lambda: torch.compile(ref), None),
                ("torchao fp8 tensorwise eager", lambda: _torchao(ref, False), None),
                ("torchao fp8 tensorwise compiled", lambda: _torchao(ref, True), None),
                ("tritium TransformerLayer bf16", lambda: ours, None),
                ("tritium TransformerLayer fp8 delayed", lambda: ours,
                 lambda: te.fp8_autocast(fp8_recipe=delayed)),
                ("tritium TransformerLayer fp8 current", lambda: ours,
                 lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()))]
    case = f"B{B} S{S} H{H} ffn{FFN}"
    rows = []
    for name, make, ctx in variants:
        try:
            res = measure_fwd_bwd(make(), x, dy, ctx, in_network=True)
        except Exception as exc:
            rows.append({"case": case, "variant": name, "error": repr(exc)[:400]})
            print(rows[-1], flush=True)
            continue
        rows.append({"case": case, "variant": name, "ms": res["ms"],
                     "ktok_per_s": round(B * S / res["ms"], 1), "peak_mb": res["peak_mb"],
                     "peak_mb_in_network": res["peak_mb_in_network"]})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    finish("block", rows, baseline="bf16 eager Llama block")


if __name__ == "__main__":
    main()
