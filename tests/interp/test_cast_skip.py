"""The cast's device skip flag (CUDA graphs with FP8 weight caching) under the Triton interpreter.

`cast_transpose(..., skip=flag, out=buffers)`: with flag 0 the kernel casts into the given
buffers exactly as a plain launch would (bit for bit, and == the ref twin); with flag 1 it
returns before touching anything: the buffers keep their previous contents bit for bit and
the amax is not recorded. The twin does the same with a host check. The buffers are pre-filled
with a recognisable pattern so that a skipped cast that wrote anything is caught.
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8 import cast as fp8_cast
from tritium.kernels import cast as kcast
from tritium.ref import cast as rcast

from ._helpers import assert_same_bits, wide_randn

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _buffers(m, n, pad, fp8, gen):
    mp = -(-m // pad) * pad
    data = torch.randint(0, 100, (mp, n), generator=gen, dtype=torch.uint8).view(fp8)
    data_t = torch.randint(0, 100, (n, mp), generator=gen, dtype=torch.uint8).view(fp8)
    scale_inv = torch.rand(1, generator=gen) + 7.0
    return data, data_t, scale_inv


def _clone(bufs):
    return tuple(b.clone() for b in bufs)


@pytest.mark.parametrize("shape,pad", [((17, 48), 1), ((33, 80), 16), ((5, 16), 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_flag_zero_casts_like_plain_launch(shape, pad, dtype, fp8, mode, _seed):
    gen = torch.Generator().manual_seed(_seed)
    x = wide_randn(shape, dtype, gen, decades=2.0)
    scale = torch.tensor([float(torch.rand(1, generator=gen)) * 30 + 1])
    current = (0.0, False) if mode == "current" else None
    results = {}
    for name, impl in (("kernel", kcast), ("ref", rcast)):
        amax0 = torch.tensor([0.25])
        if current is not None:
            rcast.amax_into(x, amax0)
        amax_plain, amax_flag = amax0.clone(), amax0.clone()
        plain = impl.cast_transpose(x, None if current else scale, amax_plain, fp8,
                                    pad_rows_to=pad, write_transpose=True, current=current)
        bufs = _buffers(*shape, pad, fp8, gen)
        flag = torch.zeros(1, dtype=torch.int32)
        got = impl.cast_transpose(x, None if current else scale, amax_flag, fp8, pad_rows_to=pad,
                                  write_transpose=True, current=current, skip=flag, out=bufs)
        for what, g, p in zip(("data", "data_t", "scale_inv"), got, plain):
            assert_same_bits(g, p, f"{name} {what}")
        for g, b in zip(got, bufs):  # written in place, not into fresh tensors
            assert g.data_ptr() == b.data_ptr()
        assert_same_bits(amax_flag, amax_plain, f"{name} amax")
        results[name] = got + (amax_flag,)
    for what, k, r in zip(("data", "data_t", "scale_inv", "amax"), results["kernel"],
                          results["ref"]):
        assert_same_bits(k, r, f"kernel vs ref {what}")


@pytest.mark.parametrize("impl", [kcast, rcast], ids=["kernel", "ref"])
@pytest.mark.parametrize("writes", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_flag_set_is_a_no_op(impl, writes, mode, _seed):
    gen = torch.Generator().manual_seed(_seed)
    x = wide_randn((33, 48), torch.float32, gen)
    write_data, write_t = writes
    bufs = _buffers(33, 48, 16, E4M3, gen)
    before = _clone(bufs)
    amax = torch.tensor([0.125])
    flag = torch.ones(1, dtype=torch.int32)
    current = (0.0, False) if mode == "current" else None
    got = impl.cast_transpose(x, None if current else torch.tensor([3.0]), amax, E4M3,
                              pad_rows_to=16, write_data=write_data, write_transpose=write_t,
                              current=current, skip=flag, out=bufs)
    for what, b, w in zip(("data", "data_t", "scale_inv"), bufs, before):
        assert_same_bits(b, w, f"{what} changed by a skipped cast")
    assert_same_bits(amax, torch.tensor([0.125]), "amax recorded by a skipped cast")
    assert (got[0] is None) == (not write_data) and (got[1] is None) == (not write_t)
    assert got[2].data_ptr() == bufs[2].data_ptr()


def test_flag_is_read_at_launch_time(_seed):
    """The same flag tensor, flipped between launches: what a graph replay relies on."""
    gen = torch.Generator().manual_seed(_seed)
    x1, x2 = wide_randn((16, 32), torch.float32, gen), wide_randn((16, 32), torch.float32, gen)
    scale, amax = torch.tensor([4.0]), torch.zeros(1)
    flag = torch.zeros(1, dtype=torch.int32)
    bufs = _buffers(16, 32, 16, E4M3, gen)
    kcast.cast_transpose(x1, scale, amax, E4M3, pad_rows_to=16, write_transpose=True,
                         skip=flag, out=bufs)
    first = _clone(bufs)
    flag.fill_(1)
    kcast.cast_transpose(x2, scale, amax, E4M3, pad_rows_to=16, write_transpose=True,
                         skip=flag, out=bufs)
    for b, f in zip(bufs, first):
        assert_same_bits(b, f, "skipped launch")
    assert_same_bits(amax, x1.abs().amax().reshape(1), "amax of the first launch only")
    flag.fill_(0)
    kcast.cast_transpose(x2, scale, amax, E4M3, pad_rows_to=16, write_transpose=True,
                         skip=flag, out=bufs)
    want = rcast.cast_transpose(x2, scale, None, E4M3, pad_rows_to=16, write_transpose=True)
    for what, b, w in zip(("data", "data_t", "scale_inv"), bufs, want):
        assert_same_bits(b, w, f"re-enabled launch {what}")


def test_dispatcher_checks_the_buffers():
    x = torch.randn(17, 32)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs out="):
        fp8_cast.cast_transpose(x, torch.ones(1), None, E4M3, skip=flag)
    bad = (torch.empty(17, 32, dtype=E4M3), torch.empty(32, 17, dtype=E5M2), torch.empty(1))
    with pytest.raises(ValueError, match="data_t must be"):
        fp8_cast.cast_transpose(x, torch.ones(1), None, E4M3, write_transpose=True, skip=flag,
                                out=bad)
    with pytest.raises(ValueError, match="int32"):
        fp8_cast.cast_transpose(x, torch.ones(1), None, E4M3, skip=flag.long(),
                                out=(torch.empty(17, 32, dtype=E4M3), None, torch.empty(1)))
