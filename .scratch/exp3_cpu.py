import os, torch
import importlib.util, sys
src = open(".scratch/exp3.py").read().split("T, F = 8192, 8192")[0].replace('dev = "cuda"', 'dev = "cpu"')
exec(src)
T, F = 64, 64
x = torch.randn(T, 2*F, dtype=torch.bfloat16) * 3
sc = torch.full((1,), 7.0); am = torch.zeros(1)
d0, t0, _ = AC.activation_fwd_fp8(x, "swiglu", sc, am.clone(), E4, write_data=True, write_transpose=True)
for mode in (0, 1, 2):
    br, bc, w = 16, 16, 1
    d = torch.empty(T, F, dtype=torch.uint8); t = torch.empty(F, T, dtype=torch.uint8)
    ncb = F // bc
    fwd_trans[(T // br * ncb,)](x, d, t, sc, am, T, T, F, x.stride(0), ncb, ACT=_CODE["swiglu"], GATED=True,
                                 FP8_MAX=448.0, OUT_DTYPE=_TL_FP8[E4], BLOCK_R=br, BLOCK_C=bc, MODE=mode, num_warps=w)
    print(mode, torch.equal(d, d0.view(torch.uint8)), torch.equal(t, t0.view(torch.uint8)))
