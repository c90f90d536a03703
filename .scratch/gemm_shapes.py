import torch, triton
from triton.testing import do_bench
from tritium.kernels import gemm as G
dev = "cuda"
E4 = torch.float8_e4m3fn
def mk(m, k):
    return (torch.randn(m, k, device=dev) * 0.5).to(E4)
one = torch.ones((), device=dev)
def tflops(m, n, k, ms): return 2 * m * n * k / ms / 1e9
cases = [("qkv", 8192, 3072, 2048), ("proj", 8192, 2048, 2048), ("fc1", 8192, 16384, 2048),
         ("fc2", 8192, 2048, 8192), ("head fprop", 1040, 128256, 2048), ("big", 8192, 4096, 4096)]
cfgs = {"128x256 k128 w8 s3": (128, 256, 128, 8, 8, 3), "256x128 k128 w8 s3": (256, 128, 128, 8, 8, 3),
        "128x256 k128 w8 s4": (128, 256, 128, 8, 8, 4), "128x128 k128 w8 s4": (128, 128, 128, 8, 8, 4),
        "128x256 k64 w8 s5": (128, 256, 64, 8, 8, 5), "128x128 k128 w4 s4": (128, 128, 128, 8, 4, 4)}
for name, m, n, k in cases:
    a, b = mk(m, k), mk(n, k)
    res = []
    ms = do_bench(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True), warmup=50, rep=200)
    res.append(("cublas", ms))
    for cn, c in cfgs.items():
        for pers in (True, False):
            try:
                ms = do_bench(lambda: G.fp8_gemm_tn(a, b, one, one, torch.bfloat16, fast_accum=True, config=c, persistent=pers), warmup=50, rep=200)
            except Exception as e:
                print(name, cn, pers, "ERR", str(e)[:80]); continue
            res.append((cn + (" pers" if pers else " grid"), ms))
    print(f"== {name} M{m} N{n} K{k}")
    for v, ms in sorted(res, key=lambda r: r[1]):
        print(f"   {v:28s} {ms*1e3:8.1f} us {tflops(m,n,k,ms):7.0f} TF")
# lm_head wgrad accumulate: M=128256 N=2048 K=1040, out bf16
m, n, k = 128256, 2048, 1040
a, b = mk(m, k), mk(n, k)
out = torch.zeros(m, n, device=dev, dtype=torch.bfloat16)
print(f"== head wgrad accumulate M{m} N{n} K{k}")
for cn, c in {"acc 128x128 w8 s3": G.ACCUMULATE_CONFIG, "acc 128x128 w8 s4": (128,128,128,8,8,4), "acc 128x256 w8 s3": (128,256,128,8,8,3), "acc 128x128 w4 s4": (128,128,128,8,4,4)}.items():
    try:
        ms = do_bench(lambda: G.fp8_gemm_tn(a, b, one, one, torch.bfloat16, out=out, accumulate=True, config=c), warmup=20, rep=100)
        print(f"   {cn:28s} {ms*1e3:8.1f} us {tflops(m,n,k,ms):7.0f} TF")
    except Exception as e:
        print(cn, "ERR", str(e)[:100])
ms = do_bench(lambda: G.fp8_gemm_tn(a, b, one, one, torch.bfloat16, fast_accum=False), warmup=20, rep=100)
print(f"   {'no-acc precise default':28s} {ms*1e3:8.1f} us {tflops(m,n,k,ms):7.0f} TF")
ms = do_bench(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=False), warmup=20, rep=100)
print(f"   {'cublas precise no-acc':28s} {ms*1e3:8.1f} us {tflops(m,n,k,ms):7.0f} TF")
