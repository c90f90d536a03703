"""`tritium.kernels.moe` == `tritium.ref.moe` under the interpreter.

permute / unpermute / the unpermute backward's d_inp and the router's routing map bit for bit;
sums over hidden or experts (d_probs, softmax) to fp32 rounding, since the two sum in another
order. Mask and index maps, with and without probs, dropped rows (num_out_tokens), and every
router mode (softmax pre/post, sigmoid with expert bias, group-limited top-k, aux scores).
"""
from __future__ import annotations

import pytest
import torch

from tritium.kernels import moe as km
from tritium.ref import moe as rm

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

T, E, H, TOPK = 9, 6, 40, 2


def _routing(map_type, gen):
    idx = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    if map_type == "index":
        return idx
    return torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)


@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_equal_ref_bits(map_type, drop, dtype, gen):
    routing = _routing(map_type, gen)
    row_id_map, rows = rm.make_row_id_map(routing, T * TOPK - 5 if drop else -1, map_type)
    slots = row_id_map.shape[1]
    x = torch.randn(T, H, generator=gen).to(dtype)
    probs = torch.rand(T, slots, generator=gen)
    got = km.permute(x, row_id_map, rows, probs)
    want = rm.permute(x, row_id_map, rows, probs)
    assert_same_bits(got[0], want[0], "permuted")
    assert_same_bits(got[1], want[1], "permuted probs")
    y = torch.randn(rows, H, generator=gen).to(dtype)
    for w in (None, probs):
        assert_same_bits(km.unpermute(y, row_id_map, w), rm.unpermute(y, row_id_map, w),
                         "unpermuted")
        g = torch.randn(T, H, generator=gen).to(dtype)
        d_k, dp_k = km.unpermute_backward(g, y, row_id_map, w)
        d_r, dp_r = rm.unpermute_backward(g, y, row_id_map, w)
        assert_same_bits(d_k, d_r, "d_inp")
        if w is not None:
            torch.testing.assert_close(dp_k, dp_r, rtol=1e-5, atol=1e-6)
            assert dp_k.abs().max() > 0


MODES = {
    "softmax-pre": dict(use_pre_softmax=True, score_function="softmax"),
    "softmax-post": dict(use_pre_softmax=False, score_function="softmax", scaling_factor=2.5),
    "sigmoid-bias": dict(use_pre_softmax=False, score_function="sigmoid", bias=True),
    "sigmoid-groups": dict(use_pre_softmax=False, score_function="sigmoid", num_groups=4,
                           group_topk=2, topk=4),
    "softmax-groups": dict(use_pre_softmax=True, score_function="softmax", num_groups=2,
                           group_topk=1),
    "aux-softmax": dict(use_pre_softmax=False, score_function="softmax", aux=True),
    "aux-sigmoid": dict(use_pre_softmax=False, score_function="sigmoid", aux=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_router_equals_ref(mode, gen):
    cfg = dict(MODES[mode])
    e = 8
    logits = torch.randn(T, e, generator=gen) * 2
    bias = torch.randn(e, generator=gen) * 0.1 if cfg.pop("bias", False) else None
    args = (logits, cfg.pop("topk", TOPK), cfg.pop("use_pre_softmax"), cfg.pop("num_groups", None),
            cfg.pop("group_topk", None), cfg.pop("scaling_factor", None), cfg.pop("score_function"),
            bias, cfg.pop("aux", False))
    got, want = km.router_forward(*args), rm.router_forward(*args)
    assert torch.equal(got[1], want[1]), "routing map"
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)
    g = torch.randn(T, e, generator=gen)
    bwd = (want[1], want[2], g, args[1], args[2], args[5], args[6], args[8])
    dk, dr = km.router_backward(*bwd), rm.router_backward(*bwd)
    torch.testing.assert_close(dk, dr, rtol=1e-5, atol=1e-7)
    assert dk.abs().max() > 0
