"""Diagnose kernel/ref mismatches of cast_transpose for fp32 input: which output, where."""
import torch

from tritium.kernels import cast as kcast
from tritium.ref import cast as rcast

e4 = torch.float8_e4m3fn
for shape in [(33, 80), (1000, 4096), (64, 128)]:
    for dtype in (torch.float32, torch.bfloat16):
        for wd, wt in ((True, False), (False, True), (True, True)):
            x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
            scale = torch.full((1,), 37.3, device="cuda")
            a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
            k = kcast.cast_transpose(x, scale, a1, e4, pad_rows_to=16, write_data=wd, write_transpose=wt)
            r = rcast.cast_transpose(x, scale, a2, e4, pad_rows_to=16, write_data=wd, write_transpose=wt)
            msg = []
            for name, g, w in zip(("data", "data_t", "scale_inv"), k, r):
                if g is None:
                    continue
                if g.dtype == e4:
                    bad = (g.view(torch.uint8) != w.view(torch.uint8)).nonzero()
                else:
                    bad = (g != w).nonzero()
                if len(bad):
                    i = tuple(bad[0].tolist())
                    msg.append(f"{name}: {len(bad)} bad, first {i} got {g[i].float().item()} want {w[i].float().item()}")
            if not torch.equal(a1, a2):
                msg.append(f"amax {a1.item()} vs {a2.item()}")
            print(shape, dtype, "data" if wd else "", "T" if wt else "", "OK" if not msg else "; ".join(msg))
