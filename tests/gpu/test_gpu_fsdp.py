"""multigpu tier: FSDP2 with tritium on 2 GPUs over NCCL (2 processes, spawned here).

  * FusedAdam's Triton kernel steps DTensor shards: given the same full gradients (assigned as
    the shards of one tensor), the sharded bf16 and FP8 params, fp32 masters and moments equal
    the single-GPU step bit for bit (the update is elementwise).
  * FP8 all-gather over NCCL: the gathered FP8 weight of an FP8-param model equals the weight
    before sharding byte for byte, and one fwd+bwd gathers <= 0.6x the bytes of the bf16 model
    (FP8 params and bf16 weights wrapped by enable_fp8_all_gather alike).
  * 5 training steps under fp8_autocast: the sharded FP8-param model's losses follow the
    single-GPU run's (cuBLAS may pick other kernels for other row counts: 1e-3 relative).

    pytest -q -s -m multigpu tests/gpu/test_gpu_fsdp.py
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from testlib import free_port, spawn

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD, H, F, G = 2, 256, 512, 64



def _model(fp8: bool, dtype, seed: int):
    import tritium as te
    from tritium import recipe
    torch.manual_seed(seed)
    ctx = (te.fp8_model_init(recipe=recipe.DelayedScaling(amax_history_len=16)) if fp8
           else contextlib.nullcontext())
    with ctx:
        layers = [te.LayerNormMLP(H, F, activation="swiglu", normalization="RMSNorm",
                                  bias=False, params_dtype=dtype, device="cuda"),
                  te.Linear(H, H, bias=False, params_dtype=dtype, device="cuda")]
    return torch.nn.Sequential(*layers)


def _shard(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
    return model


def _full(t):
    from torch.distributed.tensor import DTensor
    from tritium.fp8.tensor import Float8Tensor
    local = t._local_tensor if isinstance(t, DTensor) else t
    local = getattr(local, "_hp_shard", local)
    if isinstance(local, Float8Tensor):
        local = local.dequantize()
    if isinstance(t, DTensor):
        return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape,
                                  stride=t.stride()).full_tensor()
    return local.detach()


def _optimizer_step_bitwise(rank):
    import tritium as te
    from torch.distributed.tensor import distribute_tensor
    for fp8 in (False, True):
        single, sharded = _model(fp8, torch.bfloat16, 1), _shard(_model(fp8, torch.bfloat16, 1))
        opts = [te.optimizers.FusedAdam(m.parameters(), lr=1e-3, master_weights=True)
                for m in (single, sharded)]
        g = torch.Generator(device="cuda").manual_seed(5)
        for _ in range(3):
            for p, q in zip(single.parameters(), sharded.parameters()):
                grad = torch.randn(p.shape, generator=g, device="cuda").to(torch.bfloat16)
                p.grad = grad
                q.grad = distribute_tensor(grad, q.device_mesh, q.placements)
            for o in opts:
                o.step()
        for p, q in zip(single.parameters(), sharded.parameters()):
            assert torch.equal(_full(q), _full(p))
            assert torch.equal(_full(opts[1].get_master_param(q)), opts[0].get_master_param(p))
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_full(opts[1].state[q][key]), opts[0].state[p][key])


def _gathered_bytes(rank, kind):
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    from tritium.distributed import enable_fp8_all_gather
    model = _model(kind == "fp8", torch.bfloat16, 2)
    if kind == "gather":
        enable_fp8_all_gather(model)
    _shard(model)
    total = [0]
    # FSDP2 gathers through dist.all_gather_single (torch 2.13) or all_gather_into_tensor
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(out, inp, *a, **k):
            total[0] += inp.numel() * inp.element_size()
            return real[name](out, inp, *a, **k)
        return call
    for n in names:
        setattr(dist, n, counting(n))
    try:
        x = torch.randn(G, H, device="cuda", dtype=torch.bfloat16)
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            model(x).float().pow(2).mean().backward()
    finally:
        for n in names:
            setattr(dist, n, real[n])
    assert total[0] > 0, "no all-gather seen"
    return total[0]


def _training(rank):
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    rcp = recipe.DelayedScaling(amax_history_len=16)
    single, sharded = _model(True, torch.bfloat16, 3), _model(True, torch.bfloat16, 3)
    before = single[0].fc1_weight.dequantize()
    _shard(sharded)
    assert torch.equal(_full(sharded[0].fc1_weight), before)
    opts = [te.optimizers.FusedAdam(m.parameters(), lr=1e-3, master_weights=True)
            for m in (single, sharded)]
    losses = {0: [], 1: []}
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        x = torch.randn(G, H, generator=g, device="cuda").to(torch.bfloat16)
        t = torch.randn(G, H, generator=g, device="cuda")
        rows = slice(rank * G // WORLD, (rank + 1) * G // WORLD)
        for i, (m, xi, ti) in enumerate(((single, x, t), (sharded, x[rows], t[rows]))):
            with te.fp8_autocast(fp8_recipe=rcp):
                y = m(xi)
            loss = ((y.float() - ti) ** 2).sum() / t.numel()
            loss.backward()
            opts[i].step()
            opts[i].zero_grad()
            loss = loss.detach()
            if i == 1:
                dist.all_reduce(loss)
            losses[i].append(loss)
    torch.testing.assert_close(torch.stack(losses[1]), torch.stack(losses[0]), rtol=1e-3, atol=0)


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        _optimizer_step_bitwise(rank)
        bytes_ = [_gathered_bytes(rank, k) for k in ("bf16", "fp8", "gather")]
        assert bytes_[1] <= 0.6 * bytes_[0] and bytes_[2] <= 0.6 * bytes_[0], bytes_
        _training(rank)
        if rank == 0:
            print(f"\nall-gather bytes per rank, one fwd+bwd: bf16 {bytes_[0]}, FP8 params "
                  f"{bytes_[1]}, bf16 gathered as FP8 {bytes_[2]}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp_two_gpus(tmp_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # no NVLink multicast
    spawn(_worker, WORLD, free_port(), str(tmp_path))
