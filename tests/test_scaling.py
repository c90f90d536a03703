"""The delayed-scaling rule, step by step, against numbers written out by hand from DESIGN.md
section 4 (never computed by tritium's code):

    amax  = max over the history ("max") or row 0 ("most_recent") [or a callable]
    scale = (fp8_max / amax) / 2**margin   if amax is finite and > 0, else the old scale
            (an infinite result becomes fp32 max) [or a callable]
    the history column rolls up by one (row 0 to the end) and row 0 is zeroed,
    except where row 0 is 0 (nothing cast since the last update): no roll, scale kept.

First through `ScalingState.update` directly, then through a real `te.Linear` inside
`te.fp8_autocast` (forward scales update at the outermost autocast exit when grad is enabled,
backward scales after the backward of the region's first FP8 module). Amaxes are chosen so that
448 / amax / 4 (margin 2) and 57344 / amax / 4 are exact in fp32.
"""
from __future__ import annotations

import math

import pytest
import torch

import tritium as te
from testlib import E4M3, E5M2, FP32_MAX, with_amax
from tritium import recipe
from tritium.fp8.scaling import ScalingState

pytestmark = pytest.mark.cpu

INF, NAN = math.inf, math.nan


def make_state(n, length, algo="max", margin=2, dtype=E4M3, **kw):
    r = recipe.DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo, **kw)
    return ScalingState(n, dtype, r, torch.device("cpu"))


def write_row0(state, values):
    """What casts do: max-accumulate each slot's amax into row 0."""
    for i, v in enumerate(values):
        slot = state.amax_slot(i)
        slot.copy_(torch.maximum(slot, torch.tensor([v], dtype=torch.float32)))


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def assert_exact(actual, expected):
    expected = f32(expected).reshape(actual.shape)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# ScalingState.update
# --------------------------------------------------------------------------------------------

def test_initial_state():
    s = make_state(3, 5)
    assert_exact(s.scale, [1.0, 1.0, 1.0])
    assert_exact(s.amax_history, [[0.0] * 3] * 5)


def test_history_len_1_margin_2():
    s = make_state(3, 1)
    # Slot 2 is unused: not rolled, scale kept at its initial 1.
    write_row0(s, [3.5, 7.0, 0.0])
    s.update()
    assert_exact(s.scale, [448 / 3.5 / 4, 448 / 7 / 4, 1.0])   # [32, 16, 1]
    assert_exact(s.scale, [32.0, 16.0, 1.0])
    assert_exact(s.amax_history, [[0.0, 0.0, 0.0]])
    # inf and NaN keep the old scale; a tiny amax gives an infinite scale -> fp32 max.
    write_row0(s, [INF, NAN, 1e-44])
    s.update()
    assert_exact(s.scale, [32.0, 16.0, FP32_MAX])
    assert_exact(s.amax_history, [[0.0, 0.0, 0.0]])   # rolled (row 0 was not 0), then zeroed
    # After NaN/inf have left the (length 1) history, scales follow the data again.
    write_row0(s, [0.4375, 28.0, 1e-38])
    s.update()
    assert_exact(s.scale, [256.0, 4.0, FP32_MAX])   # 448 / 1e-38 overflows fp32 too


# One slot, history length 3, margin 2, E4M3: (amax written, history after the update,
# scale after the update with "max", scale after the update with "most_recent").
STEPS_LEN3 = [
    (14.0, [0.0, 0.0, 14.0], 8.0, 8.0),                # 448/14/4 = 8
    (3.5, [0.0, 14.0, 3.5], 8.0, 32.0),                # max(14, 3.5) = 14;  448/3.5/4 = 32
    (0.0, [0.0, 14.0, 3.5], 8.0, 32.0),                # nothing cast: no roll, scale kept
    (28.0, [0.0, 3.5, 28.0], 4.0, 4.0),                # 448/28/4 = 4
    (7.0, [0.0, 28.0, 7.0], 4.0, 16.0),                # history {7, 3.5, 28}
    (1.75, [0.0, 7.0, 1.75], 4.0, 64.0),               # history {1.75, 28, 7}
    (0.875, [0.0, 1.75, 0.875], 16.0, 128.0),          # 28 has left: {0.875, 7, 1.75}
    (0.4375, [0.0, 0.875, 0.4375], 64.0, 256.0),       # {0.4375, 1.75, 0.875}
]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_len_3_step_by_step(algo):
    s = make_state(1, 3, algo)
    for k, (amax, hist, scale_max, scale_recent) in enumerate(STEPS_LEN3):
        write_row0(s, [amax])
        s.update()
        assert_exact(s.amax_history[:, 0], hist)
        assert s.scale.item() == (scale_max if algo == "max" else scale_recent), f"step {k}"


# inf / NaN in a length-3 history: the rule keeps the old scale as long as the bad value is
# inside the window that the algorithm looks at.
STEPS_BAD = [
    (7.0, [0.0, 0.0, 7.0], 16.0, 16.0),
    (INF, [0.0, 7.0, INF], 16.0, 16.0),                # amax inf: scale kept, still rolled
    (14.0, [0.0, INF, 14.0], 16.0, 8.0),               # "max" still sees inf
    (28.0, [0.0, 14.0, 28.0], 16.0, 4.0),              # "max" still sees inf (row 1)
    (3.5, [0.0, 28.0, 3.5], 4.0, 32.0),                # inf has left the window
    (NAN, [0.0, 3.5, NAN], 4.0, 32.0),                 # NaN: scale kept
    (1.75, [0.0, NAN, 1.75], 4.0, 64.0),
]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_inf_and_nan_keep_the_scale(algo):
    s = make_state(1, 3, algo)
    for k, (amax, hist, scale_max, scale_recent) in enumerate(STEPS_BAD):
        write_row0(s, [amax])
        s.update()
        assert_exact(s.amax_history[:, 0], hist)
        assert s.scale.item() == (scale_max if algo == "max" else scale_recent), f"step {k}"


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_len_1024_window(algo):
    """3.5 at step 1, then 0.4375 at every step: "max" remembers 3.5 for exactly 1024 updates
    (the current amax and 1023 earlier ones), "most_recent" forgets it at once."""
    s = make_state(2, 1024, algo)
    write_row0(s, [3.5, 7.0])
    s.update()
    assert_exact(s.scale, [32.0, 16.0])
    assert s.amax_history[1023, 0].item() == 3.5
    assert torch.count_nonzero(s.amax_history).item() == 2
    for step in range(2, 1026):
        write_row0(s, [0.4375, 0.0])          # slot 1 unused from now on
        s.update()
        if step <= 1023:   # 3.5 moves up one row per update
            assert s.amax_history[1024 - step, 0].item() == 3.5
        if step in (2, 1023, 1024, 1025):
            expect = 32.0 if (algo == "max" and step <= 1024) else 256.0
            assert s.scale[0].item() == expect, f"step {step}"
    assert s.scale[1].item() == 16.0                               # never rolled again
    assert s.amax_history[1023, 1].item() == 7.0
    assert torch.count_nonzero(s.amax_history[:, 1]).item() == 1
    # After 1025 updates slot 0 holds 0.4375 in rows 1..1023 and 0 in row 0.
    assert s.amax_history[0, 0].item() == 0.0
    assert bool((s.amax_history[1:, 0] == 0.4375).all())


def test_margin_0_and_e5m2():
    s = make_state(2, 2, margin=0, dtype=E5M2)
    write_row0(s, [14.0, 3.0])
    s.update()
    # 57344 / 14 = 4096 exactly; 57344 / 3 rounded once to fp32.
    assert s.scale[0].item() == 4096.0
    assert s.scale[1].item() == f32(57344 / 3).item()


def test_callable_amax_compute_algo():
    seen = []

    def algo(history):           # TE's contract: [L, n] history -> [n] amax
        seen.append(history.clone())
        return history.sum(0)

    s = make_state(1, 3, algo)
    write_row0(s, [7.0])
    s.update()
    assert s.scale.item() == 16.0                 # 448 / 7 / 4
    assert_exact(seen[-1][:, 0], [7.0, 0.0, 0.0])
    assert_exact(s.amax_history[:, 0], [0.0, 0.0, 7.0])
    write_row0(s, [21.0])
    s.update()
    assert s.scale.item() == 4.0                  # sum 21 + 7 = 28 -> 448 / 28 / 4
    assert_exact(s.amax_history[:, 0], [0.0, 7.0, 21.0])
    write_row0(s, [0.0])                          # unused: not rolled, scale kept
    s.update()
    assert s.scale.item() == 4.0
    assert_exact(s.amax_history[:, 0], [0.0, 7.0, 21.0])


def test_callable_scaling_factor_compute_algo():
    calls = []

    def sf(amax, scale, fp8_max, rcp):           # TE's contract: (amax, scale, fp8_max, recipe)
        calls.append((amax.clone(), scale.clone(), fp8_max, rcp))
        return torch.exp2(torch.floor(torch.log2(fp8_max / amax)))   # power-of-two scales

    r_fwd = make_state(2, 2, scaling_factor_compute_algo=sf)
    write_row0(r_fwd, [3.0, 0.0])
    r_fwd.update()
    # floor(log2(448 / 3 = 149.3)) = 7 -> 128; slot 1 unused keeps 1.
    assert_exact(r_fwd.scale, [128.0, 1.0])
    amax, scale, fp8_max, rcp = calls[-1]
    assert_exact(amax, [3.0, 0.0]) and fp8_max == 448.0 and rcp is r_fwd.recipe
    assert_exact(scale, [1.0, 1.0])
    assert_exact(r_fwd.amax_history, [[0.0, 0.0], [3.0, 0.0]])
    r_bwd = make_state(1, 2, dtype=E5M2, algo="most_recent", scaling_factor_compute_algo=sf)
    write_row0(r_bwd, [5.0])
    r_bwd.update()
    assert calls[-1][2] == 57344.0
    assert r_bwd.scale.item() == 8192.0            # floor(log2(11468.8)) = 13


def test_resize_history_keeps_newest_rows():
    s = make_state(1, 4)
    for v in (14.0, 3.5, 7.0):
        write_row0(s, [v])
        s.update()
    assert_exact(s.amax_history[:, 0], [0.0, 14.0, 3.5, 7.0])
    s.resize_history(2)            # row 0 and the newest finished amax (7.0, the last row)
    assert_exact(s.amax_history[:, 0], [0.0, 7.0])
    s.resize_history(5)            # growing keeps the order: older rows are empty
    assert_exact(s.amax_history[:, 0], [0.0, 0.0, 0.0, 0.0, 7.0])
    write_row0(s, [1.75])          # the slot views follow the new tensor
    assert s.amax_history[0, 0].item() == 1.75


# --------------------------------------------------------------------------------------------
# Through te.Linear inside te.fp8_autocast
# --------------------------------------------------------------------------------------------
IN, OUT = 32, 16
X_AMAX = [3.5, 1.75, 7.0, 0.875, 0.4375]
DY_AMAX = [14.0, 28.0, 7.0, 3.5, 1.75]
W_AMAX = 0.4375
# history length 3, margin 2. Forward: E4M3 (448); backward under HYBRID: E5M2 (57344).
X_SCALE = {"max": [32.0, 32.0, 16.0, 16.0, 16.0], "most_recent": [32.0, 64.0, 16.0, 128.0, 256.0]}
DY_SCALE = {"max": [1024.0, 512.0, 512.0, 512.0, 2048.0],
            "most_recent": [1024.0, 512.0, 2048.0, 4096.0, 8192.0]}
W_SCALE = 256.0                                 # 448 / 0.4375 / 4


def make_linear(randn):
    lin = te.Linear(IN, OUT, device="cpu")
    with torch.no_grad():
        lin.weight.copy_(with_amax(randn(OUT, IN, scale=0.2), W_AMAX))
        lin.bias.copy_(randn(OUT, scale=0.1))
    return lin


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_linear_scales_step_by_step(randn, algo):
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3, amax_compute_algo=algo)
    lin = make_linear(randn)
    prev_x, prev_dy = 1.0, 1.0
    for k in range(len(X_AMAX)):
        x = with_amax(randn(7, IN), X_AMAX[k]).requires_grad_()
        dy = with_amax(randn(7, OUT), DY_AMAX[k])
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            y = lin(x)
            # Inside the region: amaxes recorded in row 0, scales not updated yet.
            fwd, bwd = lin.fp8_meta.fwd, lin.fp8_meta.bwd
            assert_exact(fwd.amax_history[0], [X_AMAX[k], W_AMAX])
            assert_exact(fwd.scale, [prev_x, W_SCALE if k else 1.0])
        # Outermost exit: forward scales updated; backward ones untouched until backward.
        assert_exact(fwd.scale, [X_SCALE[algo][k], W_SCALE])
        assert_exact(fwd.amax_history[0], [0.0, 0.0])
        assert_exact(fwd.amax_history[2], [X_AMAX[k], W_AMAX])
        assert_exact(bwd.scale, [prev_dy])
        assert bwd.amax_history[0, 0].item() == 0.0
        y.backward(dy)
        assert_exact(bwd.scale, [DY_SCALE[algo][k]])
        assert_exact(bwd.amax_history[:, 0],
                     [0.0] + ([0.0] * (2 - k) + DY_AMAX[max(0, k - 1):k + 1])[-2:])
        prev_x, prev_dy = X_SCALE[algo][k], DY_SCALE[algo][k]


def test_linear_forward_scales_update_at_outermost_exit_only(randn):
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3)
    lin = make_linear(randn)
    x = with_amax(randn(5, IN), 3.5)
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            lin(x)
        assert_exact(lin.fp8_meta.fwd.scale, [1.0, 1.0])          # inner exit: nothing
        assert_exact(lin.fp8_meta.fwd.amax_history[0], [3.5, W_AMAX])
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            lin(with_amax(randn(5, IN), 7.0))
        assert_exact(lin.fp8_meta.fwd.scale, [1.0, 1.0])
    # One update for the whole region, with both forwards' amaxes max-accumulated in row 0.
    assert_exact(lin.fp8_meta.fwd.scale, [16.0, W_SCALE])
    assert_exact(lin.fp8_meta.fwd.amax_history[:, 0], [0.0, 0.0, 7.0])


def test_linear_no_update_without_grad(randn):
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3)
    lin = make_linear(randn)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        lin(with_amax(randn(5, IN), 7.0))
    assert_exact(lin.fp8_meta.fwd.scale, [1.0, 1.0])
    assert_exact(lin.fp8_meta.fwd.amax_history[:, 0], [7.0, 0.0, 0.0])   # kept for later
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        lin(with_amax(randn(5, IN), 3.5))
    assert_exact(lin.fp8_meta.fwd.scale, [16.0, W_SCALE])                # max(7, 3.5) = 7
    assert_exact(lin.fp8_meta.fwd.amax_history[:, 0], [0.0, 0.0, 7.0])


def test_linear_backward_scales_update_after_first_module(randn):
    """Two Linears in sequence: l2's backward runs first; both backward scales update only
    after l1 (the region's first FP8 module) has run its backward."""
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3)
    l1, l2 = te.Linear(IN, IN, device="cpu"), make_linear(randn)
    x = with_amax(randn(9, IN), 3.5).requires_grad_()
    dy = with_amax(randn(9, OUT), 14.0)
    seen = {}
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        h = l1(x)
        h.register_hook(lambda g: seen.update(
            l2_scale=l2.fp8_meta.bwd.scale.clone(), l2_row0=l2.fp8_meta.bwd.amax_history[0].clone(),
            h_amax=g.abs().max().item()))
        y = l2(h)
    y.backward(dy)
    # Between l2's and l1's backward: l2 recorded its amax but was not updated yet.
    assert_exact(seen["l2_scale"], [1.0])
    assert_exact(seen["l2_row0"], [14.0])
    assert_exact(l2.fp8_meta.bwd.scale, [1024.0])          # 57344 / 14 / 4
    expect_l1 = torch.tensor(57344.0) / torch.tensor(seen["h_amax"]) / 4
    assert_exact(l1.fp8_meta.bwd.scale, [expect_l1.item()])
    # Exactly one update each: the amax sits in the last row, row 0 is clear.
    assert_exact(l2.fp8_meta.bwd.amax_history[:, 0], [0.0, 0.0, 14.0])
    assert l1.fp8_meta.bwd.amax_history[0, 0].item() == 0.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_cached_weight_slot_not_rolled(randn, algo):
    """is_first_microbatch=True casts (and records) the weight; False reuses the cached fp8
    weight, records no amax, so the weight slot is neither rolled nor rescaled."""
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3, amax_compute_algo=algo)
    lin = make_linear(randn)
    x_amax = [3.5, 7.0, 1.75]
    for k, first in enumerate([True, False, False]):
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            lin(with_amax(randn(5, IN), x_amax[k]), is_first_microbatch=first)
        hist = lin.fp8_meta.fwd.amax_history
        assert_exact(hist[:, 1], [0.0, 0.0, W_AMAX])      # weight: rolled once, at step 0
        assert lin.fp8_meta.fwd.scale[1].item() == W_SCALE
    # Input slot rolled every step: history {1.75, 7} after the roll that dropped 3.5's row 0.
    assert_exact(hist[:, 0], [0.0, 7.0, 1.75])
    assert lin.fp8_meta.fwd.scale[0].item() == (16.0 if algo == "max" else 64.0)


def test_calibration_records_and_updates_without_fp8(randn):
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=3)
    lin = make_linear(randn)
    ref = torch.nn.functional.linear
    x = with_amax(randn(6, IN), 3.5)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=rcp):
        y = lin(x)
    torch.testing.assert_close(y, ref(x, lin.weight, lin.bias), rtol=1.3e-6, atol=1e-5)
    assert_exact(lin.fp8_meta.fwd.scale, [32.0, W_SCALE])


def test_linear_special_amaxes(randn):
    """Through a Linear (history length 1, margin 2): an input with inf or NaN keeps the input
    scale, a tiny input gives fp32 max; the weight slot follows its own (finite) amax."""
    rcp = recipe.DelayedScaling(margin=2, amax_history_len=1)
    lin = make_linear(randn)
    base = randn(5, IN)
    steps = [(with_amax(base, 3.5), 32.0),
             (with_amax(base, 3.5).index_put_((torch.tensor(0), torch.tensor(1)),
                                              torch.tensor(INF)), 32.0),
             (with_amax(base, 3.5).index_put_((torch.tensor(2), torch.tensor(3)),
                                              torch.tensor(NAN)), 32.0),
             (with_amax(base, 1e-44), FP32_MAX),
             (with_amax(base, 7.0), 16.0)]
    for k, (x, expect) in enumerate(steps):
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            lin(x.requires_grad_())
        assert_exact(lin.fp8_meta.fwd.scale, [expect, W_SCALE])
        assert_exact(lin.fp8_meta.fwd.amax_history, [[0.0, 0.0]])


def test_linear_with_callable_algorithms(randn):
    calls = []

    def sf(amax, scale, fp8_max, rcp):
        calls.append(fp8_max)
        return torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(fp8_max / amax))), scale)

    rcp = recipe.DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.sum(0),
                                scaling_factor_compute_algo=sf)
    lin = make_linear(randn)
    for k, (xa, dya) in enumerate([(3.5, 14.0), (7.0, 3.5)]):
        with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
            y = lin(with_amax(randn(5, IN), xa).requires_grad_())
        y.backward(with_amax(randn(5, OUT), dya))
    # Input: sum 3.5 + 7 = 10.5 -> 448 / 10.5 = 42.7 -> 32. Weight: 2 * 0.4375 = 0.875 -> 512.
    assert_exact(lin.fp8_meta.fwd.scale, [32.0, 512.0])
    # grad_output (E5M2): 14 + 3.5 = 17.5 -> 57344 / 17.5 = 3276.8 -> 2048.
    assert_exact(lin.fp8_meta.bwd.scale, [2048.0])
    assert calls == [448.0, 57344.0, 448.0, 57344.0]
