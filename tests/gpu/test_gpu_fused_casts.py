"""gpu tier: the fused FP8-cast kernels on CUDA at real sizes, bit for bit against the unfused
kernel chain they replace, and the modules fused vs unfused. Skipped without CUDA.

Norm + cast (`kernels.norm_cast`) vs norm kernel then cast kernel. Measured on an H200: the
fused kernel's row reductions do NOT compile to the plain forward's order (same tile, num_warps
and shared `_norm_fwd_tile`, but Triton lays the reductions out differently next to the fp8
stores), so y moves by one ulp in ~0.003% of the 8192 x 4096 bf16 elements (more in fp32,
where every ulp shows). The GPU contract is therefore the norm kernels' own (tests/gpu/
test_gpu_norm.py): y within one ulp of the plain kernel, mean/rstd within rtol 1e-6, and the
cast half exact: the fp8 data, transpose, scale_inv and amax equal `ref.cast` applied to the
fused kernel's own y. (On the CPU and in the interpreter fused == unfused bit for bit.)
Exact (integer bits) on the GPU, as in the interp tier:
  * activation + cast fwd/bwd (`kernels.act_cast`) == activation kernel then cast kernel
    (elementwise, shared `_fwd_values` / `_bwd_values`);
  * the cast half == `ref.cast.cast_transpose` of the same high-precision values;
  * LayerNormLinear / LayerNormMLP: fused vs unfused over three steps, outputs, grads and FP8
    states; the norm's one-ulp differences can flip an fp8 rounding (and, through an amax, a
    scale), so every tensor is compared normwise: ||fused - unfused|| <= 2e-2 ||unfused||, well
    under the FP8-vs-bf16 error of these modules (about 1e-2 per GEMM) and far under what a
    wrong cast would give.
Sizes: norm 8192 x 4096 bf16 (the LayerNormMLP benchmark), 1000 x 768 fp16, 8 x 12288 fp32,
3 x 5000 bf16; activation 8192 x 14336 swiglu bf16 (gated input 8192 x 28672), gelu at the same
F, and odd ones.
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.formats import fp8_max
from tritium.kernels import act_cast as kac
from tritium.kernels import activation as kact
from tritium.kernels import cast as kcast
from tritium.kernels import norm as knorm
from tritium.kernels import norm_cast as knc
from tritium.ref import cast as rcast

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def assert_bits(got, want, what):
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    bad = int((got.contiguous().view(_INT[got.element_size()])
               != want.contiguous().view(_INT[want.element_size()])).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ"


def assert_within_one_ulp(got, want, what, slack=1e-5):
    """One ulp apart, or closer than an absolute slack where the value nearly cancels (the norm
    kernels' own GPU contract, tests/gpu/test_gpu_norm.py)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    step = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    gi = got.contiguous().view(step[got.dtype]).long()
    wi = want.contiguous().view(step[want.dtype]).long()
    sign = 1 << (8 * got.element_size() - 1)
    gi = torch.where(gi < 0, -(gi + sign), gi)  # sign-magnitude -> ordered integers
    wi = torch.where(wi < 0, -(wi + sign), wi)
    far = ((gi - wi).abs() > 1) & ((got.float() - want.float()).abs() > slack)
    assert not far.any(), f"{what}: {int(far.sum())} elements more than one ulp and {slack} apart"


def _scale(y, fp8_dtype):
    sample = y.float().abs().flatten()[:1 << 20]
    q = sample.quantile(0.9) if sample.numel() > 1 else sample.max()
    return (fp8_max(fp8_dtype) / q.clamp_min(1e-3) * 1.1).float().reshape(1)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


NORM_CASES = [(8192, 4096, torch.bfloat16), (1000, 768, torch.float16),
              (8, 12288, torch.float32), (3, 5000, torch.bfloat16)]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("rows,hidden,dtype", NORM_CASES, ids=str)
def test_norm_cast_equals_norm_then_cast(norm, rows, hidden, dtype):
    g = _gen(rows + hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    w = (torch.randn(hidden, device="cuda", generator=g) * 0.5 + 1).to(dtype)
    b = (torch.randn(hidden, device="cuda", generator=g) * 0.5).to(dtype)
    args = (x, w, b, 1e-5, False) if norm == "layernorm" else (x, w, 1e-5, False)
    y_plain, *stats = getattr(knorm, f"{norm}_fwd")(*args)
    scale = _scale(y_plain, E4M3)
    amax, amax_u = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    y, data, data_t, si, *kstats = getattr(knc, f"{norm}_fwd_fp8")(
        *args, scale, amax, E4M3, write_transpose=True, write_hp=True)
    ud, _, usi = kcast.cast_transpose(y_plain, scale, amax_u, E4M3, pad_rows_to=16)
    assert_within_one_ulp(y, y_plain, "y")
    for i, (k, want) in enumerate(zip(kstats, stats)):
        torch.testing.assert_close(k, want, rtol=1e-6, atol=1e-6, msg=f"stat{i}")
    assert_bits(si, usi, "scale_inv")
    own_amax = torch.zeros(1, device="cuda")
    rd, rdt, _ = rcast.cast_transpose(y, scale, own_amax, E4M3, pad_rows_to=16,
                                      write_transpose=True)
    assert_bits(data, rd, "data vs ref cast of its own y")
    assert_bits(data_t, rdt, "data_t vs ref cast of its own y")
    assert_bits(amax, own_amax, "amax vs its own y")
    assert (data.view(torch.uint8) != ud.view(torch.uint8)).float().mean() < 1e-3
    # without the transpose and the high-precision output (LayerNormLinear in inference)
    _, data2, data_t2, _, *_ = getattr(knc, f"{norm}_fwd_fp8")(*args, scale, None, E4M3)
    assert data_t2 is None
    assert_bits(data2, data, "data (no transpose)")


ACT_CASES = [("swiglu", 8192, 14336, torch.bfloat16), ("gelu", 8192, 14336, torch.bfloat16),
             ("geglu", 1000, 4097, torch.float16), ("srelu", 37, 1000, torch.float32),
             ("glu", 3, 33, torch.bfloat16)]


@pytest.mark.parametrize("kind,rows,f,dtype", ACT_CASES, ids=str)
def test_activation_cast_equals_activation_then_cast(kind, rows, f, dtype):
    g = _gen(rows + f)
    gated = kind in kact.GATED
    x = (torch.randn(rows, 2 * f if gated else f, device="cuda", generator=g) * 2).to(dtype)
    dy = torch.randn(rows, f, device="cuda", generator=g).to(dtype)
    # forward: fc2's input
    y_plain = kact.activation_fwd(x, kind)
    scale = _scale(y_plain, E4M3)
    amax, amax_u = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    data, data_t, si = kac.activation_fwd_fp8(x, kind, scale, amax, E4M3, write_transpose=True)
    ud, udt, usi = kcast.cast_transpose(y_plain, scale, amax_u, E4M3, pad_rows_to=16,
                                        write_transpose=True)
    for name, got, want in (("fwd data", data, ud), ("fwd data_t", data_t, udt),
                            ("fwd scale_inv", si, usi), ("fwd amax", amax, amax_u)):
        assert_bits(got, want, name)
    del data, data_t, ud, udt, y_plain
    # backward: fc1's grad_output
    dx_plain = kact.activation_bwd(dy, x, kind)
    scale = _scale(dx_plain, E5M2)
    amax, amax_u = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    dx, data, data_t, si = kac.activation_bwd_fp8(dy, x, kind, scale, amax, E5M2, write_hp=True)
    ud, udt, usi = kcast.cast_transpose(dx_plain, scale, amax_u, E5M2, pad_rows_to=16,
                                        write_transpose=True)
    for name, got, want in (("bwd dx", dx, dx_plain), ("bwd data", data, ud),
                            ("bwd data_t", data_t, udt), ("bwd scale_inv", si, usi),
                            ("bwd amax", amax, amax_u)):
        assert_bits(got, want, name)
    rd, rdt, _ = rcast.cast_transpose(dx_plain, scale, None, E5M2, pad_rows_to=16,
                                      write_transpose=True)
    assert_bits(data, rd, "bwd data vs ref cast")
    assert_bits(data_t, rdt, "bwd data_t vs ref cast")


@pytest.mark.parametrize("case", ["mlp_swiglu", "mlp_gelu_bias_ckpt", "linear_ln_out"])
def test_modules_fused_equals_unfused(case):
    import tritium as te
    from test_fused_casts import _compare

    bf16 = torch.bfloat16
    if case == "mlp_swiglu":
        m = te.LayerNormMLP(1024, 2816, normalization="RMSNorm", activation="swiglu", bias=False,
                            params_dtype=bf16, device="cuda")
    elif case == "mlp_gelu_bias_ckpt":
        m = te.LayerNormMLP(1024, 4096, activation="gelu", checkpoint=True,
                            return_layernorm_output=True, params_dtype=bf16, device="cuda")
    else:
        m = te.LayerNormLinear(1024, 3072, return_layernorm_output=True, params_dtype=bf16,
                               device="cuda")
    _compare(m, steps=3, shape=(3, 667, 1024), dtype=bf16, exact=False)  # 2001 tokens
