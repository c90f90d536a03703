"""`tritium.kernels.rope` == `tritium.ref.rope` bit for bit under the Triton interpreter.

Kernel and twin take the same fp32 cos/sin tables and do the same IEEE operations in the same
order (two products, one sum, one rounding to the output dtype; see tritium/ref/rope.py), so
every bit must agree: forward and backward, fp32/bf16/fp16, interleaved or not, rot_dim < d
(odd d too), at tiny odd shapes that cross the interpreter's 2-row tiles, on views with strides
(column slices of a fused QKV tensor, permuted dims, a last-dim stride != 1, a stride-0 dy), with
arbitrary tables (each row random, so the backward's use of the partner's sin matters) and with
values over six decades plus -0.0, inf and NaN. The functional API is checked to route to the
kernel in every tensor format (sbhd, bshd, thd, context parallel).
"""
from __future__ import annotations

import pytest
import torch

from tritium import _device
from tritium.functional import rope as frope
from tritium.kernels import rope as krope
from tritium.ref import rope as rrope

from ._helpers import assert_same_bits, wide_randn

pytestmark = [pytest.mark.interp,  # inf * 0 inside the special-value cases, by design
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# [N1, N2, H, D] and rot_dim
SHAPES = [((1, 1, 1, 2), 2), ((3, 2, 5, 6), 4), ((2, 3, 3, 10), 10), ((5, 1, 2, 7), 6),
          ((4, 2, 1, 33), 16)]


def tables(n: int, rot: int, gen: torch.Generator):
    """cos/sin of random angles in [-50, 50] (every row independent, pairs not duplicated)."""
    ang = (torch.rand(n, rot, generator=gen, dtype=torch.float64) * 100 - 50).float()
    return ang.cos(), ang.sin()


def check(x, cos, sin, pos, interleaved, what="", nan_as_nan=False):
    for name, fn_k, fn_r in (("fwd", krope.rope_fwd, rrope.rope_fwd),
                             ("bwd", krope.rope_bwd, rrope.rope_bwd)):
        got, want = fn_k(x, cos, sin, pos, interleaved), fn_r(x, cos, sin, pos, interleaved)
        assert got.is_contiguous() and got.shape == x.shape
        assert_same_bits(got, want, f"{what} {name}", nan_as_nan=nan_as_nan)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rot", SHAPES, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v, tuple) else f"rot{v}")
def test_kernel_matches_ref(shape, rot, dtype, interleaved, gen):
    x = wide_randn(shape, dtype, gen)
    cos, sin = tables(7, rot, gen)
    pos = torch.randint(0, 7, shape[:2], generator=gen, dtype=torch.int32)
    check(x, cos, sin, pos, interleaved, f"{dtype}")


@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_views(interleaved, gen):
    s, b, h, d = 5, 3, 2, 12
    cos, sin = tables(s, 8, gen)
    pos = torch.arange(s, dtype=torch.int32)[:, None].expand(s, b)  # stride 0 over b
    qkv = wide_randn((s, b, h, 3 * d), torch.bfloat16, gen)
    for part in range(3):  # column slices of a fused projection
        check(qkv[..., part * d:(part + 1) * d], cos, sin, pos, interleaved, f"qkv[{part}]")
    x = wide_randn((b, s, h, d), torch.float16, gen).transpose(0, 1)  # permuted dims
    check(x, cos, sin, pos, interleaved, "transposed")
    x = wide_randn((s, b, d, h), torch.float32, gen).transpose(2, 3)  # last-dim stride h
    assert x.stride(-1) != 1
    check(x, cos, sin, pos, interleaved, "last-dim stride")
    dy = wide_randn((1, 1, h, d), torch.bfloat16, gen).expand(s, b, h, d)  # grad of a sum
    check(dy, cos, sin, pos, interleaved, "expanded")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype, gen):
    vals = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1.0, 3.0,
                         6e4, -2.5, 0.5, 1e-3, -0.0, 7.0, float("nan"), 2.0])
    x = torch.stack([vals, vals.flip(0)]).reshape(2, 1, 1, 16).to(dtype)
    cos, sin = tables(2, 10, gen)
    pos = torch.tensor([[0], [1]], dtype=torch.int32)
    for interleaved in (False, True):
        # NaN payloads and signs are not numerical results: NaN only has to be NaN
        check(x, cos, sin, pos, interleaved, "special", nan_as_nan=True)
        y = krope.rope_fwd(x, cos, sin, pos, interleaved)
        assert_same_bits(y[..., 10:], x[..., 10:], "pass-through keeps -0.0, inf, NaN")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd", "thd-cp2"])
def test_functional_runs_the_kernel(fmt, dtype, gen):
    """apply_rotary_pos_emb with autograd: the kernel path == the twin path, bit for bit."""
    h, d, interleaved = 3, 10, fmt == "bshd"
    freqs = (torch.rand(17, 1, 1, 8, generator=gen) * 20).float()
    kw = {}
    if fmt.startswith("thd"):
        cp = 2 if fmt == "thd-cp2" else 1
        lengths = [4, 8, 4] if cp == 2 else [3, 1, 6]
        kw = dict(cu_seqlens=torch.tensor([0] + lengths).cumsum(0).to(torch.int32), cp_size=cp,
                  cp_rank=cp - 1)
        shape = (sum(lengths) // cp, h, d)
    else:
        shape = (7, 2, h, d)
    t = wide_randn(shape, dtype, gen)
    dy = wide_randn(shape, dtype, gen)
    results = []
    for force_ref in (False, True):
        x = t.clone().requires_grad_(True)
        if force_ref:
            impl = frope._impl
            frope._impl = lambda _t: rrope
        try:
            assert (frope._impl(x) is krope) == (not force_ref) and _device.use_triton(x)
            y = frope.apply_rotary_pos_emb(x, freqs, fmt.split("-")[0],
                                           interleaved=interleaved, **kw)
            y.backward(dy)
        finally:
            if force_ref:
                frope._impl = impl
        results.append((y.detach(), x.grad))
    assert_same_bits(results[0][0], results[1][0], f"{fmt} forward")
    assert_same_bits(results[0][1], results[1][1], f"{fmt} backward")


def test_bad_arguments():
    x = torch.ones(2, 1, 1, 4)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    pos = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="must be even and <= head dim"):
        krope.rope_fwd(x, cos[:, :3], sin[:, :3], pos, False)
    with pytest.raises(ValueError, match="fp32 tables"):
        krope.rope_fwd(x, cos.half(), sin.half(), pos, False)
    with pytest.raises(ValueError, match="pos must be"):
        krope.rope_bwd(x, cos, sin, pos[:1], False)
    assert krope.rope_fwd(x[:0], cos, sin, pos[:0], True).shape == (0, 1, 1, 4)
