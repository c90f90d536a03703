"""cpu tier: the fp8 transpose of an FSDP2-gathered weight is made lazily (fp8/tensor.py).

  * FSDP2 over 2 gloo ranks, FP8 params (fp8_model_init) and high-precision weights gathered as
    FP8 (enable_fp8_all_gather): one fwd+bwd+step makes exactly one transpose per weight (it
    made two), with and without recompute (te.distributed.checkpoint, reentrant and not: each
    weight is gathered twice a step, as FSDP2 also does without recompute), and a no-grad forward
    makes none. Training with recompute equals training without it bit for bit (losses, input
    gradients, params) while the weights move every step, so each backward reads the transpose
    of the weights it gathered.
  * in process: a gather makes no transpose, its first reader fills FSDP's buffer, and a second
    gather of other weights into the same buffers (out=) leaves it stale, never read: dgrad
    through the gathered weight equals dgrad through the directly quantized weight.
"""
from __future__ import annotations

import collections
import contextlib
import functools

import pytest
import torch

from testlib import free_port, gloo_group, spawn

pytestmark = pytest.mark.cpu

H, F, G, OUT = 32, 64, 8, 48       # hidden, ffn, global batch rows, head outputs


def _entry(rank, world, port):
    with gloo_group(rank, world, port):
        _worker(rank, world)


@contextlib.contextmanager
def _transposes():
    """{shape of the data: count} of the transpose_fp8 calls inside (the CPU workers run the
    ref twins, TRITIUM_FORCE_REF=1)."""
    from tritium.ref import cast as ref_cast
    real, calls = ref_cast.transpose_fp8, collections.Counter()

    def counting(data, out=None):
        calls[tuple(data.shape)] += 1
        return real(data, out)
    ref_cast.transpose_fp8 = counting
    try:
        yield calls
    finally:
        ref_cast.transpose_fp8 = real


def _model(kind, recompute: str):
    import tritium as te
    from tritium import recipe
    from tritium.distributed import checkpoint, enable_fp8_all_gather
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(11)
    ctx = (te.fp8_model_init(recipe=recipe.DelayedScaling(amax_history_len=4))
           if kind == "fp8" else contextlib.nullcontext())
    with ctx:
        model = torch.nn.Sequential(
            te.LayerNormMLP(H, F, activation="swiglu", normalization="RMSNorm", device="cpu"),
            te.Linear(H, OUT, device="cpu"))
    if kind == "gather":
        enable_fp8_all_gather(model, recipe.DelayedScaling(amax_history_len=4))
    for layer in model:
        if recompute:   # as examples/train_fsdp.py: FSDP2's hooks outside the checkpoint
            layer.forward = functools.partial(checkpoint, layer.forward,
                                              use_reentrant=recompute == "reentrant")
        fully_shard(layer)
    fully_shard(model)
    return model


def _run(rank, world, kind, recompute, steps=3):
    """`steps` fwd+bwd+step on this rank's rows; (losses, input grads, params, transposes per
    step, transposes of a no-grad forward)."""
    import tritium as te
    from tritium import recipe
    rcp = recipe.DelayedScaling(amax_history_len=4)
    model = _model(kind, recompute)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    rows = slice(rank * G // world, (rank + 1) * G // world)
    losses, grads, per_step = [], [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(G, H, generator=gen)[rows].requires_grad_()
        t = torch.randn(G, OUT, generator=gen)[rows]
        with _transposes() as calls:
            with te.fp8_autocast(fp8_recipe=rcp):
                y = model(x)
            loss = ((y - t) ** 2).sum() / G
            loss.backward()
            opt.step()
            opt.zero_grad()
        per_step.append(dict(calls))
        losses.append(loss.detach())
        grads.append(x.grad)
    with _transposes() as calls, torch.no_grad():
        with te.fp8_autocast(fp8_recipe=rcp):
            model(torch.randn(G // world, H))
    return losses, grads, _local_params(model), per_step, dict(calls)


def _local_params(model):
    """This rank's shards of the params, in high precision."""
    from tritium.fp8.tensor import Float8Tensor
    out = []
    for p in model.parameters():
        local = p._local_tensor
        local = getattr(local, "_hp_shard", local)
        out.append(local.dequantize() if isinstance(local, Float8Tensor) else local.detach())
    return out


def _worker(rank, world):
    weights = {(2 * F, H): 1, (H, F): 1, (OUT, H): 1}
    for kind in ("fp8", "gather"):
        runs = {}
        for recompute in ("", "reentrant", "non-reentrant"):
            losses, grads, params, per_step, no_grad = _run(rank, world, kind, recompute)
            what = f"{kind} recompute={recompute}"
            assert all(s == weights for s in per_step), (what, per_step)
            assert no_grad == {}, (what, no_grad)
            runs[recompute] = losses, grads, params
        for recompute in ("reentrant", "non-reentrant"):
            for a, b in zip(runs[""], runs[recompute]):
                for u, v in zip(a, b):
                    assert torch.equal(u, v), (kind, recompute)
        init = _local_params(_model(kind, ""))
        assert not any(torch.equal(a, b) for a, b in zip(runs[""][2], init))   # all moved


def test_one_transpose_per_weight_per_step_under_fsdp2():
    spawn(_entry, 2, 2, free_port())


class _Mesh:
    def __init__(self, n):
        self.n = n

    def size(self, dim=None):
        return self.n


def _gathered_bytes(weight, world):
    """FSDP2's all-gather of `weight`'s shards, done in process: (outputs, metadata, a shard)."""
    shards = torch.chunk(weight.detach(), world, dim=0)
    inputs, metas = zip(*(s.fsdp_pre_all_gather(_Mesh(world), weight.shape) for s in shards))
    return (torch.cat([t[0] for t in inputs]),), metas[0], shards[0]


def test_gathered_transpose_is_made_by_its_first_reader_and_never_read_stale(randn):
    """Two FP8 Linears made alike: A keeps its FP8 param (eager transpose), B's weight is A's
    weight gathered as FSDP2 gathers it (fsdp_post_all_gather, its result wrapped in a Parameter
    as FSDP2's unsharded param). The gather makes no transpose, a no-grad forward none, B's
    backward one, into the buffer FSDP2 holds; then A's weight changes and is gathered again into
    the same buffers (out=): B's transpose is stale, and B's next dgrad and wgrad still equal A's
    bit for bit."""
    import tritium as te
    from tritium import recipe
    rcp = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_model_init(recipe=rcp):
        a, b = [te.Linear(32, 48, device="cpu") for _ in range(2)]
    b.load_state_dict(a.state_dict())
    outputs, meta, shard = _gathered_bytes(a.weight, 4)
    with _transposes() as calls:
        full, inner = shard.fsdp_post_all_gather(outputs, meta, torch.float32)
        b.weight = torch.nn.Parameter(full)
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=rcp):
            b(randn(16, 32))
    assert calls == {} and b.weight.lazy_transpose and full._transpose is inner[1]
    buffer = inner[1].data_ptr()
    for step in range(2):
        if step:   # A's weight changes; B's buffers get its new bytes (FSDP2's later gathers)
            with torch.no_grad():
                a.weight.copy_(randn(48, 32))
            new, meta, shard = _gathered_bytes(a.weight, 4)
            outputs[0].copy_(new[0])
            with _transposes() as calls:
                assert shard.fsdp_post_all_gather(outputs, meta, torch.float32,
                                                  out=b.weight) is None
            assert calls == {}
        x, dy = randn(16, 32), randn(16, 48)
        grads = []
        for lin in (a, b):
            xi = x.clone().requires_grad_()
            with _transposes() as calls:
                with te.fp8_autocast(fp8_recipe=rcp):
                    y = lin(xi)
                y.backward(dy)
            grads.append((y, xi.grad, lin.weight.grad))
            lin.weight.grad = None
        assert calls == {(48, 32): 1}, (step, calls)    # B's: made in backward, once
        assert inner[1].data_ptr() == buffer
        for u, v in zip(*grads):
            assert torch.equal(u, v), step
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(b.weight.transpose_data()), bits(a.weight._data.t()))
