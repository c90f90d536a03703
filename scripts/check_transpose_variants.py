"""Which way of writing the fp8 transpose in Triton is correct for fp32/bf16 inputs, and fast."""
import torch
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, t_ptr, M, N, VARIANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(x * 3.0, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if VARIANT == 0:    # trans of fp8
        tl.store(t_ptr + rn[:, None] * M + rm[None, :], tl.trans(y.to(tl.float8e4nv)), mask=tl.trans(mask))
    elif VARIANT == 1:  # trans of fp32, then convert
        tl.store(t_ptr + rn[:, None] * M + rm[None, :], tl.trans(y).to(tl.float8e4nv), mask=tl.trans(mask))
    else:               # pointer-transposed store, no tl.trans
        tl.store(t_ptr + rn[None, :] * M + rm[:, None], y.to(tl.float8e4nv), mask=mask)


for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(8192, 4096, device="cuda", dtype=dtype)
    want = (x.float() * 3.0).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous()
    for v in range(3):
        out = torch.empty(4096, 8192, device="cuda", dtype=torch.float8_e4m3fn)
        f = lambda: _k[(8192 // 64, 4096 // 128)](x, out, 8192, 4096, VARIANT=v, BM=64, BN=128, num_warps=8)
        f()
        ok = torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        ms = triton.testing.do_bench(f, return_mode="median")
        print(f"{dtype} variant {v}: equal={ok} {ms * 1e3:.1f} us")
