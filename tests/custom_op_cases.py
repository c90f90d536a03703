"""The calls tritium's functional layer makes through each custom op family (tritium/ops), as a
table shared by tests/test_custom_ops.py (cpu tier: the twins in tritium.ref behind the ops) and
tests/interp/test_custom_ops_kernels.py (the Triton kernels behind the ops, interpreted).

A case builds fresh random tensors (`make(randn) -> dict`), names the module eager runs (the
site's own `_impl` choice: kernel or twin) and calls one function through a module (`call(mod,
state)`). `check_case` runs that call twice on clones of the state, once through the eager module
and once through the op namespace of `tritium.ops`, and demands the same results and the same
in-place writes bit for bit; then it runs `torch.library.opcheck` on every `tritium::` op the
namespace called, with the very arguments it called it with (schema and declared mutations,
fake vs real outputs, tracing through AOTAutograd with dynamic shapes).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from tritium import _device
from tritium import ops
from tritium.fp8 import cast as fcast
from tritium.fp8.formats import fp8_max
from tritium.functional import activation as fact
from tritium.functional import cross_entropy as fce
from tritium.functional import gemm as fgemm
from tritium.functional import norm as fnorm
from tritium.functional import rope as frope
from tritium.ref import scaling as rscaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Case(NamedTuple):
    name: str
    make: Callable          # randn -> {name: tensor}
    eager: Callable         # state -> the module eager calls (kernel or twin)
    ops: object             # the op namespace (tritium.ops.<family>)
    call: Callable          # (module, state) -> result


# ------------------------------------------------------------------------------ comparison
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(_INT[t.element_size()]).reshape(-1)


def assert_same(got, want, what: str) -> None:
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{what}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
        return
    if not isinstance(want, torch.Tensor):
        assert got is None and want is None, f"{what}: got {type(got)}, want {type(want)}"
        return
    assert isinstance(got, torch.Tensor), f"{what}: got {got!r}"
    assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, want.device), \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: values differ"


def _clone(state: dict) -> dict:
    """Clones keeping views of one base as views of one clone (amax slots of one history)."""
    out, bases = {}, {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v._base is not None:
            base = bases.setdefault(id(v._base), (v._base, v._base.clone()))[1]
            out[k] = base.as_strided(v.shape, v.stride(), v.storage_offset())
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


class _Recorder(TorchDispatchMode):
    """Records every tritium:: op call (with cloned arguments) while passing it through."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "tritium":
            copy = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls.append((func, tuple(copy(a) for a in args),
                               {k: copy(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def check_case(case: Case, randn, eager_package: str, device: str = "cpu") -> None:
    """`eager_package`: where the eager module must come from ("tritium.ref" on the cpu tier,
    "tritium.kernels" under the interpreter and on CUDA; the GEMM's eager site is
    functional.gemm)."""
    state = {k: v.to(device) for k, v in case.make(randn).items()}
    eager_state, op_state = _clone(state), _clone(state)
    eager = case.eager(eager_state)
    if eager is not fgemm:
        assert eager.__name__.startswith(eager_package + "."), (case.name, eager.__name__)
    want = case.call(eager, eager_state)
    with _Recorder() as rec:
        got = case.call(case.ops, op_state)
    assert rec.calls, f"{case.name}: the namespace called no tritium op"
    assert_same(got, want, f"{case.name} result")
    for k in state:
        assert_same(op_state[k], eager_state[k], f"{case.name} {k} after the call")
    for func, args, kwargs in rec.calls:
        torch.library.opcheck(func, args, kwargs, test_utils=_utils(args))


_FP8 = (E4M3, E5M2)
_ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
              "test_aot_dispatch_dynamic")


def _utils(args) -> tuple:
    """opcheck's schema test compares inputs before and after with arithmetic that torch lacks
    for fp8 tensors on the CPU: skip it for ops with fp8 inputs (dequantize, the GEMM), whose
    inputs `check_case` compares bit for bit with the eager call's anyway."""
    if any(isinstance(a, torch.Tensor) and a.dtype in _FP8 for a in args):
        return _ALL_UTILS[1:]
    return _ALL_UTILS


# ------------------------------------------------------------------------------ the cases
def check_compiled_rmsnorm(randn, device: str = "cpu") -> None:
    """A compiled RMSNorm forward + backward is one graph, with no break, that calls the two
    norm ops, and equals eager bit for bit."""
    x = randn(6, 32).to(device).requires_grad_(True)
    w = (randn(32) + 1.0).to(device).requires_grad_(True)
    dy = randn(6, 32).to(device)
    seen = set()

    def record(gm, _):
        seen.update(str(n.target) for n in gm.graph.nodes if "tritium" in str(n.target))
        return make_boxed_func(gm)

    def step(x, w):
        return fnorm.rms_norm(x, w, 1e-5)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    got = compiled(x, w)
    got_grads = torch.autograd.grad(got, (x, w), dy)
    assert seen == {"tritium.rmsnorm_fwd.default", "tritium.rmsnorm_bwd.default"}
    want = step(x, w)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    for g, e in zip((got, *got_grads), (want, *want_grads)):
        assert torch.equal(g, e)


def _x(randn, rows=20, cols=24, dtype=torch.bfloat16):
    return randn(rows, cols, scale=3.0, dtype=dtype)


def _amax(randn, n=1):
    return randn(n).abs() * 0.5  # a running amax below the data's own one


def _history(randn, slots=2):
    """A [4, slots] amax history; cast cases write row 0 through slot views, as ScalingState."""
    return randn(4, slots).abs() + 0.1


def _cast_cases():
    cases = []
    for dtype in (E4M3, E5M2):
        for data, t in ((True, False), (True, True), (False, True)):
            cases.append(Case(
                f"cast_transpose delayed {dtype} data={data} t={t}",
                lambda r: {"x": _x(r), "scale": r(1).abs() + 1.0, "hist": _history(r)},
                lambda s: fcast._impl(s["x"]), ops.cast,
                lambda m, s, d=dtype, data=data, t=t: m.cast_transpose(
                    s["x"], s["scale"], s["hist"][0, 1:2], d, pad_rows_to=16, write_data=data,
                    write_transpose=t)))
    cases.append(Case(  # one column: the twin's data_t is a view of data (the op clones it)
        "cast_transpose delayed one column",
        lambda r: {"x": _x(r, 20, 1), "scale": r(1).abs() + 1.0, "amax": _amax(r)},
        lambda s: fcast._impl(s["x"]), ops.cast,
        lambda m, s: m.cast_transpose(s["x"], s["scale"], s["amax"], E4M3, pad_rows_to=16,
                                      write_transpose=True)))
    cases.append(Case(  # a cached weight: no amax recorded
        "cast_transpose delayed no amax",
        lambda r: {"x": _x(r, 16, 32, torch.float32), "scale": r(1).abs() + 1.0},
        lambda s: fcast._impl(s["x"]), ops.cast,
        lambda m, s: m.cast_transpose(s["x"], s["scale"], None, E4M3, pad_rows_to=16,
                                      write_transpose=True)))
    for current in ((0.0, False), (1e-4, True)):
        cases.append(Case(
            f"cast_transpose current {current}",
            lambda r: {"x": _x(r), "amax": r(1).abs() + 4.0},
            lambda s: fcast._impl(s["x"]), ops.cast,
            lambda m, s, c=current: m.cast_transpose(s["x"], None, s["amax"], E4M3,
                                                     pad_rows_to=16, write_transpose=True,
                                                     current=c)))
    cases.append(Case(
        "cast_transpose_pair delayed (amaxes: slots of one history row)",
        lambda r: {"a": _x(r, 20, 32), "b": _x(r, 16, 32), "scale": r(2).abs() + 1.0,
                   "hist": _history(r)},
        lambda s: fcast._impl(s["a"]), ops.cast,
        lambda m, s: m.cast_transpose_pair(
            (s["a"], s["scale"][0:1], s["hist"][0, 0:1], 16, True, False),
            (s["b"], s["scale"][1:2], s["hist"][0, 1:2], 16, True, True), E4M3)))
    cases.append(Case(
        "cast_transpose_pair current",
        lambda r: {"a": _x(r, 20, 32), "b": _x(r, 16, 32), "amax": r(2).abs() + 4.0},
        lambda s: fcast._impl(s["a"]), ops.cast,
        lambda m, s: m.cast_transpose_pair(
            (s["a"], None, s["amax"][0:1], 16, True, True),
            (s["b"], None, s["amax"][1:2], 16, False, True), E4M3, (0.0, True))))
    cases.append(Case(
        "amax_into", lambda r: {"x": _x(r), "amax": _amax(r)},
        lambda s: fcast._impl(s["x"]), ops.cast,
        lambda m, s: m.amax_into(s["x"], s["amax"])))
    cases.append(Case(
        "dequantize",
        lambda r: {"d": (_x(r, 16, 32, torch.float32) * 10).to(E4M3), "si": r(1).abs() + 0.1},
        lambda s: fcast._impl(s["d"]), ops.cast,
        lambda m, s: m.dequantize(s["d"], s["si"], torch.bfloat16)))
    return cases


def _norm_state(r, dtype=torch.bfloat16):
    return {"x": _x(r, 9, 40, dtype) + 1.0, "w": r(40) + 1.0, "b": r(40), "dy": _x(r, 9, 40, dtype),
            "scale": r(1).abs() + 1.0, "amax": _amax(r)}


def _norm_cases():
    cases = []
    for zcg in (False, True):
        for bias in (True, False):
            cases.append(Case(
                f"layernorm fwd+bwd zcg={zcg} bias={bias}", _norm_state,
                lambda s: fnorm._impl(s["x"]), ops.norm,
                lambda m, s, z=zcg, b=bias: _ln_fwd_bwd(m, s, z, b)))
        cases.append(Case(
            f"rmsnorm fwd+bwd zcg={zcg}", lambda r: _norm_state(r, torch.float32),
            lambda s: fnorm._impl(s["x"]), ops.norm,
            lambda m, s, z=zcg: _rms_fwd_bwd(m, s, z)))
    for t, hp in ((False, False), (True, False), (True, True)):
        cases.append(Case(
            f"layernorm_fwd_fp8 t={t} hp={hp}", _norm_state,
            lambda s: fnorm._impl_fp8(s["x"]), ops.norm,
            lambda m, s, t=t, hp=hp: m.layernorm_fwd_fp8(
                s["x"], s["w"], s["b"], 1e-5, False, s["scale"], s["amax"], E4M3,
                write_transpose=t, write_hp=hp)))
        cases.append(Case(
            f"rmsnorm_fwd_fp8 t={t} hp={hp}", _norm_state,
            lambda s: fnorm._impl_fp8(s["x"]), ops.norm,
            lambda m, s, t=t, hp=hp: m.rmsnorm_fwd_fp8(
                s["x"], s["w"], 1e-5, True, s["scale"], s["amax"] if t else None, E4M3,
                write_transpose=t, write_hp=hp)))
    return cases


def _ln_fwd_bwd(m, s, zcg, bias):
    y, mean, rstd = m.layernorm_fwd(s["x"], s["w"], s["b"] if bias else None, 1e-5, zcg)
    return (y, mean, rstd), m.layernorm_bwd(s["dy"], s["x"], s["w"], mean, rstd, zcg,
                                            need_bias_grad=bias)


def _rms_fwd_bwd(m, s, zcg):
    y, rstd = m.rmsnorm_fwd(s["x"], s["w"], 1e-5, zcg)
    return (y, rstd), m.rmsnorm_bwd(s["dy"], s["x"], s["w"], rstd, zcg)


def _act_state(r, kind):
    width = 48 if kind in fact.GATED else 24
    return {"x": _x(r, 10, width), "dy": _x(r, 10, 24), "scale": r(1).abs() + 1.0,
            "amax": _amax(r)}


def _act_cases():
    cases = []
    for kind in ("gelu", "swiglu"):
        cases.append(Case(
            f"activation fwd+bwd {kind}", lambda r, k=kind: _act_state(r, k),
            lambda s: fact._impl(s["x"]), ops.activation,
            lambda m, s, k=kind: (m.activation_fwd(s["x"], k),
                                  m.activation_bwd(s["dy"], s["x"], k))))
        for t in (False, True):
            cases.append(Case(
                f"activation_fwd_fp8 {kind} t={t}", lambda r, k=kind: _act_state(r, k),
                lambda s: fact._impl_fp8(s["x"]), ops.activation,
                lambda m, s, k=kind, t=t: m.activation_fwd_fp8(
                    s["x"], k, s["scale"], s["amax"], E4M3, write_transpose=t)))
        for hp in (False, True):
            cases.append(Case(
                f"activation_bwd_fp8 {kind} hp={hp}", lambda r, k=kind: _act_state(r, k),
                lambda s: fact._impl_fp8(s["x"]), ops.activation,
                lambda m, s, k=kind, hp=hp: m.activation_bwd_fp8(
                    s["dy"], s["x"], k, s["scale"], s["amax"], E5M2, write_hp=hp)))
    return cases


def _rope_state(r):
    angles = r(12, 8)
    return {"x": r(6, 2, 3, 16), "cos": torch.cos(angles), "sin": torch.sin(angles),
            "pos": (torch.arange(6, dtype=torch.int32)[:, None] + 3).expand(6, 2).contiguous()}


def _rope_cases():
    return [Case(f"rope fwd+bwd interleaved={i}", _rope_state,
                 lambda s: frope._impl(s["x"]), ops.rope,
                 lambda m, s, i=i: (m.rope_fwd(s["x"], s["cos"], s["sin"], s["pos"], i),
                                    m.rope_bwd(s["x"], s["cos"], s["sin"], s["pos"], i)))
            for i in (False, True)]


def _ce_state(r):
    target = torch.randint(0, 40, (7,))
    target[2] = -100
    return {"x": r(7, 20, scale=2.0), "t": target, "g": r(7, 20), "scale": r(1).abs() + 0.5,
            "lse": r(7).abs() + 3.0}


def _ce_cases():
    eager = lambda s: fce._impl(s["x"])  # noqa: E731
    return [
        Case("ce_stats (vocab slice 20..40)", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_stats(s["x"], s["t"], 20)),
        Case("ce_grad into a buffer", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_grad(s["x"], s["t"], s["lse"], s["g"], s["scale"], -100, 20, 40,
                                    0.1, 0.0)),
        Case("ce_grad over the logits", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_grad(s["x"], s["t"], s["lse"], s["x"], s["scale"], -100, 0, 20,
                                    0.0, 1e-4)),
        Case("ce_fused no grad", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_fused(s["x"], s["t"].clamp(0, 19), None, s["scale"], -100, 0.0,
                                     0.0)),
        Case("ce_fused into a buffer", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_fused(s["x"], s["t"].clamp(-100, 19), s["g"], s["scale"], -100,
                                     0.1, 1e-4)),
        Case("ce_fused over the logits", _ce_state, eager, ops.cross_entropy,
             lambda m, s: m.ce_fused(s["x"], s["t"].clamp(-100, 19), s["x"], s["scale"], -100,
                                     0.0, 0.0)),
    ]


def _scaling_module(s):
    if _device.use_triton(s["scale"]):
        from tritium.kernels import scaling as kscaling
        return kscaling
    return rscaling


def _scaling_state(r):
    hist = r(5, 3).abs() * 100.0
    hist[0, 1] = 0.0  # an unused slot: not rolled, scale kept
    return {"hist": hist, "scale": r(3).abs() + 0.5}


def _scaling_cases():
    return [Case(f"delayed_scaling_update {algo} margin={margin}", _scaling_state,
                 _scaling_module, ops.scaling,
                 lambda m, s, a=algo, mg=margin: m.delayed_scaling_update(
                     s["hist"], s["scale"], fp8_max(E4M3), mg, a))
            for algo, margin in (("max", 0), ("most_recent", 1))]


def _gemm_state(r):
    return {"a": (r(32, 48) * 8).to(E4M3), "b": (r(16, 48) * 8).to(E4M3),
            "sa": r(1).abs() + 0.1, "sb": r(1).abs() + 0.1, "bias": r(16, dtype=torch.bfloat16),
            "out": r(64, 16)}


def _gemm_cases():
    eager = lambda s: fgemm  # noqa: E731  (functional.gemm.fp8_gemm_tn is the eager site)
    return [
        Case("fp8_gemm_tn bias", _gemm_state, eager, ops.gemm,
             lambda m, s: m.fp8_gemm_tn(s["a"], s["b"], s["sa"], s["sb"], torch.bfloat16,
                                        s["bias"], True)),
        Case("fp8_gemm_tn out= (a row block)", _gemm_state, eager, ops.gemm,
             lambda m, s: m.fp8_gemm_tn(s["a"], s["b"], s["sa"], s["sb"], torch.float32,
                                        out=s["out"][16:48])),
    ]


CASES = (_cast_cases() + _norm_cases() + _act_cases() + _rope_cases() + _ce_cases()
         + _scaling_cases() + _gemm_cases())
IDS = [c.name for c in CASES]
