"""cpu tier: the FP8 Linear casts the weight's fp8 transpose again in backward (functional/_recast).

Where no cache keeps the weight's fp8 form, the forward no longer keeps w8^T for dgrad; backward
casts it again from the Parameter with the forward's scale. Checked here:
  * bit for bit the same as keeping it, over 3 steps on fresh data: outputs, input and
    parameter gradients, every scale and amax history, for Linear (one-pass and blocked
    backward), LayerNormLinear and LayerNormMLP under DelayedScaling (whose scale changes at
    autocast exit, between forward and backward) and Float8CurrentScaling, and for Linear under
    the block recipes. The path that keeps w8^T is a weight cache's first micro-batch
    (is_first_microbatch=True): the same casts, with the transpose written in forward and kept;
  * what the graph keeps for backward (every saved tensor and every tensor on a Function's
    context, the operands its FP8 plan carries included, parameters and input left out,
    counted once per storage) drops by the fp8 transpose's bytes per GEMM, less the 4-byte
    scale (or amax) kept to cast it again; a LayerNormMLP's pair-cast w8 is not kept either;
  * a cache (is_first_microbatch True / False), FP8 params and parameters_split's concatenated
    weight keep w8^T and never cast again;
  * a weight changed in place between forward and backward raises, naming the fix;
  * weights of at most `KEEP_TRANSPOSE_MAX_NUMEL` elements keep w8^T (the other tests lower
    the threshold to 0, so their small modules take the recast path);
  * a forward without grad writes no transpose at all, with the same output bits.
"""
from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch

import tritium as te
from tritium import recipe

from testlib import fp8_state

pytestmark = pytest.mark.cpu

fl = importlib.import_module("tritium.functional.linear")
bl = importlib.import_module("tritium.functional.block_linear")
recast_rule = importlib.import_module("tritium.functional._recast")


@pytest.fixture(autouse=True)
def _recast_small_weights(monkeypatch, request):
    """These modules' weights are small enough to keep w8^T: every weight casts again here,
    except in the test of the threshold itself."""
    if "threshold" not in request.node.name:
        monkeypatch.setattr(recast_rule, "KEEP_TRANSPOSE_MAX_NUMEL", 0)

T, H, FFN = 40, 64, 64
KW = dict(device="cpu", params_dtype=torch.bfloat16)
BUILD = {
    "Linear": lambda: te.Linear(H, 32, **KW),            # one-pass backward
    "Linear-blocked": lambda: te.Linear(48, 160, **KW),  # backward over blocks of dy
    "LayerNormLinear": lambda: te.LayerNormLinear(H, 96, normalization="RMSNorm", **KW),
    "LayerNormMLP": lambda: te.LayerNormMLP(H, FFN, normalization="RMSNorm",
                                            activation="swiglu", **KW),
}
RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
           "current": lambda: recipe.Float8CurrentScaling()}
BLOCK_RECIPES = {"block2d": lambda: recipe.Float8BlockScaling(),
                 "block1d": lambda: recipe.Float8BlockScaling(w_block_scaling_dim=1),
                 "mxfp8": lambda: recipe.MXFP8BlockScaling()}


def _gemm_weights(module):
    return [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() == 2]


def _dims(module):
    """(features in, features out) of the module: its first GEMM's K, its last GEMM's N."""
    weights = _gemm_weights(module)
    return weights[0].shape[1], weights[-1].shape[0]


def _nodes(out):
    seen, stack = {}, [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(f for f, _ in node.next_functions)
    return list(seen)


def _ops(nodes):
    """The w8^T entry of every FP8 Linear node: a tensor kept from forward, or a recast."""
    found = []
    for node in nodes:
        ops = getattr(node, "fp8_operands", None) or getattr(node, "operands", None)
        if ops is not None and len(ops) == 4:
            found.append(ops[2])
    return found


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                yield from _tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif hasattr(type(obj), "__slots__") and not isinstance(obj, type):
        for name in type(obj).__slots__:
            yield from _tensors(getattr(obj, name, None))
    elif isinstance(obj, fl.FP8Plan):  # what a plan carries for one call (its weight_ready)
        yield from _tensors(obj.weight_ready)


def _kept_bytes(out, exclude) -> int:
    """Bytes the graph behind `out` keeps for backward: every saved tensor and every tensor on a
    Function's context (in lists, tuples and slotted objects), one count per storage, the
    storages of `exclude` (parameters, input) left out."""
    items = []
    for node in _nodes(out):
        items += [getattr(node, n) for n in dir(node) if n.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            items.append(node.saved_tensors)
        items += list(getattr(node, "__dict__", {}).values())
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _tensors(items)}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def _steps(module, fp8_recipe, xs, dys, first):
    """fwd + bwd per input under fp8_autocast; what both paths must agree on, and what the
    first forward's graph held for its dgrads (w8^T entries)."""
    seen, held = [], None
    for x, dy in zip(xs, dys):
        module.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(x, is_first_microbatch=first)
        held = _ops(_nodes(out)) if held is None else held
        out.backward(dy)
        seen += [out.detach(), x.grad] + [p.grad for p in module.parameters()]
    return seen + fp8_state([module]), held


def _count_recasts(monkeypatch):
    calls = []
    for cls in (fl.WeightRecast, bl._WeightRecast):
        real = cls.__call__

        def counted(self, _real=real):
            calls.append(type(self))
            return _real(self)
        monkeypatch.setattr(cls, "__call__", counted)
    return calls


def _parity(monkeypatch, module, fp8_recipe, steps=3):
    k, n = _dims(module)
    xs = [torch.randn(T, k, dtype=torch.bfloat16) for _ in range(steps)]
    dys = [torch.randn(T, n, dtype=torch.bfloat16) for _ in range(steps)]
    kept_module = copy.deepcopy(module)
    calls = _count_recasts(monkeypatch)
    got, held = _steps(module, fp8_recipe, xs, dys, None)
    assert held and all(callable(w) for w in held), "the forward kept w8^T"
    gemms = len(held)
    assert len(calls) == gemms * steps           # one recast per GEMM and backward
    want, kept = _steps(kept_module, fp8_recipe, xs, dys, True)
    assert kept and all(isinstance(w, torch.Tensor) for w in kept)
    assert len(calls) == gemms * steps           # the cached path never casts again
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and torch.equal(a, b), f"tensor {i} differs"
    return got


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(BUILD))
def test_recast_equals_kept_transpose_bit_for_bit(monkeypatch, kind, recipe_name):
    got = _parity(monkeypatch, BUILD[kind](), RECIPES[recipe_name]())
    assert all(t.abs().max() > 0 for t in got[:3])


@pytest.mark.parametrize("recipe_name", list(BLOCK_RECIPES))
def test_block_recipes_recast_equals_kept_blocks(monkeypatch, recipe_name):
    _parity(monkeypatch, te.Linear(272, 144, **KW), BLOCK_RECIPES[recipe_name](), steps=2)


def _kept_after_forward(module, fp8_recipe, first):
    k, _ = _dims(module)
    x = torch.randn(T, k, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        out = module(x, is_first_microbatch=first)
    return _kept_bytes(out, [x, *module.parameters()])


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_kept_bytes_drop_by_the_fp8_weight(kind, recipe_name):
    module, fp8_recipe = BUILD[kind](), RECIPES[recipe_name]()
    kept = _kept_after_forward(copy.deepcopy(module), fp8_recipe, True)
    recast = _kept_after_forward(module, fp8_recipe, None)
    weights = _gemm_weights(module)
    # each GEMM: w8^T (1 byte per weight element) no longer kept; its 4-byte fp32 scale copy
    # (delayed) or measured amax (current) kept instead
    assert kept - recast == sum(w.numel() - 4 for w in weights)
    assert recast > 0


def test_kept_bytes_drop_by_the_weight_blocks_under_block_scaling():
    module, k, n = te.Linear(272, 144, **KW), 272, 144
    kept = _kept_after_forward(copy.deepcopy(module), recipe.Float8BlockScaling(), True)
    recast = _kept_after_forward(module, recipe.Float8BlockScaling(), None)
    # w8^T [K, N] in fp8 and its 128x128 blocks' fp32 scales [Kb, Nb]: nothing kept instead
    assert kept - recast == k * n + 4 * math.ceil(k / 128) * math.ceil(n / 128)


@pytest.mark.parametrize("recipe_name", ["delayed", "block2d"])
def test_caches_fp8_params_and_split_weights_keep_the_transpose(monkeypatch, recipe_name):
    fp8_recipe = (RECIPES | BLOCK_RECIPES)[recipe_name]()
    calls = _count_recasts(monkeypatch)
    x = torch.randn(T, 128, dtype=torch.bfloat16)
    cached = te.Linear(128, 64, **KW)
    with te.fp8_model_init(enabled=True, recipe=fp8_recipe):
        fp8_params = te.Linear(128, 64, **KW)
    split = te.Linear(128, 64, parameters_split=("a", "b"), **KW)
    runs = [(cached, True), (cached, False), (cached, False), (fp8_params, None), (split, None)]
    for module, first in runs:
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(xi, is_first_microbatch=first)
        held = _ops(_nodes(out))
        assert len(held) == 1 and isinstance(held[0], torch.Tensor), (module, first)
        out.float().sum().backward()
        assert xi.grad.abs().max() > 0
    assert calls == []


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_no_grad_forward_writes_no_transposes(monkeypatch, recipe_name):
    """A forward without grad (a reentrant recompute's first forward, evaluation) writes none of
    the fp8 transposes that only backward reads, though ctx.needs_input_grad says True there for
    a weight that requires grad (FP8Plan.grad), and gives the bits a forward with grad gives."""
    from tritium.ref import cast as ref_cast
    asked = []
    real_cast, real_transpose = ref_cast.cast_transpose, ref_cast.transpose_fp8

    def cast(*args, **kwargs):
        asked.append(kwargs.get("write_transpose", False))
        return real_cast(*args, **kwargs)

    def transpose(data, out=None):
        asked.append(True)
        return real_transpose(data, out)
    monkeypatch.setattr(ref_cast, "cast_transpose", cast)
    monkeypatch.setattr(ref_cast, "transpose_fp8", transpose)
    for kind, build in BUILD.items():
        module = build()
        twin = copy.deepcopy(module)
        x = torch.randn(T, _dims(module)[0], dtype=torch.bfloat16)
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            out = module(x)
        assert asked and not any(asked), (kind, asked)
        with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            ref = twin(x.clone().requires_grad_())
        assert torch.equal(out, ref), kind
        asked.clear()


def test_weight_changed_between_forward_and_backward_raises():
    lin = te.Linear(H, 32, **KW)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        out.float().sum().backward()


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block2d"])
def test_small_weights_keep_the_transpose_at_the_threshold(monkeypatch, recipe_name):
    """A weight of at most KEEP_TRANSPOSE_MAX_NUMEL elements keeps w8^T from forward (no recast
    in backward); one element more casts again. Gradients equal either way."""
    fp8_recipe = (RECIPES | BLOCK_RECIPES)[recipe_name]()
    module = te.Linear(256, 144, **KW)
    calls = _count_recasts(monkeypatch)
    x = torch.randn(T, 256, dtype=torch.bfloat16)
    grads, copies = [], (module, copy.deepcopy(module))  # the same scaling state in each
    for limit, module in zip((module.weight.numel(), module.weight.numel() - 1), copies):
        monkeypatch.setattr(recast_rule, "KEEP_TRANSPOSE_MAX_NUMEL", limit)
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(xi)
        held = _ops(_nodes(out))
        assert len(held) == 1
        assert isinstance(held[0], torch.Tensor) == (limit == module.weight.numel())
        out.float().sum().backward()
        grads.append(xi.grad)
    assert len(calls) == 1
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])
