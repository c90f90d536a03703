"""`tritium.kernels.grouped_gemm` == `tritium.ref.grouped_gemm` under the interpreter.

The GEMMs bit for bit on integer-valued fp8 operands (|v| <= 8: every partial sum exact in fp32
in any order, see test_gemm_kernel.py), with groups of 0, odd and tile-crossing row counts, in
both tile walks (the flat one and the per-group one with device-built TMA descriptors); the
grouped cast bit for bit on fresh random data (data, each group's transposed block, scale_inv,
the per-group amaxes), under delayed and current scaling.
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import grouped_gemm as kg
from tritium.ref import grouped_gemm as rg

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]  # empty groups

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [[5, 0, 37], [16, 21, 0, 3]]


def _integer_fp8(shape, dtype, gen):
    return torch.randint(-8, 9, shape, generator=gen).to(torch.float32).to(dtype)


def _valid_t(data_t, offsets, k):
    """The written part of each group's transposed block, concatenated."""
    o = offsets.tolist()
    parts = []
    for g in range(len(o[0]) - 1):
        rows, p0, p1 = o[0][g + 1] - o[0][g], o[1][g], o[1][g + 1]
        parts.append(data_t[k * p0:k * p1].view(k, p1 - p0)[:, :rows].reshape(-1))
    return torch.cat(parts)


def _padding_t(data_t, offsets, k):
    """The padding columns (m_g to pm_g) of each group's transposed block, as float."""
    o = offsets.tolist()
    parts = [data_t[k * o[1][g]:k * o[1][g + 1]].view(k, -1)[:, o[0][g + 1] - o[0][g]:]
             .float().reshape(-1) for g in range(len(o[0]) - 1)]
    return torch.cat(parts)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype,bias", [(torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("variant", ["flat", "tma"])
def test_grouped_gemm_equals_ref_bits(splits, a_dtype, b_dtype, out_dtype, bias, fast_accum,
                                      variant, gen):
    g, n, k = len(splits), 48, 32
    offsets = rg.make_offsets(splits, "cpu")
    a = _integer_fp8((sum(splits), k), a_dtype, gen)
    b = _integer_fp8((g, n, k), b_dtype, gen)
    sa, sb = torch.rand(g, generator=gen) + 0.1, torch.rand(g, generator=gen) * 3 + 0.01
    bias_t = torch.randn(g, n, generator=gen).to(out_dtype) if bias else None
    got = kg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype, bias_t, fast_accum,
                                 config=(16, 16, 32, 2, 1, 1, variant))
    want = rg.grouped_fp8_gemm_tn(a, b, sa, sb, offsets, out_dtype, bias_t, fast_accum)
    assert got.abs().max() > 0
    assert_same_bits(got, want, f"{splits}")


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("variant", ["flat", "tma"])
def test_grouped_wgrad_equals_ref_bits(splits, variant, gen):
    g, n, k = len(splits), 32, 48
    offsets = rg.make_offsets(splits, "cpu")
    padded = int(offsets[1, -1])
    a_t = _integer_fp8((n * padded,), E5M2, gen)  # padding columns hold values: never read
    b_t = _integer_fp8((k * padded,), E4M3, gen)
    sa, sb = torch.rand(g, generator=gen) + 0.1, torch.rand(g, generator=gen) * 3 + 0.01
    got = kg.grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, torch.float32,
                                    config=(16, 16, 32, 2, 1, 1, variant))
    want = rg.grouped_fp8_gemm_wgrad(a_t, b_t, sa, sb, offsets, n, k, torch.float32)
    assert got.abs().max() > 0
    assert_same_bits(got, want, f"{splits}")
    for e, rows in enumerate(splits):
        if rows == 0:
            assert torch.all(got[e] == 0)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mode", ["delayed", "current"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_grouped_cast_equals_ref_bits(splits, mode, x_dtype, gen):
    g, k = len(splits), 48
    offsets = rg.make_offsets(splits, "cpu")
    x = (torch.randn(sum(splits), k, generator=gen) * 3).to(x_dtype)
    hist = torch.rand(2, 2 * g, generator=gen)  # slots 0, 2, 4..: a strided amax/scale view
    if mode == "delayed":
        scale = torch.rand(2 * g, generator=gen) * 40 + 1
        args_k = (scale[0::2], hist.clone()[0, 0::2])
        amax_k, amax_r = args_k[1], hist.clone()[0, 0::2]
        got = kg.grouped_cast_transpose(x, offsets, scale[0::2], amax_k, E4M3,
                                        write_transpose=True)
        want = rg.grouped_cast_transpose(x, offsets, scale[0::2], amax_r, E4M3,
                                         write_transpose=True)
    else:
        amax_k, amax_r = torch.zeros(g), torch.zeros(g)
        kg.grouped_amax_into(x, offsets, amax_k)
        rg.grouped_amax_into(x, offsets, amax_r)
        got = kg.grouped_cast_transpose(x, offsets, None, amax_k, E5M2, write_transpose=True,
                                        current=(0.0, False))
        want = rg.grouped_cast_transpose(x, offsets, None, amax_r, E5M2, write_transpose=True,
                                         current=(0.0, False))
    assert_same_bits(amax_k, amax_r, "amax")
    assert_same_bits(got[0], want[0], "data")
    assert_same_bits(_valid_t(got[1], offsets, k), _valid_t(want[1], offsets, k), "data_t")
    assert_same_bits(got[2], want[2], "scale_inv")
    assert got[0].float().abs().max() > 0
    # the kernel's transposed stores run to the 16-padded end: zeros there (the twin leaves it)
    pad = _padding_t(got[1], offsets, k)
    assert pad.numel() > 0 and torch.all(pad == 0)


def test_grouped_cast_amax_nan_inf_equals_ref_bits(gen):
    """A NaN in one group and an inf in another: each group's amax as the twin's (NaN wins
    over inf, one NaN whatever the input's payload), the casts the same bits."""
    splits = [5, 0, 37, 20]
    offsets = rg.make_offsets(splits, "cpu")
    x = (torch.randn(sum(splits), 48, generator=gen) * 3).to(torch.bfloat16)
    x[3, 7] = float("nan")
    x[20, 5], x[30, 1] = float("inf"), float("nan")
    x[50, 2] = -float("inf")
    scale = torch.rand(4, generator=gen) * 40 + 1
    amax_k = torch.rand(4, generator=gen)
    amax_r = amax_k.clone()
    got = kg.grouped_cast_transpose(x, offsets, scale, amax_k, E4M3, write_transpose=True)
    want = rg.grouped_cast_transpose(x, offsets, scale, amax_r, E4M3, write_transpose=True)
    assert amax_k[0].isnan() and amax_k[2].isnan() and amax_k[3] == float("inf")
    assert_same_bits(amax_k, amax_r, "amax")
    assert_same_bits(got[0], want[0], "data")
    assert_same_bits(_valid_t(got[1], offsets, 48), _valid_t(want[1], offsets, 48), "data_t")
