"""make_graphed_callables' TE keywords on the CPU, each with its effect checked, through the
eager emulation of CUDA graphs of tests/test_graphs.py (`emulated`): `_order` (captures in the
pipeline order, one graph per (chunk, microbatch, layer), training through them == eager bit
for bit), `_reuse_graph_input_output_buffers`, `pool`, `capture_time_hooks`,
`clone_param_grads_on_return`, and modules built under fp8_model_init (FP8 params)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tritium as te
from tritium import graphs, recipe
from tritium.graphs import make_graphed_callables
from tritium.optimizers import FusedAdam

from test_graphs import emulated  # noqa: F401  (the fixture)
from testlib import fp8_state

pytestmark = pytest.mark.cpu

H, T = 32, 16
ORDER = [1, 2, 1, 2, -2, -1, -2, -1]   # 2 chunks x 2 microbatches (Megatron's interleaving)
RECIPE = recipe.DelayedScaling(amax_history_len=4)


def _layers(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return (te.Linear(H, H, device=device), te.Linear(H, H, device=device))


def _samples(n, device="cpu"):
    return tuple((torch.randn(T, H, device=device, requires_grad=True),) for _ in range(n))


def _record(monkeypatch):
    """Record the capture steps (kind, entry index) and the grad-output buffers."""
    steps, buffers = [], []
    fwd, bwd = graphs._capture_forward, graphs._capture_backward

    def capture_forward(cap, pool):
        steps.append(("fwd", cap.index))
        return fwd(cap, pool)

    def capture_backward(cap, pool, retain, shared):
        steps.append(("bwd", cap.index))
        out = bwd(cap, pool, retain, shared)
        buffers.append(out)
        return out
    monkeypatch.setattr(graphs, "_capture_forward", capture_forward)
    monkeypatch.setattr(graphs, "_capture_backward", capture_backward)
    return steps, buffers


def test_order_captures_in_pipeline_order_and_returns_one_function_per_entry(emulated,
                                                                             monkeypatch):
    steps, _ = _record(monkeypatch)
    layers = _layers()
    fwd0 = layers[0].forward
    fns = make_graphed_callables(layers, _samples(4), _order=ORDER, num_warmup_iters=1)
    assert isinstance(fns, tuple) and len(fns) == 4 and all(callable(f) for f in fns)
    assert layers[0].forward == fwd0  # modules keep their forward (TE does the same)
    # entries: chunk 0 mb 0 -> 0, chunk 0 mb 1 -> 1, chunk 1 mb 0 -> 2, chunk 1 mb 1 -> 3
    assert steps == [("fwd", 0), ("fwd", 2), ("fwd", 1), ("fwd", 3),
                     ("bwd", 2), ("bwd", 0), ("bwd", 3), ("bwd", 1)]


def test_order_with_uneven_chunks(emulated, monkeypatch):
    steps, _ = _record(monkeypatch)
    torch.manual_seed(0)
    mods = tuple(te.Linear(H, H, device="cpu") for _ in range(3))
    fns = make_graphed_callables(mods, _samples(3), _order=[1, 2, -2, -1],
                                 _num_layers_per_chunk=[2, 1], num_warmup_iters=1)
    assert len(fns) == 3
    assert steps == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0)]
    for bad, match in (([1, -1, -1, 1], "before its forward"),
                       ([1, 1, 1, -1, 2, -2, -1, -1], "chunk 1 runs"),
                       ([1, 2, 2, -2, -1, -2], "2 x chunks")):
        with pytest.raises(ValueError, match=match):
            make_graphed_callables(mods, _samples(3), _order=bad, _num_layers_per_chunk=[2, 1])
    with pytest.raises(ValueError, match="_num_layers_per_chunk"):
        make_graphed_callables(mods, _samples(3), _order=[1, 2, -2, -1],
                               _num_layers_per_chunk=[1, 1])


def _train_pipeline(graph: bool, reuse: bool = False, steps: int = 2, device="cpu",
                    caching: bool = False):
    """Two chunks (one Linear each), two microbatches, the schedule of ORDER; returns what was
    observed. Graphed: one function per (chunk, microbatch). `caching`: FP8 weight caching
    (is_first_microbatch per microbatch)."""
    layers = _layers(device=device)
    if graph:
        fns = make_graphed_callables(layers, _samples(4, device), _order=ORDER, fp8_enabled=True,
                                     fp8_recipe=RECIPE, _reuse_graph_input_output_buffers=reuse,
                                     fp8_weight_caching=caching)
    else:
        fns = (layers[0], layers[0], layers[1], layers[1])
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    gen = torch.Generator().manual_seed(3)
    seen = []
    for _ in range(steps):
        xs = [torch.randn(T, H, generator=gen).to(device).requires_grad_(True) for _ in range(2)]
        hidden, outs, sent = [None] * 2, [None] * 2, [None] * 2
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            for c in ORDER[:4]:                       # +1 +2 +1 +2: forwards
                mb = 0 if (c == 1 and hidden[0] is None) or (c == 2 and outs[0] is None) else 1
                kw = {"is_first_microbatch": mb == 0} if caching else {}
                if c == 1:
                    hidden[mb] = fns[mb](xs[mb], **kw)
                    sent[mb] = hidden[mb].detach().requires_grad_(True)
                else:
                    outs[mb] = fns[2 + mb](sent[mb], **kw)
        for mb in range(2):                           # -2 -1 per microbatch
            outs[mb].backward(torch.randn(T, H, generator=gen).to(device))
            hidden[mb].backward(sent[mb].grad)
        seen += [o.detach().clone() for o in outs] + [x.grad.clone() for x in xs]
        seen += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
        seen += [p.detach().clone() for p in params] + fp8_state(layers)
    return seen


@pytest.mark.parametrize("reuse,caching", [(False, False), (True, False), (False, True)])
def test_order_trains_like_eager(emulated, reuse, caching):
    eager = _train_pipeline(False, caching=caching)
    graphed = _train_pipeline(True, reuse=reuse, caching=caching)
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_reuse_buffers_shares_grad_outputs_and_checks_shapes(emulated, monkeypatch):
    _, buffers = _record(monkeypatch)
    make_graphed_callables(_layers(), _samples(4), _order=ORDER, num_warmup_iters=1,
                           _reuse_graph_input_output_buffers=True)
    assert len(buffers) == 4 and all(b is buffers[0] for b in buffers)
    buffers.clear()
    make_graphed_callables(_layers(1), _samples(4), _order=ORDER, num_warmup_iters=1)
    assert len({id(b[0]) for b in buffers}) == 4   # without reuse: one set per capture
    torch.manual_seed(0)
    uneven = (te.Linear(H, H, device="cpu"), te.Linear(H, 48, device="cpu"))
    with pytest.raises(ValueError, match="one shape and dtype"):
        make_graphed_callables(uneven, _samples(4), _order=ORDER, num_warmup_iters=1,
                               _reuse_graph_input_output_buffers=True)
    with pytest.raises(ValueError, match="needs _order"):
        make_graphed_callables(_layers()[0], _samples(1)[0],
                               _reuse_graph_input_output_buffers=True)


def test_pool_is_used_for_every_capture(emulated, monkeypatch):
    pools = []
    monkeypatch.setattr(graphs._cuda, "capture",
                        lambda graph, pool: (pools.append(pool), contextlib.nullcontext())[1])
    handle = object()
    make_graphed_callables(_layers(), _samples(4), _order=ORDER, pool=handle, num_warmup_iters=1)
    assert len(pools) == 8 and all(p is handle for p in pools)
    pools.clear()
    make_graphed_callables(_layers()[0], _samples(1)[0], num_warmup_iters=1)
    assert len(pools) == 2 and pools[0] is None   # the emulation's own pool() handle


def test_capture_time_hooks_run_at_warmup_and_capture_only(emulated):
    calls = []
    layer = _layers()[0]
    hooks = [{"forward_pre_hooks": {0: lambda m, args: calls.append(("pre", m))},
              "forward_hooks": {0: lambda m, args, out: calls.append(("fwd", out.shape))},
              "backward_pre_hooks": {0: lambda m, gout: calls.append(("bpre", len(gout)))},
              "backward_hooks": {0: lambda m, gin, gout: calls.append(("bwd", len(gin)))}}]
    g = make_graphed_callables(layer, _samples(1)[0], num_warmup_iters=2,
                               capture_time_hooks=hooks)
    kinds = [c[0] for c in calls]
    assert kinds.count("pre") == 3 and kinds.count("fwd") == 3   # 2 warm-ups + the capture
    assert kinds.count("bpre") == 3 and kinds.count("bwd") == 3
    assert calls[0] == ("pre", layer) and ("fwd", torch.Size([T, H])) in calls
    n = len(calls)
    x = torch.randn(T, H, requires_grad=True)
    g(x).sum().backward()
    assert len(calls) == n   # never replayed
    bad = [{"forward_hooks": {0: lambda m, args, out: out * 2}}]
    with pytest.raises(ValueError, match="returned a value"):
        make_graphed_callables(_layers()[0], _samples(1)[0], capture_time_hooks=bad)
    with pytest.raises(ValueError, match="one entry"):
        make_graphed_callables(_layers()[0], _samples(1)[0], capture_time_hooks=[None, None])
    with pytest.raises(ValueError, match="keys among"):
        make_graphed_callables(_layers()[0], _samples(1)[0],
                               capture_time_hooks=[{"fwd_hooks": {}}])


@pytest.mark.parametrize("clone", [True, False])
def test_clone_param_grads_on_return(emulated, clone):
    layer = _layers()[0]
    g = make_graphed_callables(layer, _samples(1)[0], num_warmup_iters=1,
                               clone_param_grads_on_return=clone)
    seen = []
    layer.weight.register_hook(lambda grad: seen.append(grad))
    for _ in range(2):
        x = torch.randn(T, H, requires_grad=True)
        g(x).sum().backward()
    # the emulated replay differentiates the forward again, so the hook also fires inside it
    # (a real graph replay runs no autograd): keep the grads autograd got from the replay
    seen = seen[1::2]
    assert len(seen) == 2
    same = seen[0].data_ptr() == seen[1].data_ptr()
    assert same is (not clone)   # False: the static buffer itself, every replay
    want = torch.zeros_like(layer.weight.grad)
    assert not torch.equal(layer.weight.grad, want)
    with pytest.raises(TypeError, match="name the same setting"):
        make_graphed_callables(_layers()[0], _samples(1)[0], clone_param_grads_on_return=True,
                               _clone_param_grads_on_return=False)


def _fp8_param_training(graph: bool, steps=3, mbs=2, device="cpu"):
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=True, recipe=RECIPE):
        layer = te.Linear(H, H, device=device, params_dtype=torch.bfloat16)
    opt = FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    f = layer
    if graph:
        sample = torch.randn(T, H, device=device).bfloat16().requires_grad_(True)
        f = make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=RECIPE)
    gen = torch.Generator().manual_seed(5)
    seen = []
    for _ in range(steps):
        for _ in range(mbs):
            x = torch.randn(T, H, generator=gen).to(device).bfloat16().requires_grad_(True)
            with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
                y = f(x)
            y.float().pow(2).mean().backward()
            seen += [y.detach().clone(), x.grad.clone()]
        opt.step()
        opt.zero_grad()
        seen += [layer.weight._data.view(torch.uint8).clone(), layer.weight._scale_inv.clone()]
        seen += fp8_state([layer])
    return seen


def test_fp8_model_init_modules_graph(emulated):
    eager, graphed = _fp8_param_training(False), _fp8_param_training(True)
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_fp8_graph_capturing_is_true_while_graphing(emulated):
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = te.Linear(H, H, device="cpu")

        def forward(self, x):
            seen.append(te.FP8GlobalStateManager.fp8_graph_capturing())
            return self.lin(x)
    g = make_graphed_callables(Probe(), _samples(1)[0], num_warmup_iters=2)
    assert seen == [True, True, True]   # two warm-ups and the capture
    assert not te.FP8GlobalStateManager.fp8_graph_capturing()
    g(torch.randn(T, H, requires_grad=True))   # the emulated replay reruns forward: not graphing
    assert seen[-1] is False
