"""cpu tier: every torch.distributed collective of one training step of a tensor- and
sequence-parallel converted Llama, bf16 against FP8 (issues 18 and 24).

Two gloo processes, spawned once; the TP group is the world. The model: a tiny HF
LlamaForCausalLM (bf16, GQA, L = 2 layers) converted with sequence_parallel=True, each decoder
layer optionally recomputed in backward with te.distributed.checkpoint (reentrant, TE's
default). A step: forward with labels (the fused loss), backward. The second step of each run
is counted (the first makes states and caches) by examples/train_fsdp.py's CollectiveLog: kind,
group, dtype and bytes sent by this rank of every collective, in issue order. What the design
says a step issues, from the model's structure (docs/distributed.md, "Collectives per step"):
  * all-gathers over TP: per layer the inputs of its two column-parallel GEMMs (QKV, fc1) in
    forward, again in the recompute, and the grads of its two row-parallel GEMMs (proj, fc2) in
    backward; plus the model's: the last layer's output (again in its recompute: the gather
    is inside the checkpointed layer) and the first layer's input grad;
  * reduce-scatters over TP: per layer the outputs of proj and fc2 (forward, recompute) and the
    dgrads of QKV and fc1 (backward);
  * all-reduces over TP: per layer the grads of its two norm weights (replicated params used on
    this rank's rows);
  * FP8 DelayedScaling adds exactly two fp32 all-reduces per step over the amax group (all
    forward amaxes in one at the autocast exit, all backward amaxes in one after the last
    module's backward), none per module and none in the recompute; its layer all-gathers move
    fp8 bytes, half of bf16's, and the other collectives move what bf16's move;
  * Float8CurrentScaling adds one fp32 [1] all-reduce (the amax) per sequence-parallel gather.
Both ranks issue the same collectives in the same order (a mismatch would hang NCCL or make it
wait), and none of tritium's code calls a host-syncing tensor method (item, tolist, bool, ...)
during the step.
"""
from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch

from testlib import gloo_group, spawn_results

pytestmark = pytest.mark.cpu

WORLD, LAYERS, SEQ = 2, 2, 32
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 64, 64
SEED = zlib.crc32(b"test_tp_collectives")
RUNS = [(rcp, recompute) for rcp in ("bf16", "delayed", "current") for recompute in (False, True)]


def _model():
    import transformers
    from tritium.integrations.hf import convert_llama
    import torch.distributed as dist
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return convert_llama(model, tp_group=dist.group.WORLD, sequence_parallel=True)


def _recompute(model) -> None:
    from tritium.distributed import checkpoint
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=True, **k))(
            forward)


def _collective_log():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    from train_fsdp import CollectiveLog
    return CollectiveLog()


def _step(model, ids, rcp):
    import tritium as te
    ctx = te.fp8_autocast(fp8_recipe=rcp) if rcp is not None else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    from tritium import recipe
    with gloo_group(rank, WORLD, port):
        recipes = {"bf16": None, "delayed": recipe.DelayedScaling(),
                   "current": recipe.Float8CurrentScaling()}
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(SEED))
        res = {}
        with _collective_log() as rec:
            for name, recompute in RUNS:
                model = _model()
                if recompute:
                    _recompute(model)
                _step(model, ids, recipes[name])
                rec.log, rec.syncs, rec.on = [], [], True
                _step(model, ids, recipes[name])
                rec.on = False
                res[(name, recompute)] = (rec.log, rec.syncs)
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, res)
        if rank == 0:
            torch.save(everyone, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("tp_collectives"))


def _summary(log, kind, dtype=None):
    """(count, bytes) of the collectives of `kind` (and `dtype`) in a step's log."""
    hits = [n for k, _, d, n in log if k == kind and (dtype is None or d == dtype)]
    return len(hits), sum(hits)


TP = (0, 1)


def _model_gathers(recompute: bool) -> int:
    """The model's own all-gathers: the last layer's output (inside the layer, so a recompute
    gathers it again) and the first layer's input grad."""
    return 3 if recompute else 2


def _expected(recompute: bool) -> dict:
    """Counts per step from the model's structure (module note)."""
    passes = 2 if recompute else 1           # forwards per step of each layer
    return {"all_gather": LAYERS * 2 * passes + LAYERS * 2 + _model_gathers(recompute),
            "reduce_scatter": LAYERS * 2 * passes + LAYERS * 2,
            "all_reduce": LAYERS * 2}


@pytest.mark.parametrize("recompute", [False, True])
def test_bf16_collectives_are_the_design(results, recompute):
    log, _ = results[0][("bf16", recompute)]
    want = _expected(recompute)
    for kind, count in want.items():
        assert _summary(log, kind)[0] == count, (kind, log)
    assert all(ranks == TP and dtype == torch.bfloat16 for _, ranks, dtype, _ in log), log
    assert {k for k, *_ in log} == set(want)


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_delayed_moves_fewer_bytes_and_two_amax_reductions(results, recompute):
    bf16, _ = results[0][("bf16", recompute)]
    fp8, _ = results[0][("delayed", recompute)]
    want = _expected(recompute)
    # the same gathers, in fp8 bytes (uint8 on the wire) where they feed an FP8 GEMM
    n_bf16, bytes_bf16 = _summary(bf16, "all_gather")
    n_fp8, bytes_fp8 = _summary(fp8, "all_gather", torch.uint8)
    n_model, bytes_model = _summary(fp8, "all_gather", torch.bfloat16)
    assert n_fp8 + n_model == n_bf16 == want["all_gather"]
    assert n_model == _model_gathers(recompute)
    layer_bytes_bf16 = bytes_bf16 - bytes_model   # the model's two gathers are the same in both
    assert bytes_fp8 * 2 == layer_bytes_bf16 > 0
    # reduce-scatters and the norm-grad all-reduces: identical
    assert [e for e in fp8 if e[0] == "reduce_scatter"] == \
        [e for e in bf16 if e[0] == "reduce_scatter"]
    assert [e for e in fp8 if e[0] == "all_reduce" and e[2] == torch.bfloat16] == \
        [e for e in bf16 if e[0] == "all_reduce"]
    # amaxes: one fp32 all-reduce per direction per step, over the amax group (the world),
    # each holding every module's slots: 2 layers x (QKV, proj: 2 fwd slots, 1 bwd; MLP: 4, 2)
    amax = [e for e in fp8 if e[0] == "all_reduce" and e[2] == torch.float32]
    assert [(ranks, n // 4) for _, ranks, _, n in amax] == [(TP, LAYERS * 8), (TP, LAYERS * 4)]
    assert _summary(fp8, "all_reduce")[0] == want["all_reduce"] + 2


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_current_one_amax_reduction_per_gather(results, recompute):
    bf16, _ = results[0][("bf16", recompute)]
    fp8, _ = results[0][("current", recompute)]
    n_gathers = _summary(fp8, "all_gather", torch.uint8)[0]
    assert n_gathers == _expected(recompute)["all_gather"] - _model_gathers(recompute)
    assert _summary(fp8, "all_reduce", torch.float32) == (n_gathers, 4 * n_gathers)
    assert _summary(fp8, "reduce_scatter") == _summary(bf16, "reduce_scatter")
    assert _summary(fp8, "all_gather")[1] < _summary(bf16, "all_gather")[1]


@pytest.mark.parametrize("run", RUNS, ids=[f"{n}-{'recompute' if r else 'plain'}"
                                           for n, r in RUNS])
def test_ranks_issue_the_same_collectives_and_no_host_sync(results, run):
    logs = [res[run][0] for res in results]
    assert logs[0] and all(log == logs[0] for log in logs[1:])
    assert all(res[run][1] == [] for res in results), [res[run][1] for res in results]
