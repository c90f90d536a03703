"""Recipes: frozen, validated (a bad value raises ValueError naming the argument), and they
round-trip through plain dicts (what checkpoints hold)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.recipe import recipe_from_dict

pytestmark = pytest.mark.cpu


def test_defaults_match_te():
    r = recipe.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo,
            r.scaling_factor_compute_algo, r.reduce_amax) == (0, recipe.Format.HYBRID, 1024, "max",
                                                              None, True)
    c = recipe.Float8CurrentScaling()
    assert (c.fp8_format, c.amax_epsilon, c.power_2_scale) == (recipe.Format.HYBRID, 0.0, False)


def test_formats_map_to_dtypes():
    f = recipe.Format
    assert (f.HYBRID.forward_dtype, f.HYBRID.backward_dtype) == (torch.float8_e4m3fn,
                                                                torch.float8_e5m2)
    assert (f.E4M3.forward_dtype, f.E4M3.backward_dtype) == (torch.float8_e4m3fn,
                                                            torch.float8_e4m3fn)


@pytest.mark.parametrize("make", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_frozen(make):
    r = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fp8_format = recipe.Format.E4M3
    assert r.fp8_format is recipe.Format.HYBRID


@pytest.mark.parametrize("kwargs, name", [
    (dict(margin=-1), "margin"),
    (dict(margin=1.5), "margin"),
    (dict(margin=True), "margin"),
    (dict(amax_history_len=0), "amax_history_len"),
    (dict(amax_history_len=-4), "amax_history_len"),
    (dict(amax_history_len=2.0), "amax_history_len"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(amax_compute_algo=None), "amax_compute_algo"),
    (dict(scaling_factor_compute_algo="max"), "scaling_factor_compute_algo"),
    (dict(fp8_format="E6M1"), "fp8_format"),
    (dict(fp8_format=3), "fp8_format"),
    (dict(fp8_format=recipe.Format.E5M2), "fp8_format"),
    (dict(override_linear_precision=(False, False, True)), "override_linear_precision"),
])
def test_delayed_scaling_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        recipe.DelayedScaling(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(amax_epsilon=-1e-6), "amax_epsilon"),
    (dict(amax_epsilon="small"), "amax_epsilon"),
    (dict(fp8_format=recipe.Format.E5M2), "fp8_format"),
    (dict(fp8_format="bf8"), "fp8_format"),
])
def test_current_scaling_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        recipe.Float8CurrentScaling(**kwargs)


def test_format_given_by_name():
    assert recipe.DelayedScaling(fp8_format="E4M3").fp8_format is recipe.Format.E4M3
    assert recipe.Float8CurrentScaling(fp8_format="HYBRID").fp8_format is recipe.Format.HYBRID


@pytest.mark.parametrize("r", [
    recipe.DelayedScaling(),
    recipe.DelayedScaling(margin=3, fp8_format=recipe.Format.E4M3, amax_history_len=16,
                          amax_compute_algo="most_recent", reduce_amax=False),
    recipe.Float8CurrentScaling(),
    recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3, amax_epsilon=1e-12,
                                power_2_scale=True),
], ids=["delayed-default", "delayed-custom", "current-default", "current-custom"])
def test_dict_round_trip(r):
    d = r.to_dict()
    # Plain values only (what torch.load(weights_only=True) accepts).
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in d.values())
    back = recipe_from_dict(d)
    assert type(back) is type(r) and back == r
    assert back.to_dict() == d


def test_dict_with_callables_saves_names_and_loads_defaults():
    r = recipe.DelayedScaling(margin=1, amax_history_len=8,
                              amax_compute_algo=lambda h: h.amax(0),
                              scaling_factor_compute_algo=lambda a, s, m, rec: s)
    d = r.to_dict()
    assert d["amax_compute_algo"] == "callable" and d["scaling_factor_compute_algo"] == "callable"
    back = recipe_from_dict(d)
    assert back == recipe.DelayedScaling(margin=1, amax_history_len=8)


def test_dict_unknown_type_or_field():
    with pytest.raises(ValueError, match="unknown recipe type"):
        recipe_from_dict({"type": "NVFP4BlockScaling"})
    with pytest.raises(ValueError, match="power_2_scale"):
        recipe_from_dict(dict(recipe.DelayedScaling().to_dict(), power_2_scale=True))
    with pytest.raises(ValueError, match="dict"):
        recipe_from_dict("DelayedScaling")


def test_public_names():
    assert te.recipe.DelayedScaling is recipe.DelayedScaling
    assert te.recipe.Format is recipe.Format
    assert callable(te.fp8_autocast) and callable(te.autocast)
