"""cpu tier: FSDP2 x tensor/sequence parallelism on a 2D DeviceMesh, the converted HF Llama.

Four gloo processes on a ("dp", "tp") = (2, 2) mesh, spawned once; every check runs in them and
rank 0 leaves the results in a tmp file. The model: a tiny HF LlamaForCausalLM (GQA, 2 layers,
fp32), built alike on every rank from one seed, converted with tp_group=mesh["tp"] and
sequence_parallel=True (each rank loads its shards), fully_shard per decoder layer and at the
root over mesh["dp"]; FusedAdam with fp32 master weights. The two TP ranks of a dp group get
the same rows of each global batch, the two dp groups different rows. Each dp rank's loss is
its tokens' sum over the global batch's token count and FSDP sums the gradients (as in
test_fsdp.py), so every activation gradient is the one-process run's value: FP8 casts of
gradients then see the same values (a mean over local rows would double them, and with them
the amaxes and the scales).
  * fp32, 3 steps: the losses and the final weights (dp shards and TP shards gathered) equal
    the same model trained on one process on the whole global batches, at FP32 tolerance
    (rtol 1.3e-6, atol 1e-5): the math is the same, only summation orders differ (row-parallel
    GEMMs sum half of K and then the two halves, FSDP sums two gradients, the loss two
    partial sums), i.e. rounding at fp32 epsilon of the values; the largest weight move is
    3 * lr = 3e-3, so a wrong gradient of any Adam step shows far above atol. Replicated
    parameters (embedding, norms, lm_head, the layers' norm weights) end bit-identical on the
    two TP ranks. Negative control, by hand: a reduce-scatter in the backward of the gather
    after the last layer (instead of keeping the rank's chunk) fails both training tests.
  * FP8 (emulated, DelayedScaling, fp8_group = the world), 2 steps: every module's scales and
    amax histories, and the losses, equal the one-process FP8 run at FP32 tolerance. The
    amaxes are MAX-reduced over every rank, so both runs cast with the same scales (step 1:
    the initial ones; step 2: from the same amax history); the casts then see values that
    differ by fp32 rounding only, and none of them crosses an FP8 rounding boundary here.
  * misconfiguration: a TP size that does not divide the KV heads, the heads or
    intermediate_size raises ValueError naming the config field, before any collective runs
    and before any layer is replaced.
"""
from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch

from testlib import FP32_TOL, fp8_states, gloo_group, spawn_results

pytestmark = pytest.mark.cpu

WORLD, DP, TP = 4, 2, 2
ROWS, SEQ, VOCAB = 2, 32, 64       # global batch rows (1 per dp rank), sequence, vocabulary
TOKENS = ROWS * (SEQ - 1)         # labelled tokens of a global batch (the loss divides by it)
LR = 1e-3
CLIP = 0.05                       # below every step's grad norm here: the clip acts each step
SEED = zlib.crc32(b"test_fsdp_tp")


def _config(**overrides):
    import transformers
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def _hf_model():
    import transformers
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(_config()).float()


def _batch(step: int, dp_rank=None):
    """Step `step`'s global batch, or dp rank `dp_rank`'s rows of it."""
    gen = torch.Generator().manual_seed(SEED + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    if dp_rank is None:
        return ids
    per = ROWS // DP
    return ids[dp_rank * per:(dp_rank + 1) * per]


def _train(model, steps: int, dp_rank=None, rcp=None, fp8_group=None, clip=None, norms=None):
    """Losses of `steps` steps; with `clip`, tritium.distributed.clip_grad_norm_ before each
    optimizer step, its norms appended to `norms`."""
    import tritium as te
    from tritium.distributed import clip_grad_norm_
    opt = te.optimizers.FusedAdam(model.parameters(), lr=LR, master_weights=True)
    losses = []
    for step in range(steps):
        ids = _batch(step, dp_rank)
        ctx = (te.fp8_autocast(fp8_recipe=rcp, fp8_group=fp8_group) if rcp is not None
               else contextlib.nullcontext())
        with ctx:
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=TOKENS).loss
        loss.backward()
        if clip is not None:   # the norm before the clip, then after it (max_norm inf: no-op)
            norms.append(torch.stack([clip_grad_norm_(model, clip),
                                      clip_grad_norm_(model, float("inf"))]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _sharded(mesh, rcp=None):
    from torch.distributed.fsdp import fully_shard
    from tritium.integrations.hf import convert_llama
    model = convert_llama(_hf_model(), tp_group=mesh["tp"], sequence_parallel=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for m in model.modules():   # summed gradients: each dp rank's loss is over the global batch
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)   # a plain SUM (gloo has no PREMUL_SUM)
    return model


def _global_losses(losses, mesh):
    """The sum over dp of the per-dp-rank losses (the TP ranks of a dp group agree: checked)."""
    import torch.distributed as dist
    tp_copies = [torch.empty_like(losses) for _ in range(TP)]
    dist.all_gather(tp_copies, losses, group=mesh["tp"].get_group())
    assert all(torch.equal(c, losses) for c in tp_copies), "TP ranks computed different losses"
    total = losses.clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    return total


def _replicated_identical(model, mesh, sharded_too: bool = False) -> list:
    """Names of the TP-replicated params (and TP shards with sharded_too) whose local dp shard
    differs between the TP ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from tritium.distributed.tensor_parallel import _sharded_params
    sharded, bad = _sharded_params(model), []
    for name, p in model.named_parameters():
        if name in sharded and not sharded_too:
            continue
        local = (p.to_local() if isinstance(p, DTensor) else p).detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(TP)]
        dist.all_gather(copies, local, group=mesh["tp"].get_group())
        if not all(torch.equal(c, local) for c in copies):
            bad.append(name)
    return bad


def _no_collectives():
    """A context that makes any torch.distributed collective raise (the error must come first)."""
    import torch.distributed as dist
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier",
             "reduce_scatter_tensor", "all_to_all_single", "new_group")
    stack = contextlib.ExitStack()
    for name in names:
        if hasattr(dist, name):
            def refuse(*a, _name=name, **k):
                raise AssertionError(f"collective {_name} ran before the error")
            stack.enter_context(_patched(dist, name, refuse))
    return stack


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _errors(mesh) -> dict:
    import transformers
    from tritium.integrations.hf import TritiumLlamaDecoderLayer, convert_llama
    out = {}
    for label, over in (("kv-heads", dict(num_key_value_heads=1)),
                        ("heads", dict(hidden_size=24, num_attention_heads=3,
                                       num_key_value_heads=3)),
                        ("ffn", dict(intermediate_size=66 + 1))):
        model = transformers.LlamaForCausalLM(_config(**over))
        try:
            with _no_collectives():
                convert_llama(model, tp_group=mesh["tp"], sequence_parallel=True)
            out[label] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the kind is the result
            out[label] = (type(e).__name__, str(e))
        out[label + "-untouched"] = not any(isinstance(m, TritiumLlamaDecoderLayer)
                                            for m in model.model.layers)
    return out


def _meta_build(mesh) -> tuple:
    """examples/train_fsdp.py's build() on the 2D mesh (meta device, to_empty, each rank
    initializes its shards): (params equal on the two TP ranks, params that differ)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import train_fsdp
    model, _ = train_fsdp.build("tiny", torch.device("cpu"), dtype=torch.float32, mesh=mesh)
    bad = _replicated_identical(model, mesh, sharded_too=True)
    names = [n for n, _ in model.named_parameters()]
    return [n for n in names if n not in bad], bad


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tritium import recipe
    from tritium.distributed.tensor_parallel import gather_full_state_dict
    from tritium.integrations.hf import convert_llama
    with gloo_group(rank, WORLD, port):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        res = {"errors": _errors(mesh), "meta_build": _meta_build(mesh)}
        # fp32: 3 steps
        model = _sharded(mesh)
        losses = _global_losses(_train(model, 3, dp_rank), mesh)
        res["replicated_differ"] = _replicated_identical(model, mesh)
        full = {k: v for k, v in gather_full_state_dict(model).items()
                if not k.endswith("_extra_state")}
        # fp32, 3 steps with the grad-norm clip active (CLIP is below every step's norm)
        clipped, norms = _sharded(mesh), []
        clip_losses = _global_losses(_train(clipped, 3, dp_rank, clip=CLIP, norms=norms), mesh)
        res["clip_replicated_differ"] = _replicated_identical(clipped, mesh, sharded_too=False)
        # FP8: 2 steps, amaxes reduced over the world
        rcp = recipe.DelayedScaling()
        fp8_model = _sharded(mesh)
        fp8_losses = _global_losses(_train(fp8_model, 2, dp_rank, rcp, dist.group.WORLD), mesh)
        solo = dist.new_group([0])   # the one-process FP8 run's amax group (no other rank)
        if rank == 0:   # the one-process runs, on the whole global batches
            ref = convert_llama(_hf_model())
            res["losses"], res["ref_losses"] = losses, _train(ref, 3)
            res["weights"] = full
            res["ref_weights"] = {k: v for k, v in ref.state_dict().items()
                                  if not k.endswith("_extra_state")}
            res["fp8_losses"] = fp8_losses
            res["clip_losses"], res["clip_norms"] = clip_losses, torch.stack(norms)
            ref, ref_norms = convert_llama(_hf_model()), []
            res["ref_clip_losses"] = _train(ref, 3, clip=CLIP, norms=ref_norms)
            res["ref_clip_norms"] = torch.stack(ref_norms)
            ref = convert_llama(_hf_model())
            res["ref_fp8_losses"] = _train(ref, 2, rcp=rcp, fp8_group=solo)
            res["fp8_states"], res["ref_fp8_states"] = fp8_states(fp8_model), fp8_states(ref)
            torch.save(res, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("fsdp_tp"))


def test_fp32_training_equals_one_process(results):
    torch.testing.assert_close(results["losses"], results["ref_losses"], **FP32_TOL)
    got, want = results["weights"], results["ref_weights"]
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], **FP32_TOL, msg=lambda m: f"{key}: {m}")
    # the run trained: every weight moved away from the shared initial model
    init = _init_state()
    assert all(not torch.equal(want[key], init[key]) for key in want)


def test_clip_grad_norm_equals_one_process(results):
    """tritium.distributed.clip_grad_norm_ on the dp2 x tp2 model: every step's norm (TP shards
    summed over the TP group, replicated parameters once, FSDP shards over dp) equals the
    one-process model's at FP32 tolerance, the clip acts (norm > CLIP) and leaves the global
    norm at CLIP, training with it equals one process, and the replicated parameters stay
    identical on the TP ranks. (Adam all but ignores a uniform gradient scale, so the losses
    barely move with the clip: the norms are what this checks.)"""
    norms, ref = results["clip_norms"], results["ref_clip_norms"]   # [step, (before, after)]
    assert bool((ref[:, 0] > 2 * CLIP).all()), ref
    torch.testing.assert_close(norms, ref, **FP32_TOL)
    torch.testing.assert_close(norms[:, 1], torch.full((3,), CLIP), rtol=1e-5, atol=0)
    torch.testing.assert_close(results["clip_losses"], results["ref_clip_losses"], **FP32_TOL)
    assert results["clip_replicated_differ"] == []


def _init_state():
    from tritium.integrations.hf import convert_llama
    return {k: v for k, v in convert_llama(_hf_model()).state_dict().items()
            if not k.endswith("_extra_state")}


def test_replicated_params_identical_on_tp_ranks(results):
    assert results["replicated_differ"] == []


def test_meta_build_initializes_each_tp_shard(results):
    """train_fsdp.build on the 2D mesh: replicated params equal on the TP ranks, every TP
    shard (QKV, proj, fc1, fc2 of each layer) different."""
    same, differ = results["meta_build"]
    assert sorted(differ) == sorted(n for n in same + differ
                                    if n.endswith(("layernorm_qkv.weight", "proj.weight",
                                                   "fc1_weight", "fc2_weight"))), differ
    assert len(differ) == 2 * 4 and "lm_head.weight" in same


def test_fp8_delayed_losses_equal_one_process(results):
    got, want = results["fp8_losses"], results["ref_fp8_losses"]
    assert torch.isfinite(got).all() and got.numel() == 2
    torch.testing.assert_close(got, want, **FP32_TOL)
    # 2 layers x 3 FP8 modules (QKV, proj, MLP) x (scale, history) x (fwd, bwd)
    assert len(results["fp8_states"]) == len(results["ref_fp8_states"]) == 2 * 3 * 4
    for i, (a, b) in enumerate(zip(results["fp8_states"], results["ref_fp8_states"])):
        torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"FP8 state {i}: {m}")
    # FP8 really ran: the FP8 losses differ from the fp32 ones
    assert not torch.equal(got, results["losses"][:2])


@pytest.mark.parametrize("label,field", [("kv-heads", "num_key_value_heads=1"),
                                         ("heads", "num_attention_heads=3"),
                                         ("ffn", "intermediate_size=67")])
def test_tp_size_must_divide(results, label, field):
    kind, text = results["errors"][label]
    assert kind == "ValueError" and field in text and "tp_group has 2 ranks" in text, (kind, text)
    assert results["errors"][label + "-untouched"]
