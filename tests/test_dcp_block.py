"""cpu tier: distributed checkpoints (DCP) of FSDP2-sharded block-scaled FP8 params, gloo.

Two processes train a te.LayerNormMLP + te.Linear made under fp8_model_init(Float8BlockScaling())
(Float8BlockTensor weights, 128x128 and 1x128 blocks) with fully_shard and
FusedAdam(master_weights=True) for 2 steps, save with tritium.distributed.checkpointing, and
train 2 more; a freshly built sharded model (another init) and optimizer load the checkpoint
and train the same 2 steps: losses, fp8 bytes and block scales (1x128: both forms), masters and
moments equal bit for bit. One process (no FSDP: plain Float8BlockTensor params) loads the same
2-rank checkpoints and continues bit for bit too (every rank feeds the whole batch, so sharded
training is exactly one process's, see test_fsdp_block.py); a high-precision model loads the
dequantized values. Mismatches are refused by name with nothing changed: a tensorwise-FP8 or
1x128 model loading the 128x128 checkpoint, a block model loading a tensorwise one.
"""
from __future__ import annotations


import pytest
import torch

from testlib import assert_bits, free_port, gloo_group, spawn
from test_fsdp_block import B, F, H, _model, _shard

pytestmark = [pytest.mark.cpu,   # one process loads with DCP without a process group:
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

SAVED_AT, MORE = 2, 2
DIMS = (2, 1)          # w_block_scaling_dim: 128x128 and 1x128 weight blocks


def _entry(rank, world, port, ckpt, out, seed):
    with gloo_group(rank, world, port):
        _check_two_ranks(rank, world, ckpt, out, seed)


def _steps(model, opt, start, n, dim=2):
    """n FusedAdam steps on the whole batch of steps start.. (every rank the same rows)."""
    import tritium as te
    from tritium import recipe
    losses = []
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(100 + step)
        x, t = torch.randn(B, H, generator=g), torch.randn(B, F, generator=g)
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling(w_block_scaling_dim=dim)):
            loss = ((model(x).float() - t) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _adam(model):
    from tritium.optimizers import FusedAdam
    return FusedAdam(model.parameters(), lr=1e-2, master_weights=True)


def _full(t, world):
    """The whole tensor of a dim-0 sharded DTensor (or a plain tensor); of a block-scaled
    param its fp8 bytes and block scales, gathered as they are."""
    from torch.distributed.tensor import DTensor
    from tritium.fp8.block_tensor import Float8BlockTensor
    local, n = (t._local_tensor, world) if isinstance(t, DTensor) else (t, 1)
    if isinstance(local, Float8BlockTensor):
        parts = [local._data.view(torch.uint8), local._scale_inv]
        if not local._block_2d:     # both forms, each with the rows on dim 0
            parts = [parts[0], local._scale_inv.t(), local._data_t.t().view(torch.uint8),
                     local._scale_inv_t]
        return [_gather(x, n) for x in parts]
    return _gather(local.detach(), n)


def _gather(x, n):
    import torch.distributed as dist
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _state(model, opt, world) -> dict:
    """name -> every number training carries: param (fp8 bytes and block scales), master and
    moments, whole."""
    state = {}
    for name, p in model.named_parameters():
        full = _full(p, world)
        state[name] = full if isinstance(full, list) else [full]
        master = opt.get_master_param(p)
        state[name] += [_full(x, world) for x in (master, opt.state[p]["exp_avg"],
                                                  opt.state[p]["exp_avg_sq"]) if x is not None]
    return state


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name]), name
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            assert torch.equal(x, y), (name, i)


def _check_two_ranks(rank, world, ckpt, out, seed):
    from tritium import recipe
    from tritium.distributed import checkpointing
    for dim in DIMS:
        rcp = recipe.Float8BlockScaling(w_block_scaling_dim=dim)
        model = _shard(_model(True, dim=dim, seed=seed))
        opt = _adam(model)
        _steps(model, opt, 0, SAVED_AT, dim)
        checkpointing.save(f"{ckpt}{dim}", model, opt)
        after = _steps(model, opt, SAVED_AT, MORE, dim)
        fresh = _shard(_model(True, dim=dim, seed=seed + 1))   # another init: the load matters
        opt2 = _adam(fresh)
        checkpointing.load(f"{ckpt}{dim}", fresh, opt2, fp8_recipe=rcp)
        resumed = _steps(fresh, opt2, SAVED_AT, MORE, dim)
        assert torch.equal(after, resumed), (dim, after, resumed)
        final = _state(model, opt, world)
        _assert_same(final, _state(fresh, opt2, world))
        if rank == 0:
            torch.save({"losses": after, "state": final}, f"{out}{dim}")


def _tensorwise_model(seed):
    """The same layers with tensorwise FP8 params (DelayedScaling), run once so their FP8
    state exists."""
    import tritium as te
    from tritium import recipe
    rcp = recipe.DelayedScaling()
    torch.manual_seed(seed)
    with te.fp8_model_init(recipe=rcp):
        model = torch.nn.Sequential(te.LayerNormMLP(H, F, device="cpu"),
                                    te.Linear(H, F, device="cpu"))
    with te.fp8_autocast(fp8_recipe=rcp):
        model(torch.randn(B, H)).sum().backward()
    return model


def _bits(model) -> dict:
    """Every tensor the model holds, FP8 params as their bytes and scales."""
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            parts = (v.operands() if hasattr(v, "operands") else
                     (v._data, v._scale_inv) if hasattr(v, "_data") else (v,))
            out[k] = [None if t is None else t.detach().clone() for t in parts]
    return out


def _unchanged(model, before: dict):
    after = _bits(model)
    assert after.keys() == before.keys()
    for k in before:
        for i, (a, b) in enumerate(zip(after[k], before[k])):
            assert_bits(a, b, f"{k} part {i}")


def test_block_fp8_dcp_resume_two_ranks_and_one(tmp_path, _seed):
    from tritium import recipe
    from tritium.distributed import checkpointing
    from tritium.fp8.block_tensor import Float8BlockTensor
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "after")
    spawn(_entry, 2, 2, free_port(), ckpt, out, _seed)

    # one process, no FSDP: the 2-rank checkpoints continue bit for bit
    for dim in DIMS:
        expected = torch.load(f"{out}{dim}", weights_only=True)
        model = _model(True, dim=dim, seed=_seed + 2)
        opt = _adam(model)
        checkpointing.load(f"{ckpt}{dim}", model, opt,
                           fp8_recipe=recipe.Float8BlockScaling(w_block_scaling_dim=dim))
        if dim == 2:
            loaded = {n: p.dequantize() for n, p in model.named_parameters()
                      if isinstance(p, Float8BlockTensor)}
        resumed = _steps(model, opt, SAVED_AT, MORE, dim)
        assert torch.equal(resumed, expected["losses"]), (dim, resumed, expected["losses"])
        _assert_same(_state(model, opt, 1), expected["state"])
    ckpt, blk = f"{ckpt}2", recipe.Float8BlockScaling()

    # a high-precision model takes the dequantized values
    hp = _model(False, seed=_seed + 3)
    checkpointing.load(ckpt, hp, fp8_recipe=blk)
    for name, p in hp.named_parameters():
        if name in loaded:
            assert torch.equal(p.detach(), loaded[name]), name

    # mismatches: refused by name, nothing changed
    wise = _tensorwise_model(_seed + 4)
    before = _bits(wise)
    with pytest.raises(ValueError, match=r"'0.fc1_weight' as a block-scaled.*tensorwise"):
        checkpointing.load(ckpt, wise, _adam(wise), fp8_recipe=blk)
    _unchanged(wise, before)
    one = _model(True, dim=1, seed=_seed + 5)
    before = _bits(one)
    with pytest.raises(ValueError, match=r"128x128 blocks.*1x128 blocks.*w_block_scaling_dim=2"):
        checkpointing.load(ckpt, one, _adam(one), fp8_recipe=blk)
    _unchanged(one, before)
    wise_ckpt = str(tmp_path / "tensorwise")
    checkpointing.save(wise_ckpt, wise)
    block = _model(True, seed=_seed + 6)
    before = _bits(block)
    with pytest.raises(ValueError, match=r"no block scales for '0.fc1_weight'.*tensorwise"):
        checkpointing.load(wise_ckpt, block, _adam(block), fp8_recipe=blk)
    _unchanged(block, before)


def test_block_fp8_dcp_1x128_one_process(tmp_path, _seed):
    """1x128 weights saved by one process (plain params): the columnwise form, quantized from
    high precision, is saved with the scales, so every operand comes back bit for bit."""
    from tritium import recipe
    from tritium.distributed import checkpointing
    from tritium.fp8.block_tensor import Float8BlockTensor
    ckpt = str(tmp_path / "ckpt")
    model = _model(True, dim=1, seed=_seed)
    opt = _adam(model)
    _steps(model, opt, 0, 1, 1)
    checkpointing.save(ckpt, model, opt)
    fresh = _model(True, dim=1, seed=_seed + 1)
    opt2 = _adam(fresh)
    checkpointing.load(ckpt, fresh, opt2,
                       fp8_recipe=recipe.Float8BlockScaling(w_block_scaling_dim=1))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        if isinstance(p, Float8BlockTensor):
            assert not q._block_2d
            for i, (a, b) in enumerate(zip(p.operands(), q.operands())):
                assert_bits(b, a, f"{name} operand {i}")
    assert torch.equal(_steps(model, opt, 1, 1, 1), _steps(fresh, opt2, 1, 1, 1))


@pytest.mark.parametrize("block_2d", [True, False])
@pytest.mark.parametrize("power_2_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_parts_round_trip(randn, block_2d, power_2_scale, dtype):
    """A block tensor's checkpoint form (dequantized values in the nominal dtype + parts) gives
    back every operand bit for bit, also with non-power-of-2 scales and bf16 values, and a
    wrong part is refused before anything is written."""
    from tritium.fp8.block_tensor import Float8BlockTensor, checkpoint_layout
    x = randn(384, 320) * torch.logspace(-3, 3, 384)[:, None]   # rows of very different size
    w = Float8BlockTensor.quantize(x.to(dtype), torch.float8_e4m3fn, block_2d=block_2d,
                                   power_2_scale=power_2_scale)
    parts = w.checkpoint_parts()
    assert {n: tuple(t.shape) for n, t in parts.items()} == checkpoint_layout(w.shape, block_2d)
    back = Float8BlockTensor.quantize(randn(384, 320).to(dtype), torch.float8_e4m3fn,
                                      block_2d=block_2d, power_2_scale=power_2_scale)
    before = [t.clone() for t in back.operands()]
    name = next(iter(parts))
    bad = dict(parts, **{name: parts[name][:-1]})
    with pytest.raises(ValueError, match="needs values of its shape and the parts"):
        back.load_checkpoint_(w.dequantize(), bad)
    for i, (a, b) in enumerate(zip(back.operands(), before)):
        assert_bits(a, b, f"operand {i} after the refusal")
    back.load_checkpoint_(w.dequantize(), parts)
    for i, (a, b) in enumerate(zip(back.operands(), w.operands())):
        assert_bits(a, b, f"operand {i}")
