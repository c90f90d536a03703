"""Amax reduction over 2 gloo processes: ranks that see different data end up with the same
forward and backward scales (and amax histories) when the recipe reduces amaxes, and with
different ones when it does not. Also: the reduction is one MAX all-reduce per update."""
from __future__ import annotations

import os

import pytest
import torch

from testlib import free_port, gloo_group, spawn
import torch.distributed as dist

pytestmark = pytest.mark.cpu

WORLD = 2


def _step_data(seed: int, rank: int, step: int):
    """(x [9, 32], dy [9, 16]): different per rank, the same per (rank, step) in every run;
    rank 1's data is larger on even steps, rank 0's on odd steps."""
    big = (step + rank) % 2 == 1
    gen = torch.Generator().manual_seed(seed + 1 + 100 * rank + step)
    x = torch.randn(9, 32, generator=gen) * (4.0 if big else 1.0)
    dy = torch.randn(9, 16, generator=gen) * (3.0 if big else 0.5)
    return x, dy


def _worker(rank: int, port: int, out_dir: str, seed: int):
    with gloo_group(rank, WORLD, port):
        import tritium as te
        from tritium import recipe

        torch.manual_seed(seed)                      # same weights on both ranks
        model = torch.nn.Sequential(te.Linear(32, 48, device="cpu"),
                                    te.Linear(48, 16, device="cpu"))
        calls = []
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            calls.append(tuple(tensor.shape))
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        results = {}
        for reduce in (True, False):
            rcp = recipe.DelayedScaling(amax_history_len=4, reduce_amax=reduce)
            for m in model:
                m.fp8_meta = type(m.fp8_meta)(2, 1)              # fresh state per recipe
            calls.clear()
            for step in range(3):
                x, dy = _step_data(seed, rank, step)
                with te.fp8_autocast(fp8_recipe=rcp):
                    y = model(x.requires_grad_())
                y.backward(dy)
            results[reduce] = {
                "calls": list(calls),
                **{f"{i}.{d}.{k}": getattr(getattr(m.fp8_meta, d), k).clone()
                   for i, m in enumerate(model) for d in ("fwd", "bwd")
                   for k in ("scale", "amax_history")}}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_amax_reduction_two_ranks(tmp_path, _seed):
    spawn(_worker, WORLD, free_port(), str(tmp_path), _seed)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    keys = [k for k in r0[True] if k != "calls"]
    for k in keys:
        # With reduction: identical on both ranks (bitwise), and not the initial 1.0 scales.
        assert torch.equal(r0[True][k], r1[True][k]), k
        # Without: each rank follows its own data.
        assert not torch.equal(r0[False][k], r1[False][k]), k
    for k in keys:
        if k.endswith("scale"):
            assert not bool((r0[True][k] == 1.0).any()), k
    # The amaxes that do not depend on the scales (module 0's input and weight, module 1's
    # grad_output, all given by the test): the reduced history is the elementwise max of the
    # two ranks' own histories, and so its scales are the smaller of the two ranks' scales.
    for k in ("0.fwd", "1.bwd"):
        own = torch.maximum(r0[False][f"{k}.amax_history"], r1[False][f"{k}.amax_history"])
        assert torch.equal(r0[True][f"{k}.amax_history"], own), k
        assert torch.equal(r0[True][f"{k}.scale"],
                           torch.minimum(r0[False][f"{k}.scale"], r1[False][f"{k}.scale"])), k
    # One collective per update: 3 steps x (forward + backward), each covering all states:
    # forward = 2 modules x 2 slots, backward = 2 modules x 1 slot.
    assert r0[True]["calls"] == [(4,), (2,)] * 3
    assert r0[False]["calls"] == []


def _compiled_worker(rank: int, port: int, out_dir: str, seed: int):
    """The same two-Linear model, eager and under torch.compile (the backward amaxes reduced
    inside the compiled backward, per module): the states must agree bit for bit."""
    with gloo_group(rank, WORLD, port):
        import copy

        import tritium as te
        from tritium import recipe

        torch.manual_seed(seed)
        eager = torch.nn.Sequential(te.Linear(32, 48, device="cpu"),
                                    te.Linear(48, 16, device="cpu"))
        compiled_model = copy.deepcopy(eager)
        rcp = recipe.DelayedScaling(amax_history_len=4, reduce_amax=True)
        te.prepare_fp8(compiled_model, rcp)
        compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
        states = {}
        for name, model, fn in (("eager", eager, eager), ("compiled", compiled_model, compiled)):
            for step in range(3):
                x, dy = _step_data(seed, rank, step)
                with te.fp8_autocast(fp8_recipe=rcp):
                    y = fn(x.requires_grad_())
                y.backward(dy)
            states[name] = [getattr(getattr(m.fp8_meta, d), k).clone() for m in model
                            for d in ("fwd", "bwd") for k in ("scale", "amax_history")]
        torch.save(states, os.path.join(out_dir, f"rank{rank}.pt"))


def test_amax_reduction_compiled_two_ranks(tmp_path, _seed):
    spawn(_compiled_worker, WORLD, free_port(), str(tmp_path), _seed)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for i, (a, b, c) in enumerate(zip(r0["eager"], r0["compiled"], r1["compiled"])):
        assert torch.equal(a, b), f"state tensor {i}: compiled != eager"
        assert torch.equal(b, c), f"state tensor {i}: the ranks differ"
