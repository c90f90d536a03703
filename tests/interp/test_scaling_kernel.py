"""`kernels.scaling.delayed_scaling_update` == its twin in `ref.scaling`, bit for bit.

Both update clones of the same state in place (amax_history [L, n], scale [n]); history and scale
must then agree as integer bits. The state is fresh random amaxes over many decades and random
old scales, with one slot of each case made special: row 0 == 0 (no roll, scale kept), row 0 or
an older row inf/NaN (keep the old scale; "max" sees older rows, "most_recent" does not), or an
amax so small that fp8_max/amax overflows (-> fp32 max). A multi-step test alternates simulated
casts (max into row 0) with updates, so rolled rows come back into the "max" window.
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.formats import FP32_MAX
from tritium.kernels import scaling as kscaling
from tritium.ref import scaling as rscaling

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,  # numpy warns on the inf/NaN arithmetic these tests are about
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]

FP8_MAXES = {"e4m3": 448.0, "e5m2": 57344.0}
SPECIALS = ["none", "row0_zero", "row0_inf", "row0_nan", "old_nan", "old_inf", "tiny", "subnormal"]


def random_state(length: int, slots: int, gen: torch.Generator):
    decades = torch.empty(length, slots, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    hist = (torch.rand(length, slots, generator=gen, dtype=torch.float64) + 0.05) * 10.0 ** decades
    scale = 2.0 ** torch.empty(slots).uniform_(-6, 6, generator=gen)
    return hist.float(), scale.float()


def make_special(hist: torch.Tensor, j: int, special: str) -> None:
    last = hist.shape[0] - 1
    if special == "row0_zero":
        hist[0, j] = 0.0
    elif special == "row0_inf":
        hist[0, j] = float("inf")
    elif special == "row0_nan":
        hist[0, j] = float("nan")
    elif special == "old_nan":
        hist[last, j] = float("nan")
    elif special == "old_inf":
        hist[last, j] = float("inf")
    elif special == "tiny":  # fp8_max / amax overflows fp32
        hist[:, j] = 1e-38
    elif special == "subnormal":
        hist[:, j] = 1e-42


def update_both(hist, scale, fp8_max, margin, algo):
    kh, ks, rh, rs = hist.clone(), scale.clone(), hist.clone(), scale.clone()
    kscaling.delayed_scaling_update(kh, ks, fp8_max, margin, algo)
    rscaling.delayed_scaling_update(rh, rs, fp8_max, margin, algo)
    assert_same_bits(kh, rh, "amax_history")
    assert_same_bits(ks, rs, "scale")
    return kh, ks


@pytest.mark.parametrize("length", [1, 3, 1024])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fmt", list(FP8_MAXES))
def test_update_random(length, slots, algo, margin, fmt, gen):
    hist, scale = random_state(length, slots, gen)
    new_hist, new_scale = update_both(hist, scale, FP8_MAXES[fmt], margin, algo)
    # what the rules say, independently of both implementations
    amax = hist.amax(0) if algo == "max" else hist[0]
    want = (torch.tensor(FP8_MAXES[fmt]) / amax) / 2.0 ** margin
    assert_same_bits(new_scale, want, "scale = fp8_max / amax / 2^margin")
    assert (new_hist[0] == 0).all()
    if length > 1:
        assert_same_bits(new_hist[-1], hist[0], "row 0 rolls to the end")
        assert_same_bits(new_hist[1:-1], hist[2:], "the rest moves up")


@pytest.mark.parametrize("special", SPECIALS)
@pytest.mark.parametrize("length", [1, 3, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_special_slot(special, length, algo, margin, gen):
    hist, scale = random_state(length, 3, gen)
    j = int(torch.randint(0, 3, (1,), generator=gen))
    make_special(hist, j, special)
    new_hist, new_scale = update_both(hist, scale, 448.0, margin, algo)
    col, old = hist[:, j], scale[j]
    if special == "row0_zero":
        assert_same_bits(new_hist[:, j], col, "row 0 == 0: column not rolled")
        assert_same_bits(new_scale[j], old, "row 0 == 0: scale kept")
        return
    assert new_hist[0, j] == 0
    sees_bad = special.startswith("row0_") or (special.startswith("old_") and algo == "max"
                                               and length > 1)
    if sees_bad:
        assert_same_bits(new_scale[j], old, "non-finite amax: scale kept")
    elif special in ("tiny", "subnormal") and margin == 0:
        assert new_scale[j].item() == FP32_MAX
    else:
        assert torch.isfinite(new_scale[j]) and new_scale[j] > 0


@pytest.mark.parametrize("length", [3, 16])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_many_steps(length, algo, gen):
    """Casts write row 0 by max-accumulation (some steps skip a slot); updates roll it."""
    hist, scale = random_state(length, 3, gen)
    hist.zero_()
    kh, ks, rh, rs = hist.clone(), scale.clone(), hist.clone(), scale.clone()
    for step in range(2 * length + 3):
        for j in range(3):
            if (step + j) % 4 == 3:
                continue  # slot unused this step: row 0 stays 0, no roll
            a = float(torch.rand(1, generator=gen)) * 10.0 ** (step % 5 - 2)
            kh[0, j] = torch.maximum(kh[0, j], torch.tensor(a))
            rh[0, j] = torch.maximum(rh[0, j], torch.tensor(a))
        kscaling.delayed_scaling_update(kh, ks, 57344.0, 1, algo)
        rscaling.delayed_scaling_update(rh, rs, 57344.0, 1, algo)
        assert_same_bits(kh, rh, f"history after step {step}")
        assert_same_bits(ks, rs, f"scale after step {step}")
    assert (ks != scale).all()


@pytest.mark.parametrize("length", [1, 3, 16])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_many_states_in_one_launch(length, algo, gen):
    """`delayed_scaling_update_many` (one launch, states of 3, 1 and 2 slots) == the reference
    state by state, over steps with fresh row-0 amaxes and special slots."""
    states = [random_state(length, n, gen) for n in (3, 1, 2)]
    for (hist, _), special in zip(states, ("row0_zero", "row0_nan", "tiny")):
        make_special(hist, 0, special)
    kh, ks = [h.clone() for h, _ in states], [s.clone() for _, s in states]
    rh, rs = [h.clone() for h, _ in states], [s.clone() for _, s in states]
    for step in range(3):
        kscaling.delayed_scaling_update_many(kh, ks, 448.0, 1, algo)
        rscaling.delayed_scaling_update_many(rh, rs, 448.0, 1, algo)
        for i in range(len(states)):
            assert_same_bits(kh[i], rh[i], f"state {i} history after step {step}")
            assert_same_bits(ks[i], rs[i], f"state {i} scale after step {step}")
        for k, r in zip(kh, rh):
            k[0] = r[0] = torch.rand(r.shape[1], generator=gen) * 10.0 ** (step - 1)
    assert (ks[0][1:] != states[0][1][1:]).all()  # its ordinary slots got new scales


def test_update_states_fused_and_rebuilt():
    """`update_states` runs one prepared launch for a region's states (kept on the first
    state), rebuilds it when a history is replaced, and falls back to one update per state
    where the states need different constants; the results match the reference each time."""
    import tritium as te  # noqa: F401  (the package's import order)
    from tritium import recipe
    from tritium.fp8.scaling import ScalingState, update_states
    rec = recipe.DelayedScaling(margin=1, amax_history_len=4)
    cpu = torch.device("cpu")
    torch.manual_seed(0)

    def run(states):
        ref = [(s.amax_history.clone(), s.scale.clone()) for s in states]
        for s in states:
            s.amax_history[0] = torch.rand(s.num_slots) * 100
        for (h, sc), s in zip(ref, states):
            h[0] = s.amax_history[0]
            rscaling.delayed_scaling_update(h, sc, 448.0 if s.fp8_dtype == torch.float8_e4m3fn
                                            else 57344.0, 1, "max")
        update_states(states, reduce=False)
        for (h, sc), s in zip(ref, states):
            assert_same_bits(s.amax_history, h, "history")
            assert_same_bits(s.scale, sc, "scale")

    states = [ScalingState(n, torch.float8_e4m3fn, rec, cpu) for n in (2, 4, 1)]
    run(states)
    first = states[0]._fused
    assert first[1] is not None
    run(states)
    assert states[0]._fused is first  # the same launch, not rebuilt
    states[1].resize_history(4)  # a new tensor: the table must point at it
    run(states)
    assert states[0]._fused is not first and states[0]._fused[1] is not None
    mixed = states + [ScalingState(2, torch.float8_e5m2, rec, cpu)]
    run(mixed)
    assert mixed[0]._fused[1] is None  # two fp8 dtypes: one update per state
