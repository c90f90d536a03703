"""Usage: python scripts/lce_accuracy.py [--device cpu|cuda] [--tokens T] [--hidden H] [--vocab V]
       [--chunk C] [--out FILE]

The accuracy of linear_cross_entropy (bf16, and with the FP8 lm_head) against float64.

Writes the markdown section docs/lce_accuracy.md, which `python -m tritium numerics` appends to
docs/numerics.md. Data (drawn on the CPU from seeded generators, so every device measures the
same numbers' errors): hidden ~ N(0, 1) (what a final RMSNorm gives), weight ~ N(0, s^2 / H)
with s the logits' standard deviation (1: an untrained model's flat softmax; 4: a peaked one),
targets drawn from the softmax of the fp64 logits (so the loss is about the entropy, as for a
trained model), 1 in 16 targets ignored, both rounded to bf16 first. The reference is float64
autograd on the same bf16 values (materialized logits, F.cross_entropy); errors: the loss's
relative error, and for dhidden and dweight max|a - r| / max|r| and ||a - r|| / ||r||.
Rows: HF's way (bf16 lm_head output, .float(), F.cross_entropy), tritium bf16, tritium with
the FP8 lm_head (HYBRID: E4M3 forward, E5M2 dlogits; hidden and weight scaled once per call by
their amax, dlogits by their bound), in chunks of `--chunk` tokens. On a CPU the FP8 GEMMs are emulated (the same quantized values, fp32 products).

    python scripts/lce_accuracy.py [--device cuda] [--tokens 1024 --hidden 1024 --vocab 16384]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import tritium as te
from tritium import recipe


def _errs(loss, dh, dw, ref):
    rl, rdh, rdw = ref
    out = [abs(loss.double().item() - rl.item()) / abs(rl.item())]
    for a, r in ((dh, rdh), (dw, rdw)):
        d = a.double() - r
        out += [(d.abs().max() / r.abs().max()).item(), (d.norm() / r.norm()).item()]
    return out


def measure(tokens, hidden, vocab, std, chunk, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * std / hidden ** 0.5).bfloat16()
    logits64 = h.double() @ w.double().t()
    t = torch.multinomial(torch.softmax(logits64, -1).float(), 1, generator=g).squeeze(1)
    t[::16] = -100
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref_loss = F.cross_entropy(hd @ wd.t(), t)
    ref_loss.backward()
    ref = (ref_loss.detach(), hd.grad, wd.grad)
    h, w, t = h.to(device), w.to(device), t.to(device)
    rows = {}

    def run(name, fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward()
        rows[name] = _errs(loss.cpu(), hh.grad.cpu(), ww.grad.cpu(), ref)

    run("HF: bf16 logits, F.cross_entropy(logits.float())",
        lambda hh, ww: F.cross_entropy((hh @ ww.t()).float(), t))
    run("tritium linear_cross_entropy, bf16",
        lambda hh, ww: te.linear_cross_entropy(hh, ww, t, chunk_size=chunk))

    def fp8(hh, ww):
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            return te.linear_cross_entropy(hh, ww, t, chunk_size=chunk, fp8=True)
    run("tritium linear_cross_entropy, FP8 lm_head", fp8)
    return ref[0].item(), rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                 "lce_accuracy.md"))
    a = p.parse_args()
    start = time.time()
    dev = torch.device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (FP8 emulated)"
    lines = ["## linear_cross_entropy: bf16 and the FP8 lm_head", "",
             f"Measured by `scripts/lce_accuracy.py` on {name}: {a.tokens} tokens, hidden "
             f"{a.hidden}, vocab {a.vocab}, chunks of {a.chunk} tokens (see the script for the "
             "data). Loss: relative error; gradients: max rel (max|a - r| / max|r|) and "
             "norm rel (||a - r|| / ||r||) against float64 on the same bf16 values.", ""]
    for std in (1.0, 4.0):
        ref_loss, rows = measure(a.tokens, a.hidden, a.vocab, std, a.chunk, dev)
        lines += [f"**logits std {std:g}** (reference loss {ref_loss:.4f})", "",
                  "| path | loss rel | dhidden max rel | dhidden norm rel | dweight max rel | "
                  "dweight norm rel |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | " + " | ".join(f"{x:.2e}" for x in v) + " |" for k, v in rows.items()]
        lines.append("")
    lines += ["The bf16 rows err by one rounding of the logits and of dlogits (2^-9 relative); "
              "the chunked path matches HF's materialized one. The FP8 lm_head quantizes "
              "hidden and weight to E4M3 (one scale each per call, from their amax) and dlogits to "
              "E5M2 (3 significant bits; one scale per call, from the bound |dlogits| <= the "
              "loss's gradient scale, or per chunk from its amax with the z-loss): here the loss "
              "moves by under 1% and the gradients by several percent of their norm, more for "
              "peaked logits, like the FP8 Linear rows above. It is off by default (`fp8=True` / `convert_llama(fp8_lm_head=True)`).",
              ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {a.out} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
