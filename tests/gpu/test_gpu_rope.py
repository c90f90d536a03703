"""gpu tier: the rope kernel == its ref twin BIT FOR BIT on CUDA, forward and backward.

Why bit for bit holds on the GPU too: both take the same fp32 cos/sin tables (torch.cos/sin on
the device, computed once in the functional layer), and the kernel is compiled without FMA
contraction (enable_fp_fusion=False), so it rounds x*cos, the partner product and their sum
exactly as torch's separate elementwise kernels do, then converts to the dtype with RTNE like
torch's copy. NaN payloads are not compared (no NaN in these inputs).

Cases: the benchmark shape (s 4096, b 2, 32 query heads and 8 kv heads of 128, bf16) with q and
k as strided views of one fused QKV projection output, sbhd and bshd, both layouts; odd shapes
for every dtype, rotary_percent 0.5, thd with context parallelism; the Launcher's fast path
(second call) gives the same bits as the first.
"""
from __future__ import annotations

import pytest
import torch

from tritium.attention.rope import RotaryPositionEmbedding
from tritium.functional import rope as frope
from tritium.kernels import rope as krope
from tritium.ref import rope as rrope

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT = {4: torch.int32, 2: torch.int16}


def _same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.contiguous().view(_INT[got.element_size()]), want.contiguous().view(
        _INT[want.element_size()])
    diff = (g != w)
    if diff.any():
        k = diff.reshape(-1).nonzero()[0].item()
        raise AssertionError(f"{what}: {int(diff.sum())} of {g.numel()} differ; first got "
                             f"{got.reshape(-1)[k].item()!r}, want {want.reshape(-1)[k].item()!r}")


def _run(t, freqs, dy, use_ref, **kw):
    impl = frope._impl
    if use_ref:
        frope._impl = lambda _t: rrope
    try:
        assert (frope._impl(t) is rrope) == use_ref
        x = t.detach().requires_grad_(True)
        y = frope.apply_rotary_pos_emb(x, freqs, **kw)
        y.backward(dy)
    finally:
        frope._impl = impl
    return y.detach(), x.grad


def _check(t, freqs, dy, what, **kw):
    y_k, dx_k = _run(t, freqs, dy, False, **kw)
    y_r, dx_r = _run(t, freqs, dy, True, **kw)
    _same_bits(y_k, y_r, f"{what} forward")
    _same_bits(dx_k, dx_r, f"{what} backward")
    y_k2, dx_k2 = _run(t, freqs, dy, False, **kw)  # the Launcher's cached fast path
    _same_bits(y_k2, y_k, f"{what} forward, second call")
    _same_bits(dx_k2, dx_k, f"{what} backward, second call")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_benchmark_shape_fused_qkv_views(fmt, interleaved):
    s, b, hq, hkv, d = 4096, 2, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    lead = (s, b) if fmt == "sbhd" else (b, s)
    qkv = torch.randn(*lead, hq + 2 * hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv]
    assert not q.is_contiguous() and not k.is_contiguous()
    freqs = RotaryPositionEmbedding(d, interleaved=interleaved)(s)
    for name, t in (("q", q), ("k", k)):
        dy = torch.randn(t.shape, device="cuda", generator=g).to(torch.bfloat16)
        _check(t, freqs, dy, f"{fmt} {name}", tensor_format=fmt, interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (37, 3, 5, 80), (513, 2, 7, 64), (9, 4, 3, 33)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [False, True])
def test_odd_shapes(shape, dtype, interleaved):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    d = shape[-1]
    rot = d - d % 2 if d < 64 else d // 2  # rotary_percent < 1 where d allows
    t = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    freqs = torch.rand(shape[0] + 3, 1, 1, rot, device="cuda", generator=g) * 1000
    _check(t, freqs, dy, f"{shape}", interleaved=interleaved)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_thd(cp_size):
    g = torch.Generator(device="cuda").manual_seed(7)
    lengths = [1024, 4, 512, 2048]  # each divisible by 2 * cp_size
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    t = torch.randn(sum(lengths) // cp_size, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(t.shape, device="cuda", generator=g).to(torch.bfloat16)
    freqs = RotaryPositionEmbedding(128, rotary_percent=0.5)(max(lengths))
    for rank in range(cp_size):
        _check(t, freqs, dy, f"thd cp{cp_size} rank{rank}", tensor_format="thd", cu_seqlens=cu,
               cp_size=cp_size, cp_rank=rank)


def test_kernel_direct_strides():
    """The launcher on its own: a last-dim stride != 1 and a stride-0 dy."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 2, 128, 8, device="cuda", generator=g).to(torch.bfloat16).transpose(2, 3)
    ang = torch.rand(64, 96, device="cuda", generator=g) * 100
    cos, sin = ang.cos(), ang.sin()
    pos = torch.arange(64, device="cuda", dtype=torch.int32)[:, None].expand(64, 2)
    for inter in (False, True):
        _same_bits(krope.rope_fwd(x, cos, sin, pos, inter), rrope.rope_fwd(x, cos, sin, pos, inter),
                   "strided fwd")
        dy = x[:1, :1].expand(64, 2, 8, 128)
        _same_bits(krope.rope_bwd(dy, cos, sin, pos, inter),
                   rrope.rope_bwd(dy, cos, sin, pos, inter), "expanded bwd")
