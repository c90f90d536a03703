"""cpu tier: FSDP2 sharding of block-scaled FP8 params (Float8BlockTensor), gloo.

Two processes train a te.LayerNormMLP + te.Linear made under fp8_model_init(Float8BlockScaling())
with fully_shard and FusedAdam(master_weights=True) for 3 steps, with 128x128 and with 1x128
weight blocks; every rank also trains the same model on one process. Every rank feeds the whole
batch, so FSDP's gradient average is of equal values (exact): the losses, the gathered final
FP8 bytes and block scales (1x128: both forms), the masters and the unsharded weights FSDP
builds equal single-process training bit for bit (block scales are local, nothing is reduced).
One fwd+bwd gathers < 0.6x the bytes of the same model in bf16 with 128x128 blocks, < 1.1x with
1x128 blocks (both forms are gathered). Rows that do not split into whole 128-row blocks per
shard raise at fully_shard, before any collective.
"""
from __future__ import annotations


import pytest
import torch

from testlib import all_gather_sizes, assert_bits, free_port, gloo_group, spawn

pytestmark = pytest.mark.cpu

H, F, B, STEPS = 256, 512, 16, 3


def _entry(rank, world, port):
    with gloo_group(rank, world, port):
        _check(rank, world)


def _model(block: bool, dtype=torch.float32, out: int = F, dim: int = 2, seed: int = 0):
    import contextlib
    import tritium as te
    from tritium import recipe
    torch.manual_seed(seed)
    ctx = (te.fp8_model_init(recipe=recipe.Float8BlockScaling(w_block_scaling_dim=dim))
           if block else contextlib.nullcontext())
    with ctx:
        return torch.nn.Sequential(
            te.LayerNormMLP(H, F, params_dtype=dtype, device="cpu"),
            te.Linear(H, out, params_dtype=dtype, device="cpu"))


def _shard(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _train(model, dim: int = 2):
    import tritium as te
    from tritium import recipe
    from tritium.optimizers import FusedAdam
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, t = torch.randn(B, H, generator=g), torch.randn(B, F, generator=g)
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling(w_block_scaling_dim=dim)):
            y = model(x)
        loss = ((y.float() - t) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), opt


def _gathered_bytes(block: bool, dim: int = 2) -> int:
    import tritium as te
    from tritium import recipe
    model = _shard(_model(block, torch.float32 if block else torch.bfloat16, dim=dim))
    with all_gather_sizes() as sizes:
        x = torch.randn(B, H, dtype=next(model.parameters()).dtype)
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling(w_block_scaling_dim=dim)):
            model(x).float().sum().backward()
    assert sizes, "no all-gather seen"
    return sum(sizes)


def _check(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    # misconfigurations first: raised at fully_shard, on every rank, before any collective
    with pytest.raises(ValueError, match=r"\(384, 256\).*2 ranks.*multiple of 128"):
        fully_shard(_model(True, out=384)[1])        # 192-row shards: one cuts a block
    with pytest.raises(ValueError, match=r"\(384, 256\).*2 ranks.*multiple of 128"):
        fully_shard(_model(True, out=384, dim=1)[1])  # 1x128: the columnwise tiles

    for dim in (2, 1):
        _check_training(world, dim)
    bf16, fp8, fp8_1x128 = (_gathered_bytes(False), _gathered_bytes(True),
                            _gathered_bytes(True, dim=1))
    assert fp8 < 0.6 * bf16, (fp8, bf16)
    assert fp8_1x128 < 1.1 * bf16, (fp8_1x128, bf16)   # both forms: 2 bytes per element
    dist.barrier()


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_training(world, dim):
    """Sharded training == one process bit for bit: losses, masters, every rank's bytes and
    scales (both forms for 1x128 weights, each with the shard's rows), and the unsharded
    weight FSDP builds."""
    import torch.distributed as dist
    from tritium.fp8.block_tensor import Float8BlockTensor
    single_losses, single_opt = _train(single := _model(True, dim=dim), dim)
    sharded = _shard(_model(True, dim=dim))
    losses, opt = _train(sharded, dim)
    assert torch.equal(losses, single_losses), (dim, losses, single_losses)
    for (name, p), q in zip(sharded.named_parameters(), single.parameters()):
        shard = p.to_local()
        if isinstance(q, Float8BlockTensor):   # each rank's bytes and scales, gathered by hand
            assert isinstance(shard, Float8BlockTensor), (name, type(shard))
            assert (shard._data_t is None) == (dim == 2), name
            pairs = [(shard._data, q._data), (shard._scale_inv, q._scale_inv)]
            if dim == 1:                       # rows on dim 0: transpose what runs along N
                pairs = [(shard._data, q._data), (shard._scale_inv.t(), q._scale_inv.t()),
                         (shard._data_t.t(), q._data_t.t()), (shard._scale_inv_t, q._scale_inv_t)]
            for mine, want in pairs:
                parts = [torch.empty_like(_bits(mine)) for _ in range(world)]
                dist.all_gather(parts, _bits(mine).contiguous())
                assert torch.equal(torch.cat(parts), _bits(want)), name
            master = opt.get_master_param(p).full_tensor()
            assert torch.equal(master, single_opt.get_master_param(q)), name
        else:
            assert torch.equal(p.full_tensor(), q), name
    # the unsharded weight FSDP builds: the gathered bytes, the columnwise form (made after the
    # gather for 128x128, gathered for 1x128), twice (the second into re-allocated buffers)
    w = sharded[1].weight
    q = single[1].weight
    for _ in range(2):
        sharded[1].unshard()
        full = sharded[1].weight
        assert type(full) is Float8BlockTensor and full._data_t is not None
        for i, (a, b) in enumerate(zip(full.operands(), q.operands())):
            assert_bits(a, b, f"unsharded operand {i}")
        sharded[1].reshard()
        assert sharded[1].weight is w


def test_block_fp8_params_fsdp_two_ranks():
    spawn(_entry, 2, 2, free_port())


def test_block_split_rules(randn):
    """FSDP2's dim-0 chunking of a Float8BlockTensor: whole 128-row blocks per shard, bytes and
    scales kept; anything else a ValueError naming shape, ranks and the fix."""
    from tritium.fp8.block_tensor import Float8BlockTensor
    w = Float8BlockTensor.quantize(randn(512, 384), torch.float8_e4m3fn)
    shards = torch.chunk(w, 4)
    assert [s.shape[0] for s in shards] == [128] * 4
    for i, s in enumerate(shards):
        assert s._data_t is None and s._scale_inv.shape == (1, 3)
        rows = w._data[128 * i:128 * (i + 1)]
        assert torch.equal(s._data.view(torch.uint8), rows.view(torch.uint8))
        assert torch.equal(s._scale_inv, w._scale_inv[i:i + 1])
    empty = torch.empty_like(shards[1])                   # module.to_empty()
    assert type(empty) is Float8BlockTensor and empty._scale_inv.shape == (1, 3)
    # gather by hand through the extension points (as FSDP2 does) and rebuild the columnwise form
    inputs, metas = zip(*(s.fsdp_pre_all_gather(_Mesh(4), w.shape, None, None, None)
                          for s in shards))
    gathered = [torch.cat([i[k] for i in inputs]) for k in range(2)]
    full, _ = shards[0].fsdp_post_all_gather(gathered, metas[0], torch.bfloat16)
    assert full.dtype == torch.bfloat16
    for i, (a, b) in enumerate(zip(full.operands(), w.operands())):
        assert_bits(a, b, f"operand {i}")
    with pytest.raises(ValueError, match=r"\(384, 128\).*4 ranks.*512"):
        torch.chunk(Float8BlockTensor.quantize(randn(384, 128), torch.float8_e4m3fn), 4)
    with pytest.raises(ValueError, match=r"\(384, 128\).*2 ranks"):  # 192-row shards
        shards[0].fsdp_pre_all_gather(_Mesh(2), (384, 128), None, None, None)


def test_block_split_rules_1x128(randn):
    """1x128 weights shard the same way and keep both forms: each shard's rows of the data and
    of the columnwise form's tiles along N; the gather through the extension points rebuilds
    every operand bit for bit."""
    from tritium.fp8.block_tensor import Float8BlockTensor
    w = Float8BlockTensor.quantize(randn(512, 384), torch.float8_e4m3fn, block_2d=False)
    shards = torch.chunk(w, 4)
    for i, s in enumerate(shards):
        rows = slice(128 * i, 128 * (i + 1))
        assert torch.equal(s._data.view(torch.uint8), w._data[rows].view(torch.uint8))
        assert torch.equal(s._scale_inv, w._scale_inv[:, rows])
        assert torch.equal(s._data_t.view(torch.uint8), w._data_t[:, rows].view(torch.uint8))
        assert torch.equal(s._scale_inv_t, w._scale_inv_t[i:i + 1])
    pad = shards[0].new_zeros(128, 384)                    # FSDP2's storage of a shard
    pad.copy_(shards[2])
    for i, (a, b) in enumerate(zip(pad.operands(), shards[2].operands())):
        assert_bits(a, b, f"copied shard operand {i}")
    inputs, metas = zip(*(s.fsdp_pre_all_gather(_Mesh(4), w.shape, None, None, None)
                          for s in shards))
    gathered = [torch.cat([i[k] for i in inputs]) for k in range(4)]
    full, _ = shards[0].fsdp_post_all_gather(gathered, metas[0], torch.float32)
    for i, (a, b) in enumerate(zip(full.operands(), w.operands())):
        assert_bits(a, b, f"operand {i}")


class _Mesh:
    def __init__(self, n):
        self.n = n

    def size(self, dim=None):
        return self.n
