"""Activations, forward and forward+backward: tritium vs eager torch, torch.compile and Liger.

Cases: swiglu on a [8192, 28672] bf16 input (gate = first half, up = second half -> [8192, 14336])
and gelu (tanh approximation) on [8192, 14336] bf16. Variants per case:
  * torch copy            clone of the input: the bandwidth reference (read + write, no math);
  * torch eager           F.silu(a) * b with a, b = x.chunk(2, -1), or F.gelu(x, "tanh");
  * torch.compile         the same function compiled;
  * tritium kernel        `tritium.kernels.activation` called directly (forward rows only);
  * tritium activation    `tritium.functional.activation` (autograd Function, per-call dispatch);
  * liger                 `LigerSiLUMulFunction.apply(a, b)` (swiglu only; optional import;
                          a and b are separate contiguous tensors, as in Liger's own MLPs).
fwd+bwd rows run forward and backward with a fresh upstream gradient; grads are reset between
calls. GB/s counts the minimum traffic of a fused implementation (bf16, each tensor once):
swiglu fwd reads 2F and writes F per row, its backward reads dy, a, b and writes da, db; gelu fwd
reads and writes F, its backward reads dy, x and writes dx. A "tile" sweep of the tritium
swiglu kernels follows, for tuning. Needs CUDA; without it the script says so and exits.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, peak_mem_mb, time_ms  # noqa: E402

ROWS, FFN = 8192, 14336
TILES = [(1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (2, 2048, 8), (1, 4096, 8), (4, 512, 4)]


def _swiglu_eager(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _gelu_eager(x):
    return F.gelu(x, approximate="tanh")


def _variants(kind):
    """(variant, fn taking the input tensor(s), takes_split_inputs)."""
    from tritium.functional.activation import activation
    eager = _swiglu_eager if kind == "swiglu" else _gelu_eager
    yield "torch eager", eager, False
    yield "torch.compile", torch.compile(eager), False
    yield "tritium activation", lambda x: activation(x, kind), False
    if kind == "swiglu":
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            yield "liger LigerSiLUMulFunction", LigerSiLUMulFunction.apply, True
        except Exception as exc:  # peer missing: record, don't crash
            yield "liger LigerSiLUMulFunction", exc, True


def _bytes(kind, rows, f, with_bwd):
    per_row = (3 if kind == "swiglu" else 2) * f
    if with_bwd:
        per_row += (5 if kind == "swiglu" else 3) * f
    return 2 * rows * per_row  # bf16


def _row(case, variant, ms, nbytes, **extra):
    return {"case": case, "variant": variant, "ms": round(ms, 4),
            "gbps": round(nbytes / ms / 1e6), **extra}


def _bench_case(kind, rows):
    from tritium.kernels import activation as kact
    f = FFN
    width = 2 * f if kind == "swiglu" else f
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    split = [t.contiguous().requires_grad_(True) for t in x.chunk(2, dim=-1)]
    xg = x.clone().requires_grad_(True)
    shape = f"{rows}x{width}" if kind == "swiglu" else f"{rows}x{f}"
    for with_bwd in (False, True):
        case = f"{kind} {shape} bf16 {'fwd+bwd' if with_bwd else 'fwd'}"
        nbytes = _bytes(kind, rows, f, with_bwd)
        ms = time_ms(lambda: x.clone())
        yield _row(case, "torch copy", ms, 2 * x.numel() * 2)
        if not with_bwd:
            try:
                ms = time_ms(lambda: kact.activation_fwd(x, kind))
                yield _row(case, "tritium kernel", ms, nbytes)
            except Exception as exc:
                yield {"case": case, "variant": "tritium kernel", "error": repr(exc)}
        for variant, fn, takes_split in _variants(kind):
            if isinstance(fn, Exception):
                yield {"case": case, "variant": variant, "error": repr(fn)}
                continue
            inputs = split if takes_split else [xg if with_bwd else x]

            def step(fn=fn, inputs=inputs):
                if not with_bwd:
                    with torch.no_grad():
                        return fn(*inputs)
                for t in inputs:
                    t.grad = None
                fn(*inputs).backward(dy)
            try:
                step(); step()
                ms = time_ms(step)
                extra = {"peak_mb": round(peak_mem_mb(step), 1)} if with_bwd else {}
            except Exception as exc:
                yield {"case": case, "variant": variant, "error": repr(exc)}
                continue
            yield _row(case, variant, ms, nbytes, **extra)
    del xg, split


def _tile_sweep(rows):
    """tritium swiglu forward and backward kernels at a few (BLOCK_R, BLOCK_C, warps) tiles."""
    from tritium.kernels import activation as kact
    f = FFN
    x = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    default_tile = kact._tile
    try:
        for tile in TILES:
            kact._tile = lambda *_a, tile=tile: tile
            for name, fn, nb in (("fwd", lambda: kact.activation_fwd(x, "swiglu"), 3),
                                 ("bwd", lambda: kact.activation_bwd(dy, x, "swiglu"), 5)):
                case = f"swiglu kernel {name} tiles"
                try:
                    ms = time_ms(fn)
                except Exception as exc:
                    yield {"case": case, "variant": f"tile{tile}", "error": repr(exc)}
                    continue
                yield _row(case, f"tile{tile}", ms, 2 * rows * f * nb)
    finally:
        kact._tile = default_tile


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_activation: needs a CUDA GPU; none is available here")
    rows = []
    for kind in ("swiglu", "gelu"):
        for row in _bench_case(kind, ROWS):
            rows.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    for row in _tile_sweep(ROWS):
        rows.append(row)
        print(row, flush=True)
    finish("activation", rows, baseline="torch eager")


if __name__ == "__main__":
    main()
