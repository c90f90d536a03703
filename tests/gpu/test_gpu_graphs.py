"""gpu tier: make_graphed_callables with real CUDA graphs, graphed == eager bit for bit.

Scenarios (issue 7):
  * the seed scenario: a Linear with weight 1 and input 1, three steps with zeroed grads (both
    zero_grad flavours), gives grad 1 every step (lazily created grads once read 1, 2, 2), and
    grads accumulate over micro-batches into the tensor the optimizer sees;
  * Linear, LayerNormLinear, LayerNormMLP, MultiheadAttention and a 3-layer TransformerLayer stack
    (hidden 64; also as a tuple of three separately graphed layers), with and without FP8
    (DelayedScaling) and with and without FP8 weight caching: 3 optimizer steps x 2
    micro-batches, graphed vs eager give bit-identical outputs, input grads, param grads,
    params, and FP8 scales / amax histories (torch.equal: -0.0 == 0.0, NaN fails);
  * fuse_wgrad_accumulation (main_grad) the same way;
  * forward, backward AND the optimizer step graphed (FusedAdam(capturable=True), the step
    captured with torch.cuda.graph) against the same optimizer run eagerly.
Attention runs on the deterministic "torch" backend for the bitwise tests (cuDNN/flash backward
may reduce in another order from run to run); one test runs the default backend at tolerance.
Fresh random data from a CUDA generator seeded per test.
"""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.graphs import make_graphed_callables
from tritium.optimizers import FusedAdam

from testlib import fp8_state

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 GEMMs need compute capability >= 8.9")

H, SEQ, BATCH = 64, 32, 2
BF16 = torch.bfloat16


def _recipe():
    return recipe.DelayedScaling(amax_history_len=8, amax_compute_algo="max")


class Stack(torch.nn.Module):
    """Layers in sequence, passing is_first_microbatch down (the eager reference needs it)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def _tl():
    return te.TransformerLayer(H, 4 * H, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=BF16)


MODELS = {  # name -> (build, input shape); each build returns a tuple of callables
    "Linear": (lambda: (te.Linear(H, 48, params_dtype=BF16),), (SEQ * BATCH, H)),
    "LayerNormLinear": (lambda: (te.LayerNormLinear(H, 96, params_dtype=BF16),), (SEQ, BATCH, H)),
    "LayerNormMLP": (lambda: (te.LayerNormMLP(H, 4 * H, params_dtype=BF16),), (SEQ, BATCH, H)),
    "MultiheadAttention": (lambda: (te.MultiheadAttention(H, 4, attention_dropout=0.0,
                                                          params_dtype=BF16),), (SEQ, BATCH, H)),
    "TransformerLayer x3": (lambda: (Stack([_tl() for _ in range(3)]),), (SEQ, BATCH, H)),
    "TransformerLayer x3 (tuple)": (lambda: tuple(_tl() for _ in range(3)), (SEQ, BATCH, H)),
}


def _build(name, seed):
    torch.manual_seed(seed)
    return MODELS[name][0]()


def train(mods, shape, *, graph, fp8, caching, seed, steps=3, mbs=2, optimizer="sgd",
          capture_step=False, rec=None):
    """3 steps x 2 micro-batches of fresh data; returns everything observed, in order."""
    rec = rec or _recipe()
    params = [p for m in mods for p in m.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if graph:
        samples = tuple((torch.randn(shape, device="cuda", dtype=BF16,
                                     generator=gen).requires_grad_(True),) for _ in mods)
        mods = make_graphed_callables(mods if len(mods) > 1 else mods[0],
                                      samples if len(mods) > 1 else samples[0],
                                      fp8_enabled=fp8, fp8_recipe=rec if fp8 else None,
                                      fp8_weight_caching=caching)
        mods = mods if isinstance(mods, tuple) else (mods,)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True,
                                      master_weights=True)
    step_graph = None
    seen = []
    for step in range(steps):
        for mb in range(mbs):
            x = torch.randn(shape, device="cuda", dtype=BF16, generator=gen).requires_grad_(True)
            kw = {"is_first_microbatch": mb == 0} if caching else {}
            with te.fp8_autocast(enabled=fp8, fp8_recipe=rec):
                y = x
                for m in mods:
                    y = m(y, **kw)
            seen.append(y.detach().clone())
            y.backward(torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen))
            seen.append(x.grad.clone())
        seen += [p.grad.clone() for p in params if p.grad is not None]
        if capture_step and step == 1:  # step 0 ran eagerly: state exists, kernels compiled
            step_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step_graph):
                opt.step()
        if step_graph is not None:
            step_graph.replay()
        else:
            opt.step()
        opt.zero_grad(set_to_none=optimizer == "sgd")
        seen += [p.detach().clone() for p in params] + fp8_state(mods)
    torch.cuda.synchronize()
    return seen


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"tensor {i}: {g.shape} vs {w.shape}"
        assert torch.equal(g, w), (f"tensor {i} differs: max |diff| "
                                   f"{(g.float() - w.float()).abs().max().item():.3e}")


@pytest.fixture
def det_attention(setenv):
    setenv("TRITIUM_ATTN_BACKEND", "torch")


# ------------------------------------------------------------------ the seed scenario
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", ["torch", "tritium"])
def test_seed_scenario_grad_is_one_every_step(kind, set_to_none):
    lin = (torch.nn.Linear(1, 1, bias=False, device="cuda") if kind == "torch"
           else te.Linear(1, 1, bias=False, params_dtype=torch.float32))
    with torch.no_grad():
        lin.weight.fill_(1.0)
    g = make_graphed_callables(lin, (torch.ones(1, 1, device="cuda"),))
    assert lin.weight.grad is not None and not lin.weight.grad.any()  # created before capture
    first = lin.weight.grad
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    for _ in range(3):
        g(torch.ones(1, 1, device="cuda")).sum().backward()
        assert lin.weight.grad.item() == 1.0
        if not set_to_none:
            assert lin.weight.grad is first  # the tensor the optimizer sees, never replaced
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def test_grads_accumulate_over_micro_batches():
    lin = torch.nn.Linear(1, 1, bias=False, device="cuda")
    with torch.no_grad():
        lin.weight.fill_(1.0)
    g = make_graphed_callables(lin, (torch.ones(1, 1, device="cuda"),))
    for step in range(2):
        for mb in range(3):
            g(torch.full((1, 1), 2.0, device="cuda")).sum().backward()
            assert lin.weight.grad.item() == 2.0 * (mb + 1)
        lin.zero_grad(set_to_none=step == 0)


# ------------------------------------------------------------------ graphed == eager
CASES = [(False, False), pytest.param(True, False, marks=needs_fp8),
         pytest.param(True, True, marks=needs_fp8)]


@pytest.mark.parametrize("fp8,caching", CASES, ids=["bf16", "fp8", "fp8-cached"])
@pytest.mark.parametrize("name", list(MODELS))
def test_graphed_equals_eager(name, fp8, caching, det_attention, _seed):
    shape = MODELS[name][1]
    eager_mods, graph_mods = _build(name, _seed), _build(name, _seed)
    for a, b in zip(eager_mods, graph_mods):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    eager = train(eager_mods, shape, graph=False, fp8=fp8, caching=caching, seed=_seed)
    graphed = train(graph_mods, shape, graph=True, fp8=fp8, caching=caching, seed=_seed)
    assert_same(graphed, eager)
    if fp8:  # the scales moved away from 1: the updates ran
        assert any(s.ne(1).any() for s in fp8_state(graph_mods)[0::2])


@needs_fp8
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "cached"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "TransformerLayer x3"])
def test_graphed_equals_eager_float8_block_scaling(name, caching, det_attention, _seed):
    """Float8BlockScaling's kernels (block casts, block GEMM) captured and replayed: the same bits
    as eager; with weight caching the graph re-quantizes the weights at each replay."""
    shape, rec = MODELS[name][1], recipe.Float8BlockScaling()
    eager = train(_build(name, _seed), shape, graph=False, fp8=True, caching=caching,
                  seed=_seed, rec=rec)
    graphed = train(_build(name, _seed), shape, graph=True, fp8=True, caching=caching,
                    seed=_seed, rec=rec)
    assert_same(graphed, eager)


@needs_fp8
def test_weight_caching_skips_the_cast():
    """After a non-first micro-batch the weight slots' pending amax is 0: the captured cast
    did not run (the flag made it a device-side no-op)."""
    torch.manual_seed(0)
    lin = te.Linear(H, 48, params_dtype=BF16)
    x = torch.randn(64, H, device="cuda", dtype=BF16)
    g = make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=_recipe(),
                               fp8_weight_caching=True)
    hist = lin.fp8_meta.fwd.amax_history
    with torch.no_grad():  # no update at the exit: row 0 stays readable
        with te.fp8_autocast(fp8_recipe=_recipe()):
            g(x, is_first_microbatch=True)
        assert hist[0, 1].item() == lin.weight.abs().max().float().item()
        hist[0].zero_()
        with te.fp8_autocast(fp8_recipe=_recipe()):
            g(x, is_first_microbatch=False)
        assert hist[0, 1].item() == 0.0 and hist[0, 0].item() > 0


@needs_fp8
def test_main_grad(_seed):
    def build():
        torch.manual_seed(_seed)
        m = te.Linear(H, 48, params_dtype=BF16, fuse_wgrad_accumulation=True)
        m.weight.main_grad = torch.zeros(m.weight.shape, device="cuda", dtype=torch.float32)
        return (m,)
    results = []
    for graph in (False, True):
        mods = build()
        seen = train(mods, (SEQ * BATCH, H), graph=graph, fp8=True, caching=True, seed=_seed)
        results.append(seen + [mods[0].weight.main_grad.clone()])
        assert mods[0].weight.grad is None
    assert_same(results[1], results[0])
    assert results[1][-1].abs().sum() > 0


@needs_fp8
@pytest.mark.parametrize("name", ["LayerNormMLP", "TransformerLayer x3"])
def test_whole_step_graphed_with_capturable_fused_adam(name, det_attention, _seed):
    """Forward+backward by make_graphed_callables, the optimizer step captured by the user:
    bit-identical to the same FusedAdam(capturable=True) run eagerly."""
    shape = MODELS[name][1]
    eager = train(_build(name, _seed), shape, graph=False, fp8=True, caching=True, seed=_seed,
                  optimizer="adam")
    graphed = train(_build(name, _seed), shape, graph=True, fp8=True, caching=True, seed=_seed,
                    optimizer="adam", capture_step=True)
    assert_same(graphed, eager)


@needs_fp8
def test_default_attention_backend(_seed):
    """cuDNN / flash attention inside the graphs: captured and replayed (at bf16 tolerance:
    their backward may not be bitwise reproducible)."""
    shape = MODELS["TransformerLayer x3"][1]
    eager = train(_build("TransformerLayer x3", _seed), shape, graph=False, fp8=True,
                  caching=True, seed=_seed)
    graphed = train(_build("TransformerLayer x3", _seed), shape, graph=True, fp8=True,
                    caching=True, seed=_seed)
    for g, w in zip(graphed, eager):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.125, atol=0.0675)


@needs_fp8
@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_graphed_equals_eager_with_fp8_attention(flag, det_attention, _seed):
    """FP8 attention (the emulation here: det_attention forces the torch backends) graphed:
    its q/k/v and output states exist before warm-up and are restored after it, so the
    graphed run equals eager bit for bit, the attention states included."""
    shape = MODELS["MultiheadAttention"][1]
    rec = recipe.DelayedScaling(amax_history_len=8, amax_compute_algo="max", **{flag: True})
    mods = [_build("MultiheadAttention", _seed) for _ in range(2)]   # each a 1-tuple
    eager = train(mods[0], shape, graph=False, fp8=True, caching=False, seed=_seed, rec=rec)
    graphed = train(mods[1], shape, graph=True, fp8=True, caching=False, seed=_seed, rec=rec)
    assert_same(graphed, eager)
    eager_attn, graphed_attn = (m[0].core_attention for m in mods)
    assert (graphed_attn.fp8_out_state is None) == (flag == "fp8_dpa")
    for attr in ("fp8_attn_state", "fp8_out_state"):
        a, b = getattr(eager_attn, attr), getattr(graphed_attn, attr)
        if b is not None:
            assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
            assert b.scale.ne(1).any()   # the updates ran
