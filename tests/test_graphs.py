"""make_graphed_callables on the CPU: argument checks, the eager fallback, and the replay logic.

Three parts:
  * bad use raises before anything is captured (hooks, non-tensor args, mixed train/eval, FP8
    arguments without FP8, conflicting TE names, ...); a failed call leaves modules as they were;
  * without CUDA the callables run eagerly with one warning, under the FP8 settings they were
    given, with is_first_microbatch going through the weight caches' device flag;
  * the replay logic with an eager emulation of CUDA graphs (`Emu` below: a "capture" runs
    nothing the user can see, a "replay" reruns the captured forward / backward on the static
    buffers). Graphed and eager training (3 steps x 2 micro-batches, SGD) must then agree bit for
    bit in outputs, input and param grads, params and FP8 scales / amax histories: this checks
    the warm-up restore, the FP8 region registration at replay, the forward update at the outer
    autocast exit, the backward update after the backward replay of the region's first callable
    only, the weight-cache flag, and grads accumulated by autograd into the same .grad tensors.
The gpu tier (tests/gpu/test_gpu_graphs.py) runs the same scenarios with real CUDA graphs.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import tritium as te
from tritium import graphs, recipe
from tritium.graphs import make_graphed_callables

from testlib import fp8_state, fp8_states

pytestmark = pytest.mark.cpu

H = 32


def _recipe():
    return recipe.DelayedScaling(amax_history_len=4)


def _linear(**kw):
    return te.Linear(H, 48, device="cpu", **kw)


# ------------------------------------------------------------------ argument checks
def test_hooks_are_refused(randn):
    x = randn(4, H)
    for register in (lambda m: m.register_forward_hook(lambda *a: None),
                     lambda m: m.register_forward_pre_hook(lambda *a: None),
                     lambda m: m.register_full_backward_hook(lambda *a: None)):
        outer = torch.nn.Sequential(_linear(), torch.nn.GELU())
        register(outer[1])  # on a submodule: still baked into the graph
        with pytest.raises(ValueError, match="has hooks"):
            make_graphed_callables(outer, (x,))
    m = _linear()
    m.weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="tensor hooks"):
        make_graphed_callables(m, (x,))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        with pytest.raises(ValueError, match="global module hooks"):
            make_graphed_callables(_linear(), (x,))
    finally:
        handle.remove()


def test_sample_args_must_be_tensors(randn):
    m = _linear()
    with pytest.raises(TypeError, match="tensors only"):
        make_graphed_callables(m, (randn(4, H), 3))
    with pytest.raises(TypeError, match="tensors only"):
        make_graphed_callables(m, ([randn(4, H), "x"],))
    with pytest.raises(TypeError, match="tuple of the callable's positional"):
        make_graphed_callables(m, 3)
    with pytest.raises(TypeError, match="tuple of 2 tuples"):
        make_graphed_callables((m, _linear()), (randn(4, H),))
    with pytest.raises(TypeError, match="sample_kwargs must be a dict"):
        make_graphed_callables(m, (randn(4, H),), sample_kwargs=[1])


def test_mixed_train_eval_is_refused(randn):
    outer = torch.nn.Sequential(_linear(), torch.nn.Dropout(0.1))
    outer[1].eval()
    with pytest.raises(ValueError, match="mixed train/eval"):
        make_graphed_callables(outer, (randn(4, H),))
    a, b = _linear(), _linear()
    b.eval()
    with pytest.raises(ValueError, match="mixed train/eval"):
        make_graphed_callables((a, b), ((randn(4, H),), (randn(4, H),)))


def test_fp8_arguments_without_fp8(randn):
    x = randn(4, H)
    for kw in (dict(fp8_recipe=_recipe()), dict(fp8_weight_caching=True),
               dict(recipe=_recipe()), dict(cache_quantized_params=True)):
        with pytest.raises(ValueError, match="FP8 is off"):
            make_graphed_callables(_linear(), (x,), **kw)
    with pytest.raises(ValueError, match="needs fp8_enabled=True"):
        make_graphed_callables(_linear(), (x,), fp8_calibrating=True, fp8_weight_caching=True)
    with pytest.raises(TypeError, match="name the same setting"):
        make_graphed_callables(_linear(), (x,), fp8_enabled=True, enabled=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fp8_enable'"):
        make_graphed_callables(_linear(), (x,), fp8_enable=True)
    with pytest.raises(TypeError, match="fp8_group must be a torch.distributed"):
        make_graphed_callables(_linear(), (x,), fp8_enabled=True, amax_reduction_group=3)
    with pytest.raises(TypeError, match="fp8_recipe must be"):
        make_graphed_callables(_linear(), (x,), fp8_enabled=True, fp8_recipe="delayed")


def test_other_bad_use(randn):
    x = randn(4, H)
    m = _linear()
    with pytest.raises(ValueError, match="2 x chunks"):
        make_graphed_callables(m, ((x,),), _order=[1])
    with pytest.raises(ValueError, match="num_warmup_iters"):
        make_graphed_callables(m, (x,), num_warmup_iters=0)
    with pytest.raises(ValueError, match="appears twice"):
        make_graphed_callables((m, m), ((x,), (x,)))
    with pytest.raises(ValueError, match="no callable holds a tritium FP8 module"):
        make_graphed_callables(lambda t: m(t), (x,), fp8_enabled=True, fp8_weight_caching=True)
    with pytest.raises(ValueError, match="no callable holds a tritium FP8 module"):
        make_graphed_callables(torch.nn.Linear(H, H), (x,), fp8_enabled=True,
                               fp8_weight_caching=True)
    bad = torch.nn.Linear(H, H)
    bad.register_buffer("b", torch.zeros(1, requires_grad=True))
    with pytest.raises(ValueError, match="buffer 'b' requires grad"):
        make_graphed_callables(bad, (x,))


# ------------------------------------------------------------------ the eager emulation
class EmuFwd:
    """A "replay" of the forward: the captured callable rerun on the static inputs, its outputs
    copied into the static outputs (grad mode on: the backward replay differentiates them)."""

    def __init__(self, cap):
        self.cap, self.outs = cap, None

    def replay(self):
        cap = self.cap
        args, kwargs = torch.utils._pytree.tree_unflatten(cap.leaves, cap.spec)
        with torch.enable_grad(), graphs._captured_autocast(cap.cfg):
            self.outs = torch.utils._pytree.tree_leaves(cap.orig_forward(*args, **kwargs))
        with torch.no_grad():
            for static, o in zip(cap.outputs, self.outs):
                static.copy_(o)


class EmuBwd:
    def __init__(self, cap, fwd):
        self.cap, self.fwd = cap, fwd

    def replay(self):
        cap = self.cap
        need = [o for o, s in zip(self.fwd.outs, cap.outputs) if s.requires_grad]
        wrt = [t for t in cap.surface if t.requires_grad]
        grads = torch.autograd.grad(need, wrt, [g for g in cap.grad_outputs if g is not None],
                                    allow_unused=True)
        statics = [g for g, t in zip(cap.grad_inputs, cap.surface) if t.requires_grad]
        with torch.no_grad():
            for static, g in zip(statics, grads):
                if static is not None:
                    static.copy_(g)


class Emu(graphs._CudaOps):
    """CUDA calls replaced for the CPU; a capture executes (eagerly) but its effects are undone."""

    wants_graph = staticmethod(lambda devices: True)
    synchronize = staticmethod(lambda: None)
    side_stream = staticmethod(contextlib.nullcontext)
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    pool = staticmethod(lambda: None)
    new_graph = staticmethod(lambda: None)
    capture = staticmethod(lambda graph, pool: contextlib.nullcontext())


@pytest.fixture
def emulated(monkeypatch):
    real_capture = graphs._capture

    def capture(caps, pool, retain_graph, **kw):
        saved = [s for cap in caps for s in cap.snapshot()]
        real_capture(caps, pool, retain_graph, **kw)
        graphs._restore(saved)  # a real capture runs nothing
        for cap in caps:
            cap.fwd_graph = EmuFwd(cap)
            cap.bwd_graph = EmuBwd(cap, cap.fwd_graph)

    monkeypatch.setattr(graphs, "_cuda", Emu())
    monkeypatch.setattr(graphs, "_capture", capture)


# ------------------------------------------------------------------ training driver
def train(make, shapes, *, graph, fp8=True, caching=False, steps=3, mbs=2, seed=0,
          set_to_none=True, outer=True, recipe_=None, data_seed=123):
    """Build the callables with `make()` (seeded), optionally graph them, and train: per step
    `mbs` micro-batches of fresh inputs through the callables in sequence, backward of a random
    projection, SGD. Returns every observed tensor in order."""
    torch.manual_seed(seed)
    mods = make()
    rec = recipe_ or _recipe()
    gen = torch.Generator().manual_seed(data_seed)
    if graph:
        samples = tuple((torch.randn(*s, generator=gen).requires_grad_(True),)
                        for s in shapes)
        mods = make_graphed_callables(mods if len(mods) > 1 else mods[0],
                                      samples if len(mods) > 1 else samples[0],
                                      fp8_enabled=fp8, fp8_recipe=rec if fp8 else None,
                                      fp8_weight_caching=caching)
        mods = mods if isinstance(mods, tuple) else (mods,)
    gen = torch.Generator().manual_seed(data_seed + 1)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    seen = []
    for _ in range(steps):
        for mb in range(mbs):
            x = torch.randn(*shapes[0], generator=gen).requires_grad_(True)
            kw = {"is_first_microbatch": mb == 0} if caching else {}
            ctx = te.fp8_autocast(enabled=fp8, fp8_recipe=rec) if outer \
                else contextlib.nullcontext()
            with ctx:
                y = x
                for m in mods:
                    y = m(y, **kw)
            seen += [y.detach().clone()]
            y.backward(torch.randn(y.shape, generator=gen))
            seen += [x.grad.clone()]
        seen += [p.grad.clone() for p in params if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        seen += [p.detach().clone() for p in params] + fp8_state(mods)
    return seen, mods


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and torch.equal(x, y), f"tensor {i} differs"


def _mlp():
    return (te.LayerNormMLP(H, 64, device="cpu"),)


@pytest.mark.parametrize("make,shapes", [
    (lambda: (_linear(),), [(20, H)]),
    (_mlp, [(3, 7, H)]),
    (lambda: (te.LayerNormLinear(H, H, device="cpu"), _linear()), [(20, H), (20, H)]),
], ids=["Linear", "LayerNormMLP", "LNLinear+Linear"])
@pytest.mark.parametrize("fp8,caching", [(False, False), (True, False), (True, True)])
def test_graphed_equals_eager(emulated, make, shapes, fp8, caching):
    eager, _ = train(make, shapes, graph=False, fp8=fp8, caching=caching)
    graphed, mods = train(make, shapes, graph=True, fp8=fp8, caching=caching)
    assert_same(graphed, eager)
    assert all(m.forward.__name__ == "call" for m in mods)


@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_graphed_equals_eager_with_fp8_attention(emulated, flag):
    """FP8 attention's forward-only states (q/k/v; fp8_mha's output): made before the warm-up,
    restored after it and registered again at every replay, so they update at the autocast
    exit as eager's do."""
    rec = recipe.DelayedScaling(amax_history_len=4, **{flag: True})

    def make():
        return (te.MultiheadAttention(H, 4, attention_dropout=0.0, device="cpu"),)

    eager, eager_mods = train(make, [(8, 2, H)], graph=False, recipe_=rec)
    graphed, graphed_mods = train(make, [(8, 2, H)], graph=True, recipe_=rec)
    assert_same(graphed, eager)
    states = fp8_states(graphed_mods[0])
    assert_same(states, fp8_states(eager_mods[0]))
    attn = graphed_mods[0].core_attention
    assert attn.fp8_attn_state.scale.ne(1).any()       # the updates ran
    assert (attn.fp8_out_state is None) == (flag == "fp8_dpa")


@pytest.mark.parametrize("make,shapes", [
    (lambda: (_linear(),), [(20, H)]),
    (_mlp, [(3, 7, H)]),
], ids=["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("rec", [recipe.Float8BlockScaling(), recipe.MXFP8BlockScaling()],
                         ids=["block", "mxfp8"])
@pytest.mark.parametrize("caching", [False, True])
def test_graphed_equals_eager_block_recipes(emulated, make, shapes, rec, caching):
    """Block-scaled recipes graph too; with weight caching the graph re-quantizes the weights
    at every replay, which gives the cached bits (current block scales, weights unchanged
    between micro-batches)."""
    eager, _ = train(make, shapes, graph=False, caching=caching, recipe_=rec)
    graphed, _ = train(make, shapes, graph=True, caching=caching, recipe_=rec)
    assert_same(graphed, eager)


def test_bwd_update_only_after_the_first_callable(emulated, monkeypatch):
    """Two callables in one region: the backward scale update must wait for callable 0's
    backward. Updating after every backward replay gives other scales: caught."""
    make = lambda: (te.LayerNormLinear(H, H, device="cpu"), _linear())  # noqa: E731
    eager, _ = train(make, [(20, H), (20, H)], graph=False)
    real = graphs._Graphed.backward

    def eager_update(ctx, *grads):
        if ctx.bwd_region is None:
            ctx.bwd_region = _outer_region[0]
        return real(ctx, *grads)
    _outer_region = [None]
    real_apply = graphs._Graphed.apply

    def apply(cap, bwd_region, *inputs):
        _outer_region[0] = bwd_region or _outer_region[0]
        return real_apply(cap, bwd_region, *inputs)
    monkeypatch.setattr(graphs._Graphed, "backward", staticmethod(eager_update))
    monkeypatch.setattr(graphs._Graphed, "apply", apply)
    wrong, _ = train(make, [(20, H), (20, H)], graph=True)
    assert any(not torch.equal(a, b) for a, b in zip(wrong, eager))


def test_without_outer_autocast_it_is_its_own_region(emulated):
    """No fp8_autocast around the call: as eager `with fp8_autocast(...): m(x)` per call."""
    def run(graph):
        torch.manual_seed(0)
        m = _linear()
        rec = _recipe()
        gen = torch.Generator().manual_seed(3)
        g = m if not graph else make_graphed_callables(m, (torch.randn(20, H),),
                                                       fp8_enabled=True, fp8_recipe=rec)
        seen = []
        for _ in range(3):
            x = torch.randn(20, H, generator=gen)
            if graph:
                y = g(x)
            else:
                with te.fp8_autocast(fp8_recipe=rec):
                    y = g(x)
            y.sum().backward()
            seen += [y.detach().clone(), m.weight.grad.clone()] + fp8_state([m])
        return seen
    eager = run(False)
    assert_same(run(True), eager)


def test_graph_keeps_its_fp8_setting_inside_another_autocast(emulated):
    """Captured with FP8 but called under fp8_autocast(enabled=False): still FP8 (the inner
    setting wins, as a nested fp8_autocast would); captured without FP8 under an FP8 autocast:
    high precision."""
    torch.manual_seed(0)
    m, ref = _linear(), _linear()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(20, H)
    g = make_graphed_callables(m, (x,), fp8_enabled=False)
    with te.fp8_autocast(enabled=True, fp8_recipe=_recipe()):
        y = g(x)
    assert torch.equal(y, ref(x))  # plain high precision
    assert m.fp8_meta.fwd is None or not m.fp8_meta.fwd.amax_history.any()


def test_seed_scenario_grad_is_one_every_step(emulated):
    """Torch's example of the bug: weight 1, input 1, grads zeroed each step: grad 1, 1, 1."""
    for set_to_none in (True, False):
        lin = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            lin.weight.fill_(1.0)
        g = make_graphed_callables(lin, (torch.ones(1, 1),))
        assert lin.weight.grad is not None and not lin.weight.grad.any()  # made before capture
        grad0 = lin.weight.grad
        for _ in range(3):
            g(torch.ones(1, 1)).sum().backward()
            assert lin.weight.grad.item() == 1.0
            assert set_to_none or lin.weight.grad is grad0
            lin.zero_grad(set_to_none=set_to_none)


def test_grads_accumulate_over_micro_batches(emulated):
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    g = make_graphed_callables(lin, (torch.ones(1, 1),))
    for mb in range(3):
        g(torch.full((1, 1), 2.0)).sum().backward()
        assert lin.weight.grad.item() == 2.0 * (mb + 1)


def test_main_grad(emulated):
    def make():
        m = _linear(fuse_wgrad_accumulation=True)
        for p in (m.weight,):
            p.main_grad = torch.zeros(p.shape)
        return (m,)

    def collect(graph):
        seen, (m,) = train(make, [(20, H)], graph=graph)
        return seen + [m.weight.main_grad.clone()], m
    eager, _ = collect(False)
    graphed, m = collect(True)
    assert_same(graphed, eager)
    assert m.weight.grad is None  # main_grad params get no .grad, as eagerly
    m.weight.main_grad = torch.zeros(m.weight.shape)
    with te.fp8_autocast(fp8_recipe=_recipe()), pytest.raises(RuntimeError, match="main_grad"):
        m(torch.randn(20, H, requires_grad=True))


def test_calibration(emulated):
    def run(graph):
        torch.manual_seed(0)
        m = _linear()
        rec = _recipe()
        x0 = torch.randn(20, H)
        g = make_graphed_callables(m, (x0,), fp8_calibrating=True, fp8_recipe=rec) if graph \
            else m
        seen = []
        for _ in range(3):
            with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=rec):
                y = g(torch.randn(20, H, generator=gen))
            y.sum().backward()
            seen += [y.detach().clone()] + fp8_state([m])
        return seen
    gen = torch.Generator().manual_seed(7)
    eager = run(False)
    gen.manual_seed(7)
    graphed = run(True)
    assert_same(graphed, eager)
    assert eager[-1].any()  # amaxes were recorded


def test_replay_argument_checks(emulated):
    m = _linear()
    x = torch.randn(20, H, requires_grad=True)
    g = make_graphed_callables(m, (x,))
    with pytest.raises(ValueError, match="captured for torch.float32"):
        g(torch.randn(21, H, requires_grad=True))
    with pytest.raises(ValueError, match="requires_grad=True"):
        g(torch.randn(20, H))
    with pytest.raises(TypeError, match="is_first_microbatch only as a keyword"):
        g(x, True)
    g(x, is_first_microbatch=False)  # accepted (and ignored) without weight caching


def test_constant_kwargs_are_baked_in(emulated):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, *, factor=1.0):
            return self.lin(x) * factor
    m = Scaled()
    g = make_graphed_callables(m, (torch.randn(2, 4),), sample_kwargs={"factor": 3.0})
    x = torch.randn(2, 4)
    assert torch.equal(g(x, factor=3.0), m.lin(x) * 3.0)
    with pytest.raises(ValueError, match="constants are baked into the graph"):
        g(x, factor=2.0)


def test_eval_mode_runs_eagerly(emulated):
    torch.manual_seed(0)
    m = _linear()
    g = make_graphed_callables(m, (torch.randn(20, H),))
    m.eval()
    x = torch.randn(5, H)  # another shape: would be refused by the graph
    with torch.no_grad():
        assert torch.equal(g(x), torch.nn.functional.linear(x, m.weight, m.bias))


def test_failed_capture_leaves_no_flag(emulated):
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.spare = _linear(), torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.lin(x)
    m = Unused()
    with pytest.raises(ValueError, match="parameter 'spare'.*allow_unused_input"):
        make_graphed_callables(m, (torch.randn(20, H),), fp8_enabled=True,
                               fp8_recipe=_recipe(), fp8_weight_caching=True)
    assert m.lin._weight_caches[0].skip is None
    make_graphed_callables(m, (torch.randn(20, H),), allow_unused_input=True)


# ------------------------------------------------------------------ the real CPU fallback
def test_fallback_warns_once_and_matches_eager():
    make = lambda: (te.LayerNormLinear(H, H, device="cpu"),)  # noqa: E731
    eager, _ = train(make, [(20, H)], graph=False, caching=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed, (m,) = train(make, [(20, H)], graph=True, caching=True)
    msgs = [w for w in caught if "no CUDA graphs" in str(w.message)]
    assert len(msgs) == 1
    assert_same(graphed, eager)
    assert m._weight_caches[0].skip is not None  # caching went through the device flag


def test_fallback_te_names_and_tuples():
    torch.manual_seed(0)
    a, b = _linear(), te.Linear(48, H, device="cpu")
    fn = lambda t: t * 2.0  # noqa: E731
    with pytest.warns(UserWarning, match="no CUDA graphs"):
        ga, gfn, gb = make_graphed_callables((a, fn, b), ((torch.randn(4, H),),
                                                           (torch.randn(4, 48),),
                                                           (torch.randn(4, 48),)),
                                             enabled=True, recipe=_recipe(),
                                             cache_quantized_params=True)
    assert ga is a and gb is b and callable(gfn)
    x = torch.randn(4, H)
    y = gb(gfn(ga(x, is_first_microbatch=True)), is_first_microbatch=True)
    assert y.shape == (4, H)
    assert a.fp8_meta.fwd.scale.ne(1).any()  # its own region updated the scales at once
