"""The FP8 backward in blocks (large out_features) computes what the one-pass backward does.

`backward_blocks` picks the block count from the shapes; here it is forced, so small layers
take the blocked path, and the gradients are compared with the one-pass path on the same data
and scales, for delayed and current scaling, with token counts that need padding.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import tritium as te
from tritium import recipe

pytestmark = pytest.mark.cpu
fl = importlib.import_module("tritium.functional.linear")


def test_block_rule_splits_only_large_out_features():
    assert fl.backward_blocks(8192, 4096, 4096) == 1
    assert fl.backward_blocks(16384, 8192, 8192) == 1
    assert fl.backward_blocks(8192, 4096, 14336) == 4
    # small layers run in one pass: their blocks would save at most ONE_PASS_SLACK bytes
    assert fl.backward_blocks(256, 512, 1536) == 1  # bench_graphs' qkv: 1.3 MB more
    t, k = 1024, 1024
    n_max = (3 * t * k + fl.ONE_PASS_SLACK) // (k + 2 * t)  # the largest one-pass N
    assert fl.backward_blocks(t, k, n_max) == 1
    assert fl.backward_blocks(t, k, n_max + 1) == -(-(n_max + 1) // k) > 1
    assert fl._blocks(33, 4) == [(0, 16), (16, 32), (32, 33)]
    assert fl._blocks(14336, 4)[-1] == (10752, 14336)


def _grads(monkeypatch, parts, rec, tokens, seed):
    monkeypatch.setattr(fl, "backward_blocks", lambda t, k, n: parts)
    torch.manual_seed(seed)
    lin = te.Linear(48, 80, device="cpu")
    x = torch.randn(tokens, 48, requires_grad=True)
    dy = torch.randn(tokens, 80)
    for _ in range(2):  # second step runs with non-trivial delayed scales
        x.grad = lin.weight.grad = lin.bias.grad = None
        with te.fp8_autocast(fp8_recipe=rec):
            y = lin(x)
        y.backward(dy)
    return x.grad, lin.weight.grad, lin.bias.grad


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(amax_history_len=4),
                                 recipe.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("tokens", [40, 33])
@pytest.mark.parametrize("parts", [2, 3])
def test_blocked_backward_matches_one_pass(monkeypatch, rec, tokens, parts):
    one = _grads(monkeypatch, 1, rec, tokens, seed=tokens)
    blocked = _grads(monkeypatch, parts, rec, tokens, seed=tokens)
    for a, b in zip(one, blocked):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_backward_frees_wgrad_operands_before_dgrad(monkeypatch):
    """The one-pass backward runs wgrad first; by the dgrad GEMM, dy8^T and x8^T must be gone
    (that is what keeps the FP8 peak memory at bf16's)."""
    import weakref
    real, seen = fl.fp8_gemm_tn, []

    def spy(a, b, *args, **kwargs):
        alive = [r() is not None for r in seen]
        seen.extend([weakref.ref(a), weakref.ref(b)])
        spy.alive_at_call.append(alive)
        return real(a, b, *args, **kwargs)
    spy.alive_at_call = []
    lin = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with te.fp8_autocast():
        y = lin(x)
    monkeypatch.setattr(fl, "fp8_gemm_tn", spy)
    y.backward(torch.randn(16, 32))
    wgrad_then_dgrad = spy.alive_at_call
    assert len(wgrad_then_dgrad) == 2
    assert wgrad_then_dgrad[1] == [False, False]  # dy8^T and x8^T freed before dgrad
