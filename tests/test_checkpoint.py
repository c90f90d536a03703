"""Checkpoints of FP8 state: train under fp8_autocast, torch.save the state_dict, load it with
torch.load(weights_only=True) into a fresh model, train both on: everything stays bit-identical.
A bad `_extra_state` raises a clear error and leaves the module's FP8 state as it was."""
from __future__ import annotations

import io

import pytest
import torch

import tritium as te
from tritium import recipe

pytestmark = pytest.mark.cpu

RCP = recipe.DelayedScaling(amax_history_len=4, margin=1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = te.Linear(32, 64, device="cpu")
        self.fc2 = te.Linear(64, 16, device="cpu")

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def step(model, opt, x, dy):
    with te.fp8_autocast(fp8_recipe=RCP):
        y = model(x)
    opt.zero_grad()
    y.backward(dy)
    opt.step()
    return y.detach()


def fp8_state(model):
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, te.Linear):
            for d in ("fwd", "bwd"):
                st = getattr(mod.fp8_meta, d)
                out[f"{name}.{d}.scale"] = st.scale.clone()
                out[f"{name}.{d}.hist"] = st.amax_history.clone()
    return out


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_continues_bit_identically(randn):
    data = [(randn(2, 9, 32, scale=1.5 ** k), randn(2, 9, 16, scale=0.5 ** k)) for k in range(9)]
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, dy in data[:3]:
        step(model, opt, x, dy)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    sd = ckpt["model"]
    extra = sd["fc1._extra_state"]
    assert extra["recipe"] == RCP.to_dict()
    assert extra["fwd_amax_history"].shape == (4, 2) and extra["bwd_scale"].shape == (1,)
    assert not torch.equal(extra["fwd_scale"], torch.ones(2))     # the scales have moved

    torch.manual_seed(12345)            # a different init: everything must come from the file
    fresh = Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh.fc1.weight, model.fc1.weight)
    fresh.load_state_dict(sd)
    fresh_opt.load_state_dict(ckpt["opt"])
    assert fresh.fc1.fp8_meta.recipe == RCP
    assert_bitwise(fp8_state(fresh), fp8_state(model))
    for x, dy in data[3:]:
        y_a, y_b = step(model, opt, x, dy), step(fresh, fresh_opt, x, dy)
        assert torch.equal(y_a, y_b)
        assert_bitwise(dict(model.named_parameters()), dict(fresh.named_parameters()))
        assert_bitwise(fp8_state(model), fp8_state(fresh))


def test_untrained_module_saves_none_and_loads(randn):
    lin = te.Linear(32, 16, device="cpu")
    sd = lin.state_dict()
    assert sd["_extra_state"] is None
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = te.Linear(32, 16, device="cpu")
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(other.weight, lin.weight) and other.fp8_meta.recipe is None


def trained_linear(randn):
    lin = te.Linear(32, 16, device="cpu")
    for _ in range(2):
        x = randn(5, 32, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=RCP):
            y = lin(x)
        y.backward(randn(5, 16))
    return lin


def bad_states(good):
    def edit(**changes):
        d = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in good.items()}
        d.update(changes)
        return d

    return {
        "fwd-scale-shape": (edit(fwd_scale=torch.ones(3)), "fwd"),
        "fwd-history-shape": (edit(fwd_amax_history=torch.zeros(4, 3)), "fwd"),
        "history-len-vs-recipe": (edit(fwd_amax_history=torch.zeros(8, 2),
                                       bwd_amax_history=torch.zeros(8, 1)), "fwd"),
        # fwd valid and bwd wrong: nothing at all may be applied.
        "bwd-only": (edit(fwd_scale=torch.full((2,), 7.0), bwd_scale=torch.ones(2, 1)), "bwd"),
        "dtype": (edit(bwd_scale=torch.ones(1, dtype=torch.float64)), "float32"),
        "missing": ({k: v for k, v in good.items() if k != "bwd_scale"}, "bwd_scale"),
        "version": (edit(version=2), "version"),
        "not-a-dict": ([1, 2, 3], "dict"),
        "unknown-recipe": (edit(recipe={"type": "Float16Scaling"}), "recipe"),
        "unknown-recipe-field": (edit(recipe=dict(good["recipe"], amax_epsilon=0.5)),
                                 "amax_epsilon"),
        "bad-recipe-value": (edit(recipe=dict(good["recipe"], margin=-1)), "margin"),
    }


@pytest.mark.parametrize("case", list(bad_states({"recipe": {}}).keys()))
def test_bad_extra_state_raises_and_changes_nothing(randn, case):
    lin = trained_linear(randn)
    good = lin.get_extra_state()
    bad, words = bad_states(good)[case]
    before = {k: v.clone() for k, v in good.items() if torch.is_tensor(v)}
    weight = lin.weight.detach().clone()
    recipe_before = lin.fp8_meta.recipe
    with pytest.raises(ValueError, match=words):
        lin.set_extra_state(bad)
    after = lin.get_extra_state()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert lin.fp8_meta.recipe is recipe_before
    assert torch.equal(lin.weight, weight)
    # The same through load_state_dict (the usual way in).
    sd = lin.state_dict()
    sd["_extra_state"] = bad
    with pytest.raises(ValueError, match=words):
        lin.load_state_dict(sd)
    after = lin.get_extra_state()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_load_resizes_history_for_a_new_recipe(randn):
    lin = trained_linear(randn)
    hist = lin.fp8_meta.fwd.amax_history.clone()
    scale = lin.fp8_meta.fwd.scale.clone()
    longer = recipe.DelayedScaling(amax_history_len=6, margin=1)
    x = randn(5, 32)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=longer):
        lin(x)
    new = lin.fp8_meta.fwd.amax_history
    assert new.shape == (6, 2)
    # the finished amaxes keep their order at the end (newest last); row 0 holds this call's
    assert torch.equal(new[3:], hist[1:4])
    assert bool((new[1:3] == 0).all())
    assert torch.equal(lin.fp8_meta.fwd.scale, scale)
