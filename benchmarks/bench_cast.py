"""FP8 cast kernels vs copy bandwidth: cast+transpose+amax, cast+amax, a tile sweep, and the
transpose of data already in FP8 (tritium's kernel vs torch's `.t().contiguous()`; FSDP2's FP8
all-gather and TP's FP8 sequence gather make one per GEMM weight / input).

Bytes counted: input read once, every fp8 output written once. The reference point is a
device-to-device copy of the input (read + write) measured in the same run.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import finish, time_ms  # noqa: E402

from tritium.kernels import cast as kcast  # noqa: E402

SHAPES = [(8192, 4096), (8192, 14336), (4096, 14336), (16384, 8192)]
TILES = [(64, 128, 8), (64, 64, 4), (128, 128, 8), (128, 64, 8), (32, 128, 4), (64, 256, 8)]


def main():
    rows = []
    default_tile = kcast._tile
    e4m3 = torch.float8_e4m3fn
    for m, n in SHAPES:
        case = f"{m}x{n} bf16"
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scale = torch.full((1,), 2.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        nbytes = x.numel() * 2
        ms = time_ms(lambda: x.clone())
        rows.append({"case": case, "variant": "torch copy", "ms": round(ms, 4),
                     "gbps": round(2 * nbytes / ms / 1e6)})
        for tile in TILES:
            kcast._tile = lambda *_a, tile=tile: tile
            try:
                ms = time_ms(lambda: kcast.cast_transpose(x, scale, amax, e4m3, pad_rows_to=16,
                                                          write_transpose=True))
            except Exception as exc:
                rows.append({"case": case, "variant": f"cast+T tile{tile}", "error": repr(exc)})
                continue
            rows.append({"case": case, "variant": f"cast+T tile{tile}", "ms": round(ms, 4),
                         "gbps": round((nbytes + 2 * x.numel()) / ms / 1e6)})
        kcast._tile = default_tile
        ms = time_ms(lambda: kcast.cast_transpose(x, scale, amax, e4m3, pad_rows_to=16))
        rows.append({"case": case, "variant": "cast only (default tile)", "ms": round(ms, 4),
                     "gbps": round((nbytes + x.numel()) / ms / 1e6)})
        ms = time_ms(lambda: kcast.amax_into(x, amax))
        rows.append({"case": case, "variant": "amax only", "ms": round(ms, 4),
                     "gbps": round(nbytes / ms / 1e6)})
        x8 = x.to(e4m3)
        for name, fn in (("fp8 transpose (tritium)", lambda: kcast.transpose_fp8(x8)),
                         ("fp8 transpose (torch .t().contiguous())",
                          lambda: x8.t().contiguous())):
            ms = time_ms(fn)
            rows.append({"case": case, "variant": name, "ms": round(ms, 4),
                         "gbps": round(2 * x.numel() / ms / 1e6)})
    finish("cast", rows, baseline="torch copy")


if __name__ == "__main__":
    main()
