"""FP8 recipes: frozen, validated dataclasses (TE's `transformer_engine.common.recipe` names).

A recipe says how scales are chosen; it holds no state. `DelayedScaling` derives each tensor's
scale from a history of past amaxes (see `fp8/scaling.py`); `Float8CurrentScaling` derives it from
the tensor's own amax just before the cast.

`Recipe` is the base class (TE's `recipe.Recipe`) with TE's type predicates (`delayed()`,
`float8_current_scaling()`, `float8_per_tensor_scaling()`, `float8_block_scaling()`, `mxfp8()`,
`nvfp4()`, `custom()`). They test the class BY NAME through a registry that every subclass
joins when it is defined, so a recipe class added later (`Float8BlockScaling`,
`MXFP8BlockScaling`, in this file or another) makes its predicate true with no edit here;
`_PREDICATES` maps each predicate to the class names it accepts. `MMParams` / `QParams` are TE's
GEMM and quantization parameter records; `Float8CurrentScaling` carries them with TE's values.
`Float8BlockScaling` (1x128 / 128x128 block scales) and `MXFP8BlockScaling` (32-element E8M0
blocks, emulated) are run by `tritium.functional.block_linear`; docs/block_scaling.md.

Recipes convert to and from plain dicts so that they travel inside checkpoints that `torch.load(weights_only=True)` accepts (callables excepted: a
recipe with a callable is saved by name only and must be given again when loading).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from .formats import FP32_MAX, Format

AmaxAlgo = Union[str, Callable]

# Predicate -> the recipe class names it is true for (TE's semantics: per-tensor = delayed or
# current scaling). A new recipe class only needs its name here if it is not listed yet.
_PREDICATES = {
    "delayed": ("DelayedScaling",),
    "float8_current_scaling": ("Float8CurrentScaling",),
    "float8_per_tensor_scaling": ("DelayedScaling", "Float8CurrentScaling"),
    "float8_block_scaling": ("Float8BlockScaling",),
    "mxfp8": ("MXFP8BlockScaling",),
    "nvfp4": ("NVFP4BlockScaling",),
    "custom": ("CustomRecipe",),
}
_RECIPE_CLASSES: dict[str, type] = {}


class Recipe:
    """Base of every recipe (TE's `recipe.Recipe`): the type predicates TE code branches on."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _RECIPE_CLASSES.setdefault(cls.__name__, cls)

    def _is(self, predicate: str) -> bool:
        return any(isinstance(self, _RECIPE_CLASSES[name]) for name in _PREDICATES[predicate]
                   if name in _RECIPE_CLASSES)

    def delayed(self) -> bool:
        """Delayed scaling (scales from the amax history)."""
        return self._is("delayed")

    def float8_current_scaling(self) -> bool:
        """Per-tensor current scaling."""
        return self._is("float8_current_scaling")

    def float8_per_tensor_scaling(self) -> bool:
        """One scale per tensor: delayed or current scaling."""
        return self._is("float8_per_tensor_scaling")

    def float8_block_scaling(self) -> bool:
        """FP8 block scaling (1x128 / 128x128 tiles)."""
        return self._is("float8_block_scaling")

    def mxfp8(self) -> bool:
        """MXFP8 block scaling (32-element blocks, E8M0 scales)."""
        return self._is("mxfp8")

    def nvfp4(self) -> bool:
        """NVFP4 block scaling (Blackwell only; no tritium class)."""
        return self._is("nvfp4")

    def custom(self) -> bool:
        """A user-defined quantizer-factory recipe (no tritium class)."""
        return self._is("custom")


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM parameters (TE's `recipe.MMParams`): use_split_accumulator=False allows the fast
    (less precise) FP8 accumulation (torch._scaled_mm's use_fast_accum)."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization parameters (TE's `recipe.QParams`): power-of-2 scales, minimum amax."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


def _check_attention_flags(recipe, dpa_supported: bool = False) -> None:
    """fp8_dpa (FP8 attention: E4M3 Q, K, V and P) and fp8_mha (that, and the attention
    output handed to the output projection in E4M3; docs/attention.md) run under the
    per-tensor recipes."""
    name = type(recipe).__name__
    for flag in ("fp8_dpa", "fp8_mha"):
        if not isinstance(getattr(recipe, flag), bool):
            raise ValueError(f"{name}: {flag} must be a bool, got {getattr(recipe, flag)!r}")
        if getattr(recipe, flag) and not dpa_supported:
            raise NotImplementedError(
                f"{name}({flag}=True): FP8 attention runs under the per-tensor recipes only; "
                f"use recipe.DelayedScaling({flag}=True) or Float8CurrentScaling({flag}=True), "
                f"or leave {flag} False")


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
class DelayedScaling(Recipe):
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
    # TE's FP8 attention flags: fp8_dpa runs attention in FP8; fp8_mha also hands the output
    # projection the attention output in FP8 (docs/attention.md).
    fp8_dpa: bool = False
    fp8_mha: bool = False

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
        _check_attention_flags(self, dpa_supported=True)

    @property
    def uses_callables(self) -> bool:
        return callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None

    def to_dict(self) -> dict:
        algo = self.amax_compute_algo
        return {"type": "DelayedScaling", "margin": self.margin, "fp8_format": self.fp8_format.name,
                "amax_history_len": self.amax_history_len,
                "amax_compute_algo": algo if isinstance(algo, str) else "callable",
                "scaling_factor_compute_algo":
                    None if self.scaling_factor_compute_algo is None else "callable",
                "reduce_amax": self.reduce_amax, "fp8_dpa": self.fp8_dpa,
                "fp8_mha": self.fp8_mha}


_FPROP, _SPLIT = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Scale from the tensor's own amax, computed just before the cast (no history).

    scale = fp8_max / max(amax, amax_epsilon); amax 0, inf or NaN gives scale 1; an infinite
    scale becomes fp32 max; power_2_scale rounds the scale down to a power of two.

    TE's per-GEMM fields are kept with TE's values (fprop fast accumulation, dgrad and wgrad
    split accumulation), which are what tritium's GEMMs do; other values raise. TE's
    `fp8_quant_fwd_inp` / `_fwd_weight` / `_bwd_grad` read back as `QParams` of this recipe's
    power_2_scale and amax_epsilon (one setting for all three roles in tritium).
    """

    fp8_format: Format = Format.HYBRID
    amax_epsilon: float = 0.0
    power_2_scale: bool = False
    fp8_gemm_fprop: MMParams = _FPROP
    fp8_gemm_dgrad: MMParams = _SPLIT
    fp8_gemm_wgrad: MMParams = _SPLIT
    fp8_dpa: bool = False
    fp8_mha: bool = False

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
        for name, want in (("fp8_gemm_fprop", _FPROP), ("fp8_gemm_dgrad", _SPLIT),
                           ("fp8_gemm_wgrad", _SPLIT)):
            if getattr(self, name) != want:
                raise NotImplementedError(
                    f"Float8CurrentScaling({name}={getattr(self, name)}): tritium's FP8 GEMMs use "
                    "fast accumulation in fprop and split accumulation in dgrad/wgrad (TE's "
                    f"defaults); only {name}={want} is supported")
        _check_attention_flags(self, dpa_supported=True)

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        return QParams(self.power_2_scale, float(self.amax_epsilon))

    fp8_quant_fwd_weight = fp8_quant_fwd_inp
    fp8_quant_bwd_grad = fp8_quant_fwd_inp

    # Nothing to reduce or update: each cast computes its own scale.
    reduce_amax = False
    uses_callables = False

    def to_dict(self) -> dict:
        return {"type": "Float8CurrentScaling", "fp8_format": self.fp8_format.name,
                "amax_epsilon": float(self.amax_epsilon), "power_2_scale": self.power_2_scale,
                "fp8_dpa": self.fp8_dpa, "fp8_mha": self.fp8_mha}


def _check_qparams(name: str, q) -> None:
    if not isinstance(q, QParams):
        raise ValueError(f"{name} must be a recipe.QParams, got {type(q).__name__}")
    if not isinstance(q.power_2_scale, bool):
        raise ValueError(f"{name}.power_2_scale must be a bool, got {q.power_2_scale!r}")
    if (not isinstance(q.amax_epsilon, (int, float)) or isinstance(q.amax_epsilon, bool)
            or not 0 <= q.amax_epsilon <= FP32_MAX):
        raise ValueError(f"{name}.amax_epsilon must be a float in [0, fp32 max], got "
                         f"{q.amax_epsilon!r}")


_POW2_QPARAMS = QParams(power_2_scale=True, amax_epsilon=0.0)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Block-scaled FP8 (TE's `Float8BlockScaling`, the DeepSeek-V3 recipe): one fp32 scale per
    1x128 tile (`*_block_scaling_dim=1`: 128 consecutive elements along the GEMM's reduction
    dim) or per 128x128 block (`=2`); each scale = fp8_max / amax of its block, rounded down
    to a power of 2 under QParams.power_2_scale. Current scaling per block: no history.

    TE's rules: each dim is 1 or 2, no 2D x 2D GEMM (at most one of x / w / grad is 2D),
    split accumulation in all three GEMMs, E4M3 or HYBRID (E4M3 by default in both passes).
    tritium implements 1x128 activations and gradients with 1x128 or 128x128 weights (TE's
    default and its 1D variant); x_block_scaling_dim=2 or grad_block_scaling_dim=2 raise."""

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = _POW2_QPARAMS
    fp8_quant_fwd_weight: QParams = _POW2_QPARAMS
    fp8_quant_bwd_grad: QParams = _POW2_QPARAMS
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = _SPLIT
    fp8_gemm_dgrad: MMParams = _SPLIT
    fp8_gemm_wgrad: MMParams = _SPLIT
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if self.fp8_format is Format.E5M2:
            raise ValueError("fp8_format=Format.E5M2 is not a training recipe; use E4M3 or HYBRID")
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            _check_qparams(name, getattr(self, name))
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            if value not in (1, 2) or isinstance(value, bool):
                raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128 blocks), "
                                 f"got {value!r}")
            dims[name] = value
        if sum(v == 2 for v in dims.values()) > 1:
            raise ValueError(f"Float8BlockScaling{tuple(dims.values())}: a 2D x 2D block GEMM is "
                             "not supported; at most one of x / w / grad may use 2D blocks")
        for name in ("x_block_scaling_dim", "grad_block_scaling_dim"):
            if dims[name] == 2:
                raise NotImplementedError(
                    f"Float8BlockScaling({name}=2): tritium quantizes activations and gradients "
                    f"in 1x128 tiles only; use {name}=1 (TE's default)")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if getattr(self, name) != _SPLIT:
                raise ValueError(f"Float8BlockScaling({name}={getattr(self, name)}): block "
                                 "scaling requires split accumulation "
                                 "(MMParams(use_split_accumulator=True))")
        _check_attention_flags(self)

    # Nothing to reduce or update: each cast computes its own block scales.
    reduce_amax = False
    uses_callables = False

    def to_dict(self) -> dict:
        out = {"type": "Float8BlockScaling", "fp8_format": self.fp8_format.name}
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            q = getattr(self, name)
            out[name] = {"power_2_scale": q.power_2_scale, "amax_epsilon": float(q.amax_epsilon)}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            out[name] = getattr(self, name)
        return out


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (TE's `MXFP8BlockScaling`, OCP MX v1.0): one power-of-2 (E8M0) scale per 32
    consecutive elements along the GEMM's reduction dim, E4M3 data (E5M2 gradients under
    HYBRID). Native on Blackwell only: tritium runs it by emulation on every device (exact
    dequantized values, fp32 GEMMs), for accuracy studies; it claims no speed."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if self.fp8_format is Format.E5M2:
            raise ValueError("fp8_format=Format.E5M2 is not a training recipe; use E4M3 or HYBRID")
        _check_attention_flags(self)

    reduce_amax = False
    uses_callables = False

    def to_dict(self) -> dict:
        return {"type": "MXFP8BlockScaling", "fp8_format": self.fp8_format.name}


def recipe_from_dict(values: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from `to_dict()` output; callables cannot be rebuilt and become defaults."""
    if not isinstance(values, dict):
        raise ValueError("a recipe must be a dict written by to_dict(), got "
                         f"{type(values).__name__}")
    values = dict(values)
    kind = values.pop("type", None)
    known = {"DelayedScaling": DelayedScaling, "Float8CurrentScaling": Float8CurrentScaling,
             "Float8BlockScaling": Float8BlockScaling, "MXFP8BlockScaling": MXFP8BlockScaling}
    if kind in known:
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(known[kind])
                                        if f.type not in ("MMParams", MMParams)})
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
    if kind == "Float8BlockScaling":
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if isinstance(values.get(name), dict):
                values[name] = QParams(**values[name])
        return Float8BlockScaling(**values)
    if kind == "MXFP8BlockScaling":
        return MXFP8BlockScaling(**values)
    raise ValueError(f"unknown recipe type {kind!r} in checkpoint")


__all__ = ["Format", "Recipe", "MMParams", "QParams", "DelayedScaling", "Float8CurrentScaling",
           "Float8BlockScaling", "MXFP8BlockScaling", "recipe_from_dict"]
