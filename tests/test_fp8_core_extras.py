"""Recipe flags are validated, fp8_autocast is per thread, Float8Tensor flattening keeps its scale."""
from __future__ import annotations

import threading

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.autocast import current
from tritium.fp8.tensor import Float8Tensor

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("kwargs, name", [
    (dict(reduce_amax=1), "reduce_amax"),
    (dict(amax_epsilon=1e39), "amax_epsilon"),
    (dict(power_2_scale="yes"), "power_2_scale"),
])
def test_recipe_flags_are_validated(kwargs, name):
    cls = recipe.DelayedScaling if name == "reduce_amax" else recipe.Float8CurrentScaling
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


def test_fp8_autocast_state_is_per_thread():
    seen = {}

    def other_thread():
        seen["state"] = current()

    with te.fp8_autocast():
        assert current() is not None
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen["state"] is None and current() is None


def test_float8_tensor_flatten_round_trip_keeps_scale():
    x = torch.randn(16, 32) * 3
    scale = torch.full((1,), 8.0)
    t = Float8Tensor.quantize(x, scale, torch.float8_e4m3fn, with_transpose=True)
    names, meta = t.__tensor_flatten__()
    assert "_scale" in names and "_transpose" in names
    back = Float8Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, meta, None, None)
    back.copy_(x * 0.5)  # needs the scale
    torch.testing.assert_close(back.dequantize(), (x * 0.5), rtol=0.125, atol=0.0675)
