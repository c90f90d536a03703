import torch, triton, triton.language as tl
from triton.testing import do_bench
from tritium.kernels import gemm as G
from tritium.kernels._launch import TensorDesc, num_sms
from tritium.kernels.gemm import tile_offsets
from tritium.kernels import act_cast as AC
dev = "cuda"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

@triton.jit
def acc_kernel(a_desc, b_desc, c_desc, sa, sb, c_ptr, M, N, K, stride_cm, num_programs,
               PREFETCH: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA_OLD: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    scale = tl.load(sa) * tl.load(sb)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        off_m, off_n = tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        if PREFETCH:
            if TMA_OLD:
                old = c_desc.load([off_m, off_n])
            else:
                old = tl.load(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
                              mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            if PRECISE:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
        c = acc * scale
        if not PREFETCH:
            old = tl.load(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
                          mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
        c += old.to(tl.float32)
        c_desc.store([off_m, off_n], c.to(c_desc.dtype))

def run_acc(a, b, out, one, cfg, prefetch, precise=True, tma_old=False):
    bm, bn, bk, gm, w, s = cfg
    m, k = a.shape; n = b.shape[0]
    tiles = -(-m // bm) * -(-n // bn)
    P = min(tiles, num_sms(0))
    acc_kernel[(P,)](TensorDesc(a, (bm, bk)), TensorDesc(b, (bn, bk)), TensorDesc(out, (bm, bn)), one, one, out,
                     m, n, k, out.stride(0), P, PREFETCH=prefetch, PRECISE=precise, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_K=bk, GROUP_M=gm, TMA_OLD=tma_old, num_warps=w, num_stages=s)

def tf(m, n, k, ms): return 2*m*n*k/ms/1e9
m, n, k = 128256, 2048, 1040
a = (torch.randn(m, k, device=dev)*0.5).to(E5); b = (torch.randn(n, k, device=dev)*0.5).to(E4)
one = torch.ones((), device=dev)
out = torch.zeros(m, n, device=dev, dtype=torch.bfloat16)
ref = out.clone(); G.fp8_gemm_tn(a, b, one, one, torch.bfloat16, out=ref, accumulate=True)
print("== wgrad accumulate", m, n, k)
ms = do_bench(lambda: G.fp8_gemm_tn(a, b, one, one, torch.bfloat16, out=out, accumulate=True), warmup=20, rep=100)
print(f"  current                      {ms*1e3:7.1f} us {tf(m,n,k,ms):6.0f} TF")
for cfg in [(128,128,128,8,8,3), (128,128,128,8,8,4), (128,256,128,8,8,2), (256,128,128,8,8,2), (128,256,64,8,8,3), (128,128,128,16,8,4)]:
    for pf, tma in [(False, False), (True, False), (True, True)]:
        try:
            o2 = torch.zeros_like(out); run_acc(a, b, o2, one, cfg, pf, tma_old=tma)
            same = torch.equal(o2, ref)
            ms = do_bench(lambda: run_acc(a, b, out, one, cfg, pf, tma_old=tma), warmup=20, rep=100)
            print(f"  {str(cfg):24s} prefetch={pf!s:5} tma={tma!s:5} {ms*1e3:7.1f} us {tf(m,n,k,ms):6.0f} TF same={same}")
        except Exception as e:
            print(f"  {cfg} prefetch={pf} tma={tma} ERR {str(e)[:90]}")
# a K = 4 chunks accumulate for reference
k4 = 4160
a4 = (torch.randn(m, k4, device=dev)*0.5).to(E5); b4 = (torch.randn(n, k4, device=dev)*0.5).to(E4)
ms = do_bench(lambda: G.fp8_gemm_tn(a4, b4, one, one, torch.bfloat16, out=out, accumulate=True), warmup=10, rep=50)
print(f"  current K=4160               {ms*1e3:7.1f} us {tf(m,n,k4,ms):6.0f} TF")

print("== swiglu act fwd/bwd T8192 F8192")
T, F = 8192, 8192
x = torch.randn(T, 2*F, device=dev, dtype=torch.bfloat16)
dy = torch.randn(T, F, device=dev, dtype=torch.bfloat16)
sc = torch.ones(1, device=dev); am = torch.zeros(1, device=dev)
orig = AC._grid
def fwd(): return AC.activation_fwd_fp8(x, "swiglu", sc, am, E4, write_data=True, write_transpose=True)
def bwd(): return AC.activation_bwd_fp8(dy, x, "swiglu", sc, am, E5, write_data=True, write_transpose=True)
fbytes = T*2*F*2 + 2*T*F; bbytes = T*2*F*2 + T*F*2 + 2*T*2*F
for br, bc, w in [(64,64,8), (64,128,8), (128,64,8), (32,128,4), (64,64,4), (128,128,8), (32,64,4), (64,256,8)]:
    AC._grid = lambda rows_p, f, interp, br=br, bc=bc, w=w: ((max(-(-rows_p // br), 1) * max(-(-f // bc), 1),), max(-(-f // bc), 1), br, bc, w)
    try:
        mf = do_bench(fwd, warmup=20, rep=100); mb = do_bench(bwd, warmup=20, rep=100)
        print(f"  tile {br}x{bc} w{w}: fwd {mf*1e3:6.1f} us {fbytes/mf/1e6:5.0f} GB/s  bwd {mb*1e3:6.1f} us {bbytes/mb/1e6:5.0f} GB/s")
    except Exception as e:
        print(f"  tile {br}x{bc} w{w} ERR {str(e)[:80]}")
AC._grid = orig
