"""cpu tier: torch.compile of every FP8 module, end to end (issue 20, docs/compile.md).

For Linear, LayerNormLinear, LayerNormMLP, MultiheadAttention and a Llama-style TransformerLayer,
in high precision and under DelayedScaling and Float8CurrentScaling:
  * `torch._dynamo.explain` finds 0 graph breaks (one graph: forward, fp8_autocast entered
    inside the traced function);
  * `torch.compile(fullgraph=True)` equals eager bit for bit over 3 steps on fresh random data:
    outputs, input and parameter gradients, and every scale and amax history (the backward
    scales update in the compiled backward, the forward ones when fp8_autocast exits), with
    fp8_autocast entered outside and inside the compiled function;
  * FP8 weight caching over micro-batches (is_first_microbatch True, False, False) equals eager;
  * nothing compiles again after the first step (a counting backend);
  * a module whose FP8 state does not exist yet breaks the graph where the state is created, on
    its first call only (`te.prepare_fp8` before compiling avoids it: the other tests use it, as
    docs/compile.md tells users to);
  * Float8BlockScaling and MXFP8BlockScaling (Linear, LayerNormMLP, TransformerLayer), and
    GroupedLinear (bf16, delayed, current, block): fullgraph compiled == eager over 3 steps.
The compiled runs use the "aot_eager" backend (AOTAutograd's graphs, run op by op), which keeps
eager's bits; one test runs Inductor (which may fuse fp32 math differently: fp32 tolerance).
"""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

import tritium as te
from tritium import recipe

from testlib import FP32_TOL, fp8_state

pytestmark = pytest.mark.cpu

H, FFN, HEADS = 64, 128, 4


def _build(kind: str) -> torch.nn.Module:
    kw = dict(device="cpu", params_dtype=torch.float32)
    if kind == "Linear":
        return te.Linear(H, 96, **kw)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(H, 96, normalization="RMSNorm", **kw)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, FFN, normalization="RMSNorm", activation="swiglu", **kw)
    if kind == "MultiheadAttention":
        return te.MultiheadAttention(H, HEADS, num_gqa_groups=2, input_layernorm=True,
                                     attention_dropout=0.0, **kw)
    return te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=2, normalization="RMSNorm",
                               activation="swiglu", bias=False, hidden_dropout=0.0,
                               attention_dropout=0.0, **kw)


KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "TransformerLayer"]
RECIPES = {"bf16": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
           "current": lambda: recipe.Float8CurrentScaling()}


def _step_fn(module, fp8_recipe, autocast_inside: bool):
    """One forward of `module` (its first output), fp8_autocast entered in here or not."""
    def forward(x, **kw):
        if not autocast_inside:
            out = module(x, **kw)
        else:
            with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                out = module(x, **kw)
        return out[0] if isinstance(out, tuple) else out
    return forward


def _run(module, forward, fp8_recipe, autocast_inside, xs, dys, kwargs_per_step=None):
    """fwd + bwd per input; returns everything eager and compiled must agree on."""
    seen = []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        x = x.clone().requires_grad_()
        kw = {} if kwargs_per_step is None else kwargs_per_step[i]
        if autocast_inside:
            out = forward(x, **kw)
        else:
            with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                out = forward(x, **kw)
        out.backward(dy)
        seen += [out.detach(), x.grad]
    seen += [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return seen + fp8_state([module])


def _inputs(steps: int, out_features: int):
    xs = [torch.randn(16, 2, H) for _ in range(steps)]
    dys = [torch.randn(16, 2, out_features) for _ in range(steps)]
    return xs, dys


def _assert_all_equal(eager, compiled) -> None:
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), f"tensor {i} differs: max |diff| {(a - b).abs().max()}"


def _eager_and_compiled(eager_module, fp8_recipe, autocast_inside, xs, dys):
    """_run of `eager_module` and of a compiled (aot_eager, fullgraph) copy of it, made before
    the eager steps and given its FP8 state with te.prepare_fp8."""
    compiled_module = copy.deepcopy(eager_module)
    if fp8_recipe is not None:
        te.prepare_fp8(compiled_module, fp8_recipe)
    torch._dynamo.reset()
    eager = _run(eager_module, _step_fn(eager_module, fp8_recipe, autocast_inside), fp8_recipe,
                 autocast_inside, xs, dys)
    compiled_fn = torch.compile(_step_fn(compiled_module, fp8_recipe, autocast_inside),
                                backend="aot_eager", fullgraph=True)
    return eager, _run(compiled_module, compiled_fn, fp8_recipe, autocast_inside, xs, dys)


def _out_features(kind: str) -> int:
    return 96 if kind in ("Linear", "LayerNormLinear") else H


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", KINDS)
def test_zero_graph_breaks(kind, recipe_name):
    make = RECIPES[recipe_name]
    fp8_recipe = None if make is None else make()
    module = _build(kind)
    if fp8_recipe is not None:
        te.prepare_fp8(module, fp8_recipe)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_step_fn(module, fp8_recipe, True))(
        torch.randn(16, 2, H, requires_grad=True))
    reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast-outside",
                                                                 "autocast-inside"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_equals_eager(kind, recipe_name, autocast_inside):
    if recipe_name == "bf16" and autocast_inside:
        pytest.skip("without FP8 the autocast placement changes nothing")
    make = RECIPES[recipe_name]
    xs, dys = _inputs(3, _out_features(kind))
    _assert_all_equal(*_eager_and_compiled(_build(kind), make and make(), autocast_inside,
                                           xs, dys))


class _CountingBackend:
    """aot_eager that counts how often dynamo hands it a graph (a compile or a recompile)."""

    def __init__(self):
        self.compiles = 0
        self._inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return self._inner(gm, example_inputs)


@pytest.mark.parametrize("kind", ["LayerNormMLP", "TransformerLayer"])
def test_weight_caching_and_no_recompile(kind):
    """Two steps of three micro-batches (is_first_microbatch True, False, False), fp8_autocast
    outside: equal to eager, and the second step compiles nothing."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    eager_module = _build(kind)
    compiled_module = copy.deepcopy(eager_module)
    xs, dys = _inputs(6, H)
    flags = [{"is_first_microbatch": f} for f in (True, False, False) * 2]
    torch._dynamo.reset()
    eager = _run(eager_module, _step_fn(eager_module, fp8_recipe, False), fp8_recipe, False,
                 xs, dys, flags)
    backend = _CountingBackend()
    te.prepare_fp8(compiled_module, fp8_recipe)
    compiled_fn = torch.compile(_step_fn(compiled_module, fp8_recipe, False), backend=backend,
                                fullgraph=True)
    first = _run(compiled_module, compiled_fn, fp8_recipe, False, xs[:3], dys[:3], flags[:3])
    after_first_step = backend.compiles
    second = _run(compiled_module, compiled_fn, fp8_recipe, False, xs[3:], dys[3:], flags[3:])
    assert after_first_step >= 1 and backend.compiles == after_first_step
    # outputs and input grads per micro-batch; then the parameter grads (accumulated over all
    # six micro-batches in both) and the FP8 state after the second step
    _assert_all_equal(eager, first[:6] + second)


def test_fresh_module_breaks_once_where_its_state_is_made():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    module = _build("LayerNormMLP")
    forward = _step_fn(module, fp8_recipe, True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(torch.randn(16, 2, H))
    assert explained.graph_break_count == 1  # FP8Meta._make_states, under compiler.disable
    te.prepare_fp8(module, fp8_recipe)
    torch._dynamo.reset()
    assert torch._dynamo.explain(forward)(torch.randn(16, 2, H)).graph_break_count == 0
    module = _build("LayerNormMLP")
    backend = _CountingBackend()
    compiled_fn = torch.compile(_step_fn(module, fp8_recipe, True), backend=backend)
    counts = []
    for _ in range(4):
        compiled_fn(torch.randn(16, 2, H, requires_grad=True)).sum().backward()
        counts.append(backend.compiles)
    assert counts[0] >= 1 and counts[0] == counts[3]
    with pytest.raises(TypeError, match="fp8_recipe must be a tritium recipe"):
        te.prepare_fp8(module, "delayed")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="Inductor's CPU backend needs a C compiler")
def test_inductor_transformer_layer_fp8():
    """The default backend (Inductor) on the whole layer under DelayedScaling: fp32 tolerance."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    eager_module = _build("TransformerLayer")
    compiled_module = copy.deepcopy(eager_module)
    xs, dys = _inputs(3, H)
    torch._dynamo.reset()
    eager = _run(eager_module, _step_fn(eager_module, fp8_recipe, False), fp8_recipe, False,
                 xs, dys)
    te.prepare_fp8(compiled_module, fp8_recipe)
    compiled_fn = torch.compile(_step_fn(compiled_module, fp8_recipe, False), fullgraph=True)
    compiled = _run(compiled_module, compiled_fn, fp8_recipe, False, xs, dys)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(b, a, **FP32_TOL, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_fp8_params_compiled_equals_eager(kind):
    """Modules built under fp8_model_init (Float8Tensor weights, graph inputs of a traceable
    subclass): compiled == eager over 3 steps, as above."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_model_init(recipe=fp8_recipe):
        eager_module = _build(kind)
    xs, dys = _inputs(3, _out_features(kind))
    _assert_all_equal(*_eager_and_compiled(eager_module, fp8_recipe, False, xs, dys))


@pytest.mark.parametrize("recipe_name", ["block", "mxfp8"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_block_recipes_compiled_equals_eager(kind, recipe_name):
    """Float8BlockScaling and MXFP8BlockScaling (emulated) traced whole (fullgraph) and equal
    to eager bit for bit over 3 steps: outputs, input and parameter gradients (block scales are
    current: no state to compare). Dims of whole 128-blocks (256 tokens, hidden 256)."""
    fp8_recipe = (recipe.Float8BlockScaling() if recipe_name == "block"
                  else recipe.MXFP8BlockScaling())
    kw = dict(device="cpu", params_dtype=torch.float32)
    module = {"Linear": lambda: te.Linear(256, 384, **kw),
              "LayerNormMLP": lambda: te.LayerNormMLP(256, 512, **kw),
              "TransformerLayer": lambda: te.TransformerLayer(
                  256, 512, 4, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization="RMSNorm", activation="swiglu", **kw)}[kind]()
    out = 384 if kind == "Linear" else 256
    xs = [torch.randn(128, 2, 256) for _ in range(3)]
    dys = [torch.randn(128, 2, out) for _ in range(3)]
    _assert_all_equal(*_eager_and_compiled(module, fp8_recipe, True, xs, dys))


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current", "block"])
def test_grouped_linear_compiled_equals_eager(recipe_name):
    """GroupedLinear (4 experts, one of them empty) traced whole and equal to eager bit for bit
    over 3 steps: outputs, input and weight gradients, scales and amax histories (its backward
    scales update in the compiled backward, as the Linear's)."""
    make = {**RECIPES, "block": lambda: recipe.Float8BlockScaling()}[recipe_name]
    fp8_recipe = make and make()
    eager_module = te.GroupedLinear(4, 256, 256, device="cpu", params_dtype=torch.float32)
    compiled_module = copy.deepcopy(eager_module)
    if fp8_recipe is not None:
        te.prepare_fp8(compiled_module, fp8_recipe)
    kw = [{"m_splits": [64, 0, 128, 64]}] * 3
    xs = [torch.randn(256, 256) for _ in range(3)]
    dys = [torch.randn(256, 256) for _ in range(3)]
    torch._dynamo.reset()
    eager = _run(eager_module, _step_fn(eager_module, fp8_recipe, True), fp8_recipe, True, xs,
                 dys, kw)
    compiled_fn = torch.compile(_step_fn(compiled_module, fp8_recipe, True), backend="aot_eager",
                                fullgraph=True)
    _assert_all_equal(eager, _run(compiled_module, compiled_fn, fp8_recipe, True, xs, dys, kw))


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_activation_backward_hands_fc1_its_fp8_grad(bias, monkeypatch):
    """Compiled under DelayedScaling, LayerNormMLP's activation backward writes fc1's fp8
    gradient (the fused kernel, as in eager) and fc1 casts no gradient of its own: the fp8
    pieces reach fc1's Function as the gradients of its grad carriers
    (fused_cast.grad_carriers). Counted per backward, eager and compiled alike, and the
    results equal eager's bit for bit."""
    from tritium.ref import activation as ref_activation
    from tritium.ref import cast as ref_cast
    calls = {"fused": 0, "cast_rows": []}
    fused, cast = ref_activation.activation_bwd_fp8, ref_cast.cast_transpose

    def counting_fused(*args, **kw):
        calls["fused"] += 1
        return fused(*args, **kw)

    def counting_cast(x, *args, **kw):
        calls["cast_rows"].append(tuple(x.shape))
        return cast(x, *args, **kw)
    monkeypatch.setattr(ref_activation, "activation_bwd_fp8", counting_fused)
    monkeypatch.setattr(ref_cast, "cast_transpose", counting_cast)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    module = te.LayerNormMLP(H, FFN, normalization="RMSNorm", activation="swiglu", bias=bias,
                             device="cpu", params_dtype=torch.float32)
    xs, dys = _inputs(3, H)
    eager, compiled = _eager_and_compiled(module, fp8_recipe, False, xs, dys)
    _assert_all_equal(eager, compiled)
    assert calls["fused"] == 6  # 3 eager + 3 compiled backwards
    # no cast of fc1's grad_output [32, 2 * FFN] anywhere (fc2's grad [32, H] is cast)
    assert (32, 2 * FFN) not in calls["cast_rows"] and (32, H) in calls["cast_rows"]
