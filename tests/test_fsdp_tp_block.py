"""cpu tier: Float8BlockScaling on FSDP2 x tensor/sequence parallelism (a ("dp", "tp") = (2, 2)
DeviceMesh of four gloo processes), the converted HF Llama: the FP8 all-gather of block-scaled
operands (functional/block_sp.py) inside the whole composition.

A tiny HF LlamaForCausalLM (hidden 256, 2 layers, GQA) converted with tp_group=mesh["tp"] and
sequence_parallel=True, fully_shard per decoder layer and at the root over mesh["dp"], FusedAdam
with fp32 masters; 3 steps on sequences of 256 tokens (128 a TP rank: whole 128-token blocks,
so the sequence-parallel gathers move fp8 blocks). The same run with `fp8_block_gather(False)`
(the high-precision gathers, then each rank quantizes the whole tensor) must give the same
losses and the same final weights bit for bit: the gathered blocks are those of quantizing the
gathered tensor. The first step's forward all-gathers of tensor parallelism move exactly what
the layers say: each layer's two column GEMMs (QKV, fc1) gather 128 local tokens x 256 as fp8
blocks (1 + 4/128 bytes an element) instead of fp32 rows (4 bytes), and the gather of the last
layer's output (no GEMM input) stays fp32 in both runs.
"""
from __future__ import annotations

import os

import pytest
import torch

from testlib import all_gather_sizes, assert_bits, gloo_group, spawn_results

pytest.importorskip("transformers")
pytestmark = pytest.mark.cpu

WORLD, DP, TP = 4, 2, 2
SEQ, VOCAB, STEPS, HIDDEN, LAYERS = 256, 512, 3, 256, 2


def _train(mesh, fp8_gather: bool):
    import transformers
    from torch.distributed.fsdp import fully_shard
    import tritium as te
    from tritium import recipe
    from tritium.distributed import tensor_parallel as T
    from tritium.distributed.tensor_parallel import gather_full_state_dict
    from tritium.functional.block_sp import fp8_block_gather
    from tritium.integrations.hf import convert_llama
    torch.manual_seed(0)   # the same initial model on every rank and in both runs
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
                                   num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False,
                                   use_cache=False)
    model = convert_llama(transformers.LlamaForCausalLM(cfg), tp_group=mesh["tp"],
                          sequence_parallel=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    gen = torch.Generator().manual_seed(1 + mesh.get_local_rank("dp"))
    rcp = recipe.Float8BlockScaling()
    losses, forward_bytes = [], None
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
        with fp8_block_gather(fp8_gather), all_gather_sizes(T, "_all_gather") as sizes:
            with te.fp8_autocast(fp8_recipe=rcp):
                loss = model(input_ids=ids, labels=ids).loss
        forward_bytes = sum(sizes) if forward_bytes is None else forward_bytes
        with fp8_block_gather(fp8_gather):
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    weights = {k: v for k, v in gather_full_state_dict(model).items()
               if not k.endswith("_extra_state")}
    return torch.stack(losses), weights, forward_bytes


def _worker(rank, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    with gloo_group(rank, WORLD, port):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        res = {mode: _train(mesh, mode == "fp8") for mode in ("fp8", "hp")}
        if rank == 0:
            torch.save(res, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("fsdp_tp_block"))


def test_fp8_block_gather_trains_as_the_high_precision_gather(results):
    (losses, weights, _), (hp_losses, hp_weights, _) = results["fp8"], results["hp"]
    assert torch.isfinite(losses).all() and losses.numel() == STEPS
    assert_bits(losses, hp_losses, "losses")
    assert weights.keys() == hp_weights.keys() and len(weights) > 10
    for key in weights:
        assert_bits(weights[key], hp_weights[key], key)


def test_fp8_block_gather_bytes(results):
    rows = SEQ // TP * HIDDEN               # one rank's elements of a [tokens, hidden] gather
    gemm_inputs, output = 2 * LAYERS, 1
    assert results["hp"][2] == (gemm_inputs + output) * rows * 4
    assert results["fp8"][2] == gemm_inputs * (rows + rows // 128 * 4) + output * rows * 4
