"""FP8 recipes: frozen, validated dataclasses (TE's `transformer_engine.common.recipe` names).

A recipe says how scales are chosen; it holds no state. `DelayedScaling` derives each tensor's
scale from a history of past amaxes (see `fp8/scaling.py`); `Float8CurrentScaling` derives it from
the tensor's own amax just before the cast. Recipes convert to and from plain dicts so that they
travel inside checkpoints that `torch.load(weights_only=True)` accepts (callables excepted: a
recipe with a callable is saved by name only and must be given again when loading).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from .formats import FP32_MAX, Format

AmaxAlgo = Union[str, Callable]


def _check_format(value) -> Format:
    if isinstance(value, str):
        try:
            return Format[value]
        except KeyError:
            pass
    if not isinstance(value, Format):
        raise ValueError(f"fp8_format must be a recipe.Format (E4M3 or HYBRID), got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scale from the amax history: scale = (fp8_max / amax) / 2**margin.

    amax_compute_algo: "max" (max over the whole history), "most_recent" (row 0), or a callable
    taking the history [L, n] and returning amax [n]. scaling_factor_compute_algo: None or a
    callable (amax, scale, fp8_max, recipe) -> new scale. reduce_amax: all-reduce (MAX) the
    amaxes over the amax group before every update when the world has more than one rank.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    # Accepted for TE compatibility; tritium computes wgrad in FP8 like fprop and dgrad.
    override_linear_precision: tuple = (False, False, False)

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if self.fp8_format is Format.E5M2:
            raise ValueError("fp8_format=Format.E5M2 is not a training recipe; use HYBRID or E4M3")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if (not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool)
                or self.amax_history_len < 1):
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not (callable(self.amax_compute_algo) or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError('amax_compute_algo must be "max", "most_recent" or a callable, '
                             f"got {self.amax_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"reduce_amax must be a bool, got {self.reduce_amax!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError("scaling_factor_compute_algo must be None or a callable")
        if tuple(self.override_linear_precision) != (False, False, False):
            raise ValueError("override_linear_precision is not supported: all three GEMMs run in FP8")

    @property
    def uses_callables(self) -> bool:
        return callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None

    def delayed(self) -> bool:
        return True

    def to_dict(self) -> dict:
        algo = self.amax_compute_algo
        return {"type": "DelayedScaling", "margin": self.margin, "fp8_format": self.fp8_format.name,
                "amax_history_len": self.amax_history_len,
                "amax_compute_algo": algo if isinstance(algo, str) else "callable",
                "scaling_factor_compute_algo":
                    None if self.scaling_factor_compute_algo is None else "callable",
                "reduce_amax": self.reduce_amax}


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Scale from the tensor's own amax, computed just before the cast (no history).

    scale = fp8_max / max(amax, amax_epsilon); amax 0, inf or NaN gives scale 1; an infinite
    scale becomes fp32 max; power_2_scale rounds the scale down to a power of two.
    """

    fp8_format: Format = Format.HYBRID
    amax_epsilon: float = 0.0
    power_2_scale: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if self.fp8_format is Format.E5M2:
            raise ValueError("fp8_format=Format.E5M2 is not a training recipe; use HYBRID or E4M3")
        if (not isinstance(self.amax_epsilon, (int, float)) or isinstance(self.amax_epsilon, bool)
                or not 0 <= self.amax_epsilon <= FP32_MAX):
            raise ValueError("amax_epsilon must be a float in [0, fp32 max], got "
                             f"{self.amax_epsilon!r}")
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"power_2_scale must be a bool, got {self.power_2_scale!r}")

    # Nothing to reduce or update: each cast computes its own scale.
    reduce_amax = False
    uses_callables = False

    def delayed(self) -> bool:
        return False

    def to_dict(self) -> dict:
        return {"type": "Float8CurrentScaling", "fp8_format": self.fp8_format.name,
                "amax_epsilon": float(self.amax_epsilon), "power_2_scale": self.power_2_scale}


Recipe = Union[DelayedScaling, Float8CurrentScaling]


def recipe_from_dict(values: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from `to_dict()` output; callables cannot be rebuilt and become defaults."""
    if not isinstance(values, dict):
        raise ValueError("a recipe must be a dict written by to_dict(), got "
                         f"{type(values).__name__}")
    values = dict(values)
    kind = values.pop("type", None)
    known = {"DelayedScaling": DelayedScaling, "Float8CurrentScaling": Float8CurrentScaling}
    if kind in known:
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(known[kind])})
        if unknown:
            raise ValueError(f"{kind} recipe in checkpoint has unknown fields {unknown}")
    if kind == "DelayedScaling":
        if values.get("amax_compute_algo") == "callable":
            values["amax_compute_algo"] = "max"
        if values.get("scaling_factor_compute_algo") == "callable":
            values["scaling_factor_compute_algo"] = None
        return DelayedScaling(**values)
    if kind == "Float8CurrentScaling":
        return Float8CurrentScaling(**values)
    raise ValueError(f"unknown recipe type {kind!r} in checkpoint")


__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Recipe", "recipe_from_dict"]
