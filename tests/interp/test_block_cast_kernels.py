"""`tritium.kernels.block_cast.quantize_blocks` == `tritium.ref.block_cast.quantize_blocks`, bits.

Shapes cross the 128 edges in both dims (partial tiles, masked), rows span decades (so every
1x128 tile gets its own power-of-2 scale), and a zero tile, an inf and a NaN check the
special amaxes (scale 1, a NaN amax -> scale 1 and NaN data, an inf amax -> scale 1).
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import block_cast as kblock
from tritium.ref import block_cast as rblock

from ._helpers import assert_same_bits

pytestmark = pytest.mark.interp

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _tokens(m, k, gen, dtype=torch.float32):
    mag = 10.0 ** (torch.rand(m, 1, generator=gen) * 6 - 3)
    return (torch.randn(m, k, generator=gen) * mag).to(dtype)


@pytest.mark.parametrize("m,k", [(128, 128), (200, 300), (64, 136)])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("fp8_dtype,power_2", [(E4M3, True), (E5M2, False)])
def test_block_cast_kernel_equals_ref_bits(m, k, block_2d, fp8_dtype, power_2, gen):
    x = _tokens(m, k, gen, torch.bfloat16 if power_2 else torch.float32)
    x[:8, :128] = 0   # zero 1x128 tiles
    if m > 128:
        x[128:, :128] = 0   # a zero 128x128 block (partial)
    kwargs = dict(block_2d=block_2d, rowwise=True, columnwise=True, power_2_scale=power_2,
                  amax_epsilon=0.0 if power_2 else 1e-12)
    got = kblock.quantize_blocks(x, fp8_dtype, **kwargs)
    want = rblock.quantize_blocks(x, fp8_dtype, **kwargs)
    for name in rblock.BlockQuantized._fields:
        assert getattr(got, name).shape == getattr(want, name).shape, name
        assert_same_bits(getattr(got, name), getattr(want, name), f"{name} {m}x{k}")
    assert want.data.float().abs().max() > 0
    if power_2:
        s = want.scale_inv
        assert torch.equal(s, torch.exp2(torch.log2(s).round())), "scales are powers of 2"


@pytest.mark.parametrize("m,k", [(200, 300), (64, 136)])
@pytest.mark.parametrize("config", [(32, 4), (128, 8), (64, 8)])
def test_block_cast_kernel_configs_equal_ref_bits(m, k, config, gen):
    """Every tile config of the 1x128 cast writes the twin's bits, special values included."""
    x = _tokens(m, k, gen)
    x[3, 5], x[m - 1, 9], x[:8, 128:] = float("inf"), float("nan"), 0
    got = kblock.quantize_blocks(x, E4M3, rowwise=True, columnwise=True, config=config)
    want = rblock.quantize_blocks(x, E4M3, rowwise=True, columnwise=True)
    for name in rblock.BlockQuantized._fields:
        assert_same_bits(getattr(got, name), getattr(want, name), f"{name} {config}")


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_block_cast_kernel_one_direction(rowwise, columnwise, gen):
    x = _tokens(130, 260, gen)
    got = kblock.quantize_blocks(x, E4M3, rowwise=rowwise, columnwise=columnwise)
    want = rblock.quantize_blocks(x, E4M3, rowwise=rowwise, columnwise=columnwise)
    for name in rblock.BlockQuantized._fields:
        if getattr(want, name) is None:
            assert getattr(got, name) is None
        else:
            assert_same_bits(getattr(got, name), getattr(want, name), name)


def test_block_cast_kernel_special_values(gen):
    x = torch.randn(128, 256, generator=gen)
    x[3, 5] = float("nan")
    x[7, 200] = float("inf")
    got = kblock.quantize_blocks(x, E4M3, rowwise=True, columnwise=True)
    want = rblock.quantize_blocks(x, E4M3, rowwise=True, columnwise=True)
    for name in rblock.BlockQuantized._fields:
        assert_same_bits(getattr(got, name), getattr(want, name), name, nan_as_nan=True)
    assert want.scale_inv[0, 3] == 1 and want.scale_inv[1, 7] == 1


@pytest.mark.parametrize("block_2d", [False, True])
def test_block_cast_kernel_flagged_into_buffers(block_2d, gen):
    """quantize_blocks(skip=flag, out=buffers) (CUDA graphs with weight caching): flag 0 writes
    the buffers with the fresh call's bits, flag 1 leaves them as they were; kernel == twin."""
    x = _tokens(130, 260, gen)
    fresh = rblock.quantize_blocks(x, E4M3, block_2d=block_2d, rowwise=True, columnwise=True)
    for mod in (kblock, rblock):
        out = rblock.BlockQuantized(*(torch.full_like(t.view(torch.uint8) if t.dtype == E4M3
                                                      else t, 3).view(t.dtype)
                                      for t in fresh))
        before = [t.clone() for t in out]
        for flag, want in ((1, before), (0, list(fresh))):
            got = mod.quantize_blocks(x, E4M3, block_2d=block_2d, rowwise=True, columnwise=True,
                                      skip=torch.tensor([flag], dtype=torch.int32), out=out)
            for name, g, o, w in zip(rblock.BlockQuantized._fields, got, out, want):
                assert g is o, name   # the buffers themselves come back
                assert_same_bits(o, w, f"{mod.__name__} flag={flag} {name}")
