"""TE's getting-started flow, written for tritium: one transformer layer, six ways.

    1. plain PyTorch (nn.Linear, nn.LayerNorm, a hand-written attention)
    2. te.Linear + te.LayerNorm in place of the torch modules
    3. + te.DotProductAttention
    4. the same under te.fp8_autocast(DelayedScaling(HYBRID, amax_history_len=16, "max"))
    5. te.LayerNormLinear + te.LayerNormMLP (norms fused into the GEMM modules), FP8
    6. te.TransformerLayer, FP8
Each step is timed forward+backward and checked against step 1 (same weights). On a GPU the
sizes are TE's tutorial (hidden 4096, ffn 16384, 32 heads, seq 2048, batch 8, bf16); on a CPU a
small layer in fp32 (FP8 GEMMs are emulated there: exact FP8 values, fp32 products).

    python examples/getting_started.py [--device cpu|cuda] [--small]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import tritium as te
from tritium import recipe


class Attention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, inputs [s, b, h, d] (TE's sbhd)."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, q, k, v):
        s, b, h, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.float().masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype)
        return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, h * d)


class BasicMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, linear):
        super().__init__()
        self.fc1, self.fc2 = linear(hidden, ffn), linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class BasicTransformerLayer(torch.nn.Module):
    """Pre-LN block: x + proj(attn(qkv(ln1(x)))), then + mlp(ln2(.)). `linear`, `norm` and
    `attention` pick the implementation of each part (torch or tritium)."""

    def __init__(self, hidden, ffn, heads, linear, norm, attention):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = norm(hidden), norm(hidden)
        self.qkv, self.proj = linear(hidden, 3 * hidden), linear(hidden, hidden)
        self.attention = attention
        self.mlp = BasicMLP(hidden, ffn, linear)

    def forward(self, x):
        s, b, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, self.heads, 3 * hidden // self.heads).chunk(3, -1)
        x = x + self.proj(self.attention(q, k, v))
        return x + self.mlp(self.ln2(x))


class FusedTransformerLayer(torch.nn.Module):
    """Step 5: te.LayerNormLinear for ln1 + qkv, te.LayerNormMLP for ln2 + the MLP."""

    def __init__(self, hidden, ffn, heads, device, dtype):
        super().__init__()
        kw = dict(device=device, params_dtype=dtype)
        self.heads = heads
        self.ln_qkv = te.LayerNormLinear(hidden, 3 * hidden, **kw)
        self.proj = te.Linear(hidden, hidden, **kw)
        self.attention = te.DotProductAttention(heads, hidden // heads, attention_dropout=0.0)
        self.ln_mlp = te.LayerNormMLP(hidden, ffn, activation="gelu", **kw)

    def forward(self, x):
        s, b, hidden = x.shape
        q, k, v = self.ln_qkv(x).view(s, b, self.heads, 3 * hidden // self.heads).chunk(3, -1)
        x = x + self.proj(self.attention(q, k, v))
        return x + self.ln_mlp(x)


def copy_weights(dst: torch.nn.Module, src: BasicTransformerLayer) -> None:
    """Give every variant step 1's weights (names differ between the fused modules)."""
    with torch.no_grad():
        if isinstance(dst, BasicTransformerLayer):
            dst.load_state_dict(src.state_dict(), strict=False)
            return
        if isinstance(dst, FusedTransformerLayer):
            ln_qkv, ln_mlp = dst.ln_qkv, dst.ln_mlp
            proj = dst.proj
        else:  # te.TransformerLayer (fuse_qkv_params, not interleaved: rows [q; k; v] per head)
            ln_qkv, ln_mlp = dst.self_attention.layernorm_qkv, dst.layernorm_mlp
            proj = dst.self_attention.proj
        ln_qkv.layer_norm_weight.copy_(src.ln1.weight)
        ln_qkv.layer_norm_bias.copy_(src.ln1.bias)
        qkv_w, qkv_b = src.qkv.weight, src.qkv.bias
        if not isinstance(dst, FusedTransformerLayer):  # per-head [q k v] -> [all q; all k; all v]
            h, d = src.heads, src.qkv.weight.shape[1] // src.heads
            qkv_w = qkv_w.view(h, 3, d, -1).transpose(0, 1).reshape(qkv_w.shape)
            qkv_b = qkv_b.view(h, 3, d).transpose(0, 1).reshape(qkv_b.shape)
        ln_qkv.weight.copy_(qkv_w)
        ln_qkv.bias.copy_(qkv_b)
        proj.weight.copy_(src.proj.weight)
        proj.bias.copy_(src.proj.bias)
        ln_mlp.layer_norm_weight.copy_(src.ln2.weight)
        ln_mlp.layer_norm_bias.copy_(src.ln2.bias)
        ln_mlp.fc1_weight.copy_(src.mlp.fc1.weight)
        ln_mlp.fc1_bias.copy_(src.mlp.fc1.bias)
        ln_mlp.fc2_weight.copy_(src.mlp.fc2.weight)
        ln_mlp.fc2_bias.copy_(src.mlp.fc2.bias)


def time_step(model, x, dy, fp8_recipe, device, iters):
    def step():
        x.grad = None
        if fp8_recipe is None:
            out = model(x)
        else:
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = model(x)
        out.backward(dy)
        return out
    for _ in range(2):
        out = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3, out.detach()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="CPU-sized layer on any device")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    hidden, ffn, heads, seq, batch = (128, 512, 4, 64, 2) if small else (4096, 16384, 32, 2048, 8)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    iters = args.iters or (3 if small else 10)
    torch.manual_seed(0)
    kw = dict(device=device, params_dtype=dtype)

    def te_linear(i, o):
        return te.Linear(i, o, **kw)

    def te_norm(n):
        return te.LayerNorm(n, **kw)

    def torch_linear(i, o):
        return torch.nn.Linear(i, o, device=device, dtype=dtype)

    def torch_norm(n):
        return torch.nn.LayerNorm(n, eps=1e-5, device=device, dtype=dtype)

    fp8 = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                amax_compute_algo="max")
    base = BasicTransformerLayer(hidden, ffn, heads, torch_linear, torch_norm, Attention(heads))
    te_dpa = te.DotProductAttention(heads, hidden // heads, attention_dropout=0.0)
    steps = [
        ("1. plain PyTorch", lambda: base, None),
        ("2. te.Linear + te.LayerNorm", lambda: BasicTransformerLayer(
            hidden, ffn, heads, te_linear, te_norm, Attention(heads)), None),
        ("3. + te.DotProductAttention", lambda: BasicTransformerLayer(
            hidden, ffn, heads, te_linear, te_norm, te_dpa), None),
        ("4. + fp8_autocast (delayed)", lambda: BasicTransformerLayer(
            hidden, ffn, heads, te_linear, te_norm, te_dpa), fp8),
        ("5. LayerNormLinear + LayerNormMLP, FP8", lambda: FusedTransformerLayer(
            hidden, ffn, heads, device, dtype), fp8),
        ("6. te.TransformerLayer, FP8", lambda: te.TransformerLayer(
            hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
            fuse_qkv_params=True, qkv_weight_interleaved=False, **kw), fp8),
    ]
    x = torch.randn(seq, batch, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(seq, batch, hidden, device=device, dtype=dtype)
    print(f"{device.type}: hidden {hidden}, ffn {ffn}, heads {heads}, seq {seq}, batch {batch}, "
          f"{dtype}" + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    print(f"{'step':<42} {'fwd+bwd ms':>10} {'speedup':>8} {'rel. err vs 1':>14}")
    ref_ms = ref_out = None
    for name, make, fp8_recipe in steps:
        model = make()
        if model is not base:
            copy_weights(model, base)
        ms, out = time_step(model, x, dy, fp8_recipe, device, iters)
        if ref_out is None:
            ref_ms, ref_out = ms, out.float()
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        print(f"{name:<42} {ms:10.2f} {ref_ms / ms:7.2f}x {err:14.2e}")
        del model


if __name__ == "__main__":
    main()
