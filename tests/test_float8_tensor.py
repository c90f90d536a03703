"""Float8Tensor: quantize/dequantize within FP8 rounding error, scale_inv the exactly rounded
1/scale, ops it does not implement run on the dequantized values, detach/clone/views stay FP8,
copy_ and in-place ops requantize with the tensor's own scale."""
from __future__ import annotations

import pytest
import torch

from testlib import E4M3, E5M2, FP8_MAX, FP32_TOL, fake_quant
from tritium import Float8Tensor

pytestmark = pytest.mark.cpu

# Half a unit in the last place (relative) and half the smallest subnormal, per format.
REL = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
ABS = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}


def exact_inverse(scale: float) -> float:
    """1/scale correctly rounded to fp32 (fp64 division, then one rounding: exact for fp32)."""
    return torch.tensor(1.0 / scale, dtype=torch.float64).float().item()


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("nominal", [torch.float32, torch.bfloat16])
def test_round_trip_within_fp8_error(randn, fp8, nominal):
    x = randn(33, 48, scale=3.0).to(nominal)
    scale = FP8_MAX[fp8] / x.float().abs().max() / 2           # leaves headroom, not a power of 2
    amax = torch.zeros(1)
    f = Float8Tensor.quantize(x, scale.reshape(1), fp8, amax=amax)
    assert f.dtype == nominal and f.shape == x.shape and f._data.dtype == fp8
    assert amax.item() == x.float().abs().max().item()          # recorded when asked
    back = f.dequantize()
    assert back.dtype == nominal
    err = (back.float() - x.float()).abs()
    # Plus one more rounding when the dequantized value is written in bf16.
    rel = REL[fp8] + (2.0 ** -8 if nominal == torch.bfloat16 else 2.0 ** -23)
    bound = rel * x.float().abs() + ABS[fp8] / scale
    assert bool((err <= bound).all())
    assert err.max() > 0                                         # it really was quantized
    # The same values as the independent emulation.
    torch.testing.assert_close(back.float(), fake_quant(x, scale, fp8).to(nominal).float(),
                               rtol=0, atol=0)


def test_overflow_saturates_and_nan_stays(randn):
    x = randn(4, 16)
    x[0, 0], x[1, 1], x[2, 2] = 1e6, -1e6, float("nan")
    f = Float8Tensor.quantize(x, torch.tensor([2.0]), E4M3)
    back = f.dequantize()
    assert back[0, 0].item() == 224.0 and back[1, 1].item() == -224.0    # 448 / 2
    assert torch.isnan(back[2, 2])


@pytest.mark.parametrize("scale", [3.0, 448 / 3.7, 0.1, 1e-3, 7.0 / 3.0, 12345.678])
def test_scale_inv_is_exact_reciprocal(randn, scale):
    s = torch.tensor([scale], dtype=torch.float32)
    f = Float8Tensor.quantize(randn(16, 16) * 1e-3, s, E4M3)
    assert f._scale_inv.dtype == torch.float32
    assert f._scale_inv.item() == exact_inverse(s.item())


def test_scale_inv_exact_for_many_scales(randn):
    scales = (randn(2000).abs() * 1000 + 1e-3).float()
    for s in scales[:200]:
        f = Float8Tensor.quantize(torch.ones(1, 16), s.reshape(1), E5M2)
        assert f._scale_inv.item() == exact_inverse(s.item()), s.item()


def test_fallback_ops_run_on_dequantized_values(randn):
    x = randn(8, 16)
    f = Float8Tensor.quantize(x, torch.tensor([40.0]), E4M3)
    d = f.dequantize()
    w = randn(16, 5)
    for got, want in ((f + 1, d + 1), (f * 2.5, d * 2.5), (f @ w, d @ w), (f.sum(), d.sum()),
                      (torch.nn.functional.relu(f), torch.relu(d)), (f.t(), d.t())):
        assert type(got) is torch.Tensor and got.dtype == torch.float32
        torch.testing.assert_close(got, want, **FP32_TOL)
    # Not simply the original values: the results carry the fp8 rounding.
    assert not torch.allclose(f.sum(), x.sum(), rtol=1e-6, atol=0)


def test_detach_clone_view_stay_fp8(randn):
    x = randn(8, 16)
    f = Float8Tensor.quantize(x, torch.tensor([40.0]), E4M3, with_transpose=True)
    assert torch.equal(f._transpose.view(torch.uint8), f._data.t().contiguous().view(torch.uint8))
    det = f.detach()
    assert isinstance(det, Float8Tensor) and det._data.data_ptr() == f._data.data_ptr()
    cl = f.clone()
    assert isinstance(cl, Float8Tensor) and cl._fp8_dtype == E4M3
    assert cl._data.data_ptr() != f._data.data_ptr()
    assert torch.equal(cl._data.view(torch.uint8), f._data.view(torch.uint8))
    assert torch.equal(cl._transpose.view(torch.uint8), f._transpose.view(torch.uint8))
    assert torch.equal(cl.dequantize(), f.dequantize())
    v = f.view(16, 8)
    assert isinstance(v, Float8Tensor) and v.shape == (16, 8)
    assert torch.equal(v.dequantize(), f.dequantize().view(16, 8))


def test_copy_requantizes_with_own_scale(randn):
    f = Float8Tensor.quantize(randn(8, 16), torch.tensor([40.0]), E4M3, with_transpose=True)
    y = randn(8, 16, scale=2.0)
    f.copy_(y)
    torch.testing.assert_close(f.dequantize(), fake_quant(y, 40.0, E4M3), rtol=0, atol=0)
    assert f._scale_inv.item() == exact_inverse(40.0)
    assert torch.equal(f._transpose.view(torch.uint8), f._data.t().contiguous().view(torch.uint8))
    # From another Float8Tensor of the same format: its bits and scale_inv are taken as they are.
    g = Float8Tensor.quantize(randn(8, 16), torch.tensor([3.0]), E4M3)
    f.copy_(g)
    assert torch.equal(f._data.view(torch.uint8), g._data.view(torch.uint8))
    assert f._scale_inv.item() == g._scale_inv.item()
    assert torch.equal(f.dequantize(), g.dequantize())


def test_in_place_ops_requantize(randn):
    x = randn(8, 16)
    f = Float8Tensor.quantize(x, torch.tensor([40.0]), E4M3)
    d = f.dequantize()
    r = f.mul_(2.0)
    assert r is f and isinstance(f, Float8Tensor)
    torch.testing.assert_close(f.dequantize(), fake_quant(d * 2.0, 40.0, E4M3), rtol=0, atol=0)
    f.add_(1.0)
    torch.testing.assert_close(f.dequantize(), fake_quant(fake_quant(d * 2.0, 40.0, E4M3) + 1.0,
                                                          40.0, E4M3), rtol=0, atol=0)
    f.zero_()
    assert bool((f.dequantize() == 0).all())


def test_constructor_checks():
    with pytest.raises(TypeError, match="fp8 dtype"):
        Float8Tensor(torch.zeros(2, 2), torch.ones(1), E4M3)
    with pytest.raises(TypeError, match="scale_inv"):
        Float8Tensor(torch.zeros(2, 2).to(E4M3), torch.ones(2), E4M3)
    with pytest.raises(ValueError, match="2D"):
        Float8Tensor.quantize(torch.ones(2, 2, 16), torch.ones(1), E4M3, with_transpose=True)


def test_transpose_fp8_checks_its_arguments_and_transposes(randn):
    """tritium.fp8.cast.transpose_fp8: the contiguous transpose of fp8 bytes; a wrong `out` or a
    non-byte / non-2D input is refused with the expected shape named, before anything is written."""
    from tritium.fp8.cast import transpose_fp8
    x8 = (randn(24, 40) * 50).to(E4M3)
    t = transpose_fp8(x8)
    assert t.is_contiguous() and torch.equal(t.view(torch.uint8), x8.view(torch.uint8).t())
    out = torch.empty(40, 24, dtype=E4M3)
    assert transpose_fp8(x8, out=out) is out and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    with pytest.raises(ValueError, match=r"out must be a contiguous .*\(40, 24\)"):
        transpose_fp8(x8, out=torch.empty(24, 40, dtype=E4M3))
    with pytest.raises(ValueError, match="one-byte elements"):
        transpose_fp8(randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="2D"):
        transpose_fp8(x8.reshape(2, 12, 40))
