"""cpu tier: FSDP2, DDP and DCP with tritium modules over gloo (1, 2 and 4 processes).

One process group per world size runs every check (spawned once, torch.multiprocessing) and
asserts inside the workers; rank 0 leaves the results the next world size needs in tmp files.
  * training: 5 FusedAdam steps (and FusedSGD) of a sharded model equal single-device training
    of the same model on the same global batch (every rank computes the single-device run
    itself; each rank's loss is normalized by the global batch and gradients are summed, see
    _shard): fp32 params at fp32 tolerance (the math differs only in summation order); bf16
    params at bf16 rtol with atol = bf16 rtol of the largest total update (5 lr), since each
    rank's bf16 wgrad over its own rows rounds differently from the full batch's, and with
    Adam's eps raised above that rounding (else a near-zero grad whose sign the rounding flips
    moves its weight by a whole lr); FP8 params (delayed scaling, amaxes reduced over the ranks
    so every rank and the single device use the same scales) at fp32 tolerance, masters and
    moments included; high-precision weights gathered as FP8 (current scaling with precomputed
    scales, and delayed); FP8 weight caching across micro-batches (is_first_microbatch). Under
    current scaling each tensor's scale is its own amax, so the single device runs each rank's
    rows as a micro-batch of its own. The gathered FP8 weight equals the single-device FP8
    weight bit for bit before any step (gathering is exact).
  * bytes: one fwd+bwd gathers <= 0.6x the bytes with FP8 weights as with bf16 weights.
  * DCP: a 2-rank checkpoint of FP8 params + FusedAdam (masters, moments) + FP8 metadata
    resumes bit-exactly at 2 ranks, and continues the same loss curve at 1 and 4 ranks.
  * DDP + amax reduction: scales and histories identical on every rank, and training equal
    to the single-device run on the whole batch.
  * misconfiguration errors, raised before any collective, and smoke steps of
    MultiheadAttention, TransformerLayer and a converted HF Llama under FSDP2.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from testlib import all_gather_sizes, free_port, gloo_group, spawn

pytestmark = pytest.mark.cpu

H, F, G = 32, 64, 8          # hidden, ffn, global batch rows (divisible by 1, 2 and 4)
STEPS = 5
FP32 = dict(rtol=1.3e-6, atol=1e-5)
LR = 1e-2
# bf16 params: each step's update may differ by bf16 rounding (rtol 1.6e-2) of its size (<= lr)
BF16 = dict(rtol=1.6e-2, atol=1.6e-2 * LR * STEPS)



def _spawn(fn, world, *args):
    spawn(_entry, world, world, free_port(), fn, args)


def _entry(rank, world, port, fn, args):
    with gloo_group(rank, world, port):
        fn(rank, world, *args)


# --------------------------------------------------------------------------- worker helpers
def _model(kind: str, seed: int, out: int = H, dtype=None):
    import tritium as te
    from tritium import recipe
    torch.manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if kind == "bf16" else torch.float32)
    ctx = (te.fp8_model_init(recipe=recipe.DelayedScaling(amax_history_len=4))
           if kind == "fp8" else contextlib.nullcontext())
    with ctx:
        return torch.nn.Sequential(
            te.LayerNormMLP(H, F, activation="swiglu", normalization="RMSNorm",
                            params_dtype=dtype, device="cpu"),
            te.Linear(H, out, params_dtype=dtype, device="cpu"))


def _shard(model):
    """fully_shard per layer and at the root. Gradients are summed over ranks, not averaged
    (set_gradient_divide_factor(1)): each rank's loss is normalized by the GLOBAL batch, so
    every rank's activation gradients are the single device's rows bit for bit (FP8 casts of
    them then see the same values; a mean over the local rows would scale them by world)."""
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)   # a plain SUM (gloo has no PREMUL_SUM)
    return model


def _batch(step: int, world: int, rank, out: int, dtype):
    """Rows of the global batch of `step` (all of it for rank=None)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, t = torch.randn(G, H, generator=gen), torch.randn(G, out, generator=gen)
    if rank is not None:
        rows = slice(rank * G // world, (rank + 1) * G // world)
        x, t = x[rows], t[rows]
    return x.to(dtype), t


def _loss(y, t, micro):
    """Squared error normalized by the global batch (see _shard)."""
    return ((y.float() - t) ** 2).sum() / (G * t.shape[-1] * micro)


def _train(model, opt, world, rank, *, steps, start=0, rcp=None, micro=1, out=H, dtype=None,
           after_step=None, per_rank=False):
    """`steps` optimizer steps of `micro` micro-batches each (micro-batch i of a step: this
    rank's rows of its own global batch); the global losses. rank=None: the single device
    on all rows; per_rank=True: one rank's rows after another, as separate micro-batches (current
    scaling casts each tensor with its own amax, so the single device must see each rank's
    activations on their own to use the same scales)."""
    import torch.distributed as dist
    import tritium as te
    dtype = dtype or next(p.dtype for p in model.parameters())
    losses = []
    for step in range(start, start + steps):
        total = torch.zeros(())
        for i in range(micro):
            for r in (range(world) if per_rank else [rank]):
                x, t = _batch(step * micro + i, world, r, out, dtype)
                first = (i == 0 and (r == 0 or not per_rank)) if micro > 1 or per_rank else None
                ctx = (te.fp8_autocast(fp8_recipe=rcp) if rcp is not None
                       else contextlib.nullcontext())
                with ctx:
                    y = model[1](model[0](x, is_first_microbatch=first), is_first_microbatch=first)
                loss = _loss(y, t, micro)
                loss.backward()
                total += loss.detach()
        if world > 1 and rank is not None:
            dist.all_reduce(total)
        losses.append(total)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
    return torch.stack(losses)


def _full(t):
    """The whole tensor of a param / state (a DTensor is gathered; FP8 is dequantized)."""
    from torch.distributed.tensor import DTensor
    from tritium.fp8.tensor import Float8Tensor
    if isinstance(t, DTensor):
        local = t._local_tensor
        local = getattr(local, "_hp_shard", local)
        if isinstance(local, Float8Tensor):
            local = local.dequantize()
        return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape,
                                  stride=t.stride()).full_tensor()
    return t.dequantize() if isinstance(t, Float8Tensor) else getattr(t, "_hp_shard", t).detach()


def _compare(sharded, single, opt_s, opt_1, tol, what):
    for (name, p), q in zip(sharded.named_parameters(), single.parameters()):
        torch.testing.assert_close(_full(p).float(), _full(q).float(), **tol,
                                   msg=lambda m: f"{what}: {name}: {m}")
        m_s, m_1 = opt_s.get_master_param(p), opt_1.get_master_param(q)
        if m_1 is not None:
            torch.testing.assert_close(_full(m_s), m_1, **tol, msg=lambda m: f"{what}: master "
                                       f"{name}: {m}")
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in opt_1.state[q]:
                torch.testing.assert_close(_full(opt_s.state[p][key]), opt_1.state[q][key],
                                           **tol, msg=lambda m: f"{what}: {key} {name}: {m}")


def _check_training(rank, world, kind, *, rcp=None, tol=FP32, micro=1, gather=None, out=H,
                    seed=7, eps=1e-8, sgd=False):
    """5 steps sharded vs single device (see the module note)."""
    import tritium as te
    from tritium.distributed import enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
    single, sharded = _model(kind, seed, out), _model(kind, seed, out)
    after = None
    if gather is not None:
        enable_fp8_all_gather(sharded, gather)
        after = lambda: precompute_fp8_scales_for_fsdp(sharded)  # noqa: E731
    _shard(sharded)
    if kind == "fp8" and rank is not None:  # gathering is exact: the same FP8 weight bytes
        w = sharded[0].fc1_weight
        gathered = _full(w)
        torch.testing.assert_close(gathered, single[0].fc1_weight.dequantize(), rtol=0, atol=0)
    if sgd:
        make = lambda ps: te.optimizers.FusedSGD(ps, lr=LR * 10, momentum=0.9,  # noqa: E731
                                                 weight_decay=0.01, master_weights=True)
    else:
        make = lambda ps: te.optimizers.FusedAdam(ps, lr=LR, eps=eps,  # noqa: E731
                                                  master_weights=True)
    opt_1, opt_s = make(single.parameters()), make(sharded.parameters())
    from tritium import recipe
    per_rank = isinstance(rcp, recipe.Float8CurrentScaling)
    l1 = _train(single, opt_1, world, None, steps=STEPS, rcp=rcp, micro=micro, out=out,
                per_rank=per_rank)
    ls = _train(sharded, opt_s, world, rank, steps=STEPS, rcp=rcp, micro=micro, out=out,
                after_step=after)
    what = f"{kind}/{type(rcp).__name__}/micro={micro}/gather={type(gather).__name__}"
    torch.testing.assert_close(ls, l1, **tol, msg=lambda m: f"{what}: losses: {m}")
    _compare(sharded, single, opt_s, opt_1, tol, what)
    assert not torch.equal(_full(sharded[1].weight), _full(_model(kind, seed, out)[1].weight))


def _gathered_bytes(rank, world, kind, gather=None):
    """Bytes all-gathered by FSDP2 in one fwd+bwd step."""
    import tritium as te
    from tritium import recipe
    from tritium.distributed import enable_fp8_all_gather
    model = _model(kind, 3, dtype=torch.bfloat16)
    if gather is not None:
        enable_fp8_all_gather(model, gather)
    _shard(model)
    with all_gather_sizes() as sizes:
        x, t = _batch(0, world, rank, H, torch.bfloat16)
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            y = model(x)
        _loss(y, t, 1).backward()
    assert sizes, "no all-gather seen"
    return sum(sizes)


def _check_dcp_same_size(rank, world, ckpt, out_file):
    """Train 3 steps, save, train 2; a fresh model loading the checkpoint trains the same 2
    steps bit for bit. Rank 0 writes the 2 losses for the other world sizes."""
    import tritium as te
    from tritium import recipe
    from tritium.distributed import checkpointing
    rcp = recipe.DelayedScaling(amax_history_len=4)
    model = _shard(_model("fp8", 11))
    opt = te.optimizers.FusedAdam(model.parameters(), lr=LR, master_weights=True)
    _train(model, opt, world, rank, steps=3, rcp=rcp)
    checkpointing.save(ckpt, model, opt)
    after = _train(model, opt, world, rank, steps=2, start=3, rcp=rcp)
    fresh = _shard(_model("fp8", 12))                        # other init: the load must matter
    opt2 = te.optimizers.FusedAdam(fresh.parameters(), lr=LR, master_weights=True)
    checkpointing.load(ckpt, fresh, opt2, fp8_recipe=rcp)
    resumed = _train(fresh, opt2, world, rank, steps=2, start=3, rcp=rcp)
    assert torch.equal(after, resumed), (after, resumed)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(_full(p), _full(q)), name
        m1, m2 = opt.get_master_param(p), opt2.get_master_param(q)
        assert (m1 is None) == (m2 is None) and (m1 is None or torch.equal(_full(m1), _full(m2)))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(opt.state[p][key]), _full(opt2.state[q][key])), (name, key)
    for a, b in zip(model.modules(), fresh.modules()):
        if hasattr(a, "fp8_meta") and a.fp8_meta.fwd is not None:
            assert torch.equal(a.fp8_meta.fwd.scale, b.fp8_meta.fwd.scale)
            assert torch.equal(a.fp8_meta.bwd.amax_history, b.fp8_meta.bwd.amax_history)
    # each rank's own optimizer state_dict (DTensor state) through torch.save and
    # torch.load(weights_only=True) into a fresh optimizer over the same sharded params
    import io
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt3 = te.optimizers.FusedAdam(model.parameters(), lr=LR, master_weights=True)
    opt3.load_state_dict(torch.load(buf, weights_only=True))
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert (value is None) == (opt3.state[p][key] is None)
            assert value is None or torch.equal(_full(value), _full(opt3.state[p][key])), key
    if rank == 0:
        torch.save(after, out_file)


def _check_dcp_other_size(rank, world, ckpt, losses_file):
    import tritium as te
    from tritium import recipe
    from tritium.distributed import checkpointing
    rcp = recipe.DelayedScaling(amax_history_len=4)
    model = _shard(_model("fp8", 13))
    opt = te.optimizers.FusedAdam(model.parameters(), lr=LR, master_weights=True)
    checkpointing.load(ckpt, model, opt, fp8_recipe=rcp)
    resumed = _train(model, opt, world, rank, steps=2, start=3, rcp=rcp)
    expected = torch.load(losses_file, weights_only=True)
    torch.testing.assert_close(resumed, expected, rtol=1e-5, atol=1e-6)


def _check_ddp(rank, world):
    """DDP + amax reduction over the data-parallel ranks vs the single-device run."""
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    from torch.nn.parallel import DistributedDataParallel as DDP
    from testlib import fp8_state
    rcp = recipe.DelayedScaling(amax_history_len=4)
    single, model = _model("fp32", 5), _model("fp32", 5)
    ddp = DDP(model)

    def sum_hook(state, bucket):   # sum, not average, over ranks: see _shard
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda fut: fut.value()[0])
    ddp.register_comm_hook(None, sum_hook)
    opt_1 = te.optimizers.FusedAdam(single.parameters(), lr=LR)
    opt_d = te.optimizers.FusedAdam(ddp.parameters(), lr=LR)
    for step in range(3):
        for net, opt, r in ((single, opt_1, None), (ddp, opt_d, rank)):
            x, t = _batch(step, world, r, H, torch.float32)
            with te.fp8_autocast(fp8_recipe=rcp, fp8_group=dist.group.WORLD):
                y = net(x)
            _loss(y, t, 1).backward()
            opt.step()
            opt.zero_grad()
    mine = fp8_state([model])
    for t in mine:                               # identical on every rank, bit for bit
        others = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(others, t)
        assert all(torch.equal(o, t) for o in others)
    for a, b in zip(mine, fp8_state([single])):  # and equal to the single device's
        torch.testing.assert_close(a, b, **FP32)
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p, q, **FP32)


def _check_errors(rank, world):
    import tritium as te
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.device_mesh import init_device_mesh
    from tritium.distributed import enable_fp8_all_gather
    model = _shard(_model("fp32", 1))
    opt = te.optimizers.FusedAdam(model.parameters(), lr=LR)
    w = model[1].weight
    before = _full(w).clone()
    w.grad = torch.ones(w.shape)                                   # plain grad on a DTensor
    with pytest.raises(TypeError, match="plain"):
        opt.step()
    w.grad = DTensor.from_local(torch.ones(w.shape), w.device_mesh, [Replicate()])
    with pytest.raises(ValueError, match="redistribute"):
        opt.step()
    mesh1 = init_device_mesh("cpu", (world,))                     # another mesh object
    w.grad = DTensor.from_local(torch.ones(w._local_tensor.shape), mesh1, [Shard(1)],
                                shape=w.shape, stride=w.stride(), run_check=False)
    with pytest.raises(ValueError, match="placements"):
        opt.step()
    assert torch.equal(_full(w), before) and not opt.state
    with pytest.raises(RuntimeError, match="before fully_shard"):
        enable_fp8_all_gather(model)
    # FP8 params need the amaxes reduced over a group containing the shard group: checked
    # before the all-gather (so on every rank, before any collective of the step)
    import torch.distributed as dist
    from tritium import recipe
    groups = [dist.new_group([r]) for r in range(world)]          # every rank creates each
    fp8 = _shard(_model("fp8", 2))
    x = torch.randn(4, H)
    for rcp, group, match in ((recipe.DelayedScaling(reduce_amax=False), None, "reduce_amax"),
                              (recipe.DelayedScaling(), groups[rank], "fp8_group")):
        with pytest.raises(ValueError, match=match):
            with te.fp8_autocast(fp8_recipe=rcp, fp8_group=group):
                fp8(x)


def _check_smoke(rank, world):
    """One FP8 step of MultiheadAttention, TransformerLayer (also with FP8 params) and a
    converted HF Llama under FSDP2 with FusedAdam: finite loss, weights changed."""
    import tritium as te
    from torch.distributed.fsdp import fully_shard
    from tritium import recipe
    torch.manual_seed(3)
    layers = [te.MultiheadAttention(H, 2, attention_dropout=0.0, device="cpu",
                                    attn_mask_type="causal", params_dtype=torch.float32),
              te.TransformerLayer(H, F, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                  device="cpu")]
    with te.fp8_model_init(recipe=recipe.DelayedScaling()):        # FP8 params, fused QKV
        layers.append(te.TransformerLayer(H, F, 2, num_gqa_groups=1, hidden_dropout=0.0,
                                          attention_dropout=0.0, normalization="RMSNorm",
                                          activation="swiglu", bias=False,
                                          fuse_qkv_params=True, device="cpu"))
    recipes = [recipe.Float8CurrentScaling()] * 2 + [recipe.DelayedScaling()]
    for layer, rcp in zip(layers, recipes):
        fully_shard(layer)
        opt = te.optimizers.FusedAdam(layer.parameters(), lr=LR, master_weights=True)
        before = [_full(p).clone() for p in layer.parameters()]
        x = torch.randn(16, 2, H, generator=torch.Generator().manual_seed(rank))
        with te.fp8_autocast(fp8_recipe=rcp):
            y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        y.float().pow(2).mean().backward()
        opt.step()
        assert any(not torch.equal(b, _full(p)) for b, p in zip(before, layer.parameters()))
    transformers = pytest.importorskip("transformers")
    from tritium.integrations.hf import convert_llama
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=F,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(4)
    llama = convert_llama(transformers.LlamaForCausalLM(cfg))
    for block in llama.model.layers:
        fully_shard(block)
    fully_shard(llama)
    opt = te.optimizers.FusedAdam(llama.parameters(), lr=1e-3, master_weights=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        loss = llama(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def _check_meta_fp8_params(rank, world):
    """FP8 params built on the meta device, sharded, made real by to_empty and initialized by
    reset_parameters: FSDP2's shards stay the params (filled in place, still Float8Tensors),
    every shard of a weight has the one scale of the amax over all shards (recorded in the
    weight's history slot), and a training step with FusedAdam masters runs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import tritium as te
    from tritium import recipe
    from tritium.fp8.tensor import Float8Tensor
    rcp = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(100 + rank)
    with te.fp8_model_init(recipe=rcp):
        m = te.LayerNormMLP(H, F, activation="swiglu", normalization="RMSNorm", bias=False,
                            device="meta")
    fully_shard(m)
    m.to_empty(device="cpu")
    ids = {n: id(p) for n, p in m.named_parameters()}
    m.reset_parameters()
    assert {n: id(p) for n, p in m.named_parameters()} == ids
    hist = m.fp8_meta.fwd.amax_history[0]
    for name, slot in (("fc1_weight", 1), ("fc2_weight", 3)):
        shard = getattr(m, name)._local_tensor
        assert isinstance(shard, Float8Tensor) and shard._data.abs().float().max() > 0
        top = shard.dequantize().abs().amax().float().reshape(1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        torch.testing.assert_close(top, hist[slot:slot + 1], rtol=1e-6, atol=0)
        scales = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(scales, shard._scale_inv.reshape(1))
        assert all(torch.equal(scales[0], x) for x in scales[1:]), scales
    before = m.fc1_weight._local_tensor._data.view(torch.uint8).clone()
    opt = te.optimizers.FusedAdam(m.parameters(), lr=1e-2, master_weights=True)
    with te.fp8_autocast(fp8_recipe=rcp):   # (grads scaled into E5M2's range: step 1's scale is 1)
        loss = m(torch.randn(G // world, H)).square().sum() * 1e4
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert not torch.equal(m.fc1_weight._local_tensor._data.view(torch.uint8), before)
    with te.fp8_model_init(recipe=recipe.Float8CurrentScaling()):
        cur = te.Linear(H, F, device="meta")
    fully_shard(cur)
    cur.to_empty(device="cpu")
    with pytest.raises(NotImplementedError, match="DelayedScaling only"):
        cur.reset_parameters()


# --------------------------------------------------------------------------- the workers
def _worker2(rank, world, ckpt, losses_file, ratio_file):
    from tritium import recipe
    cur, dly = recipe.Float8CurrentScaling(), recipe.DelayedScaling(amax_history_len=4)
    _check_errors(rank, world)
    _check_meta_fp8_params(rank, world)
    _check_training(rank, world, "fp32", out=38)                 # 38 rows: uneven at 4 ranks
    _check_training(rank, world, "bf16", tol=BF16, out=38, eps=1e-3)
    _check_training(rank, world, "fp8", rcp=dly)
    _check_training(rank, world, "fp8", rcp=dly, sgd=True)
    _check_training(rank, world, "fp32", rcp=dly)   # w8^T cast again in backward, after
    # FSDP2 freed the unsharded weight at the forward's end and gathered it again (the recast)
    _check_training(rank, world, "fp32", rcp=cur, micro=2)        # weight caching, cast per use
    _check_training(rank, world, "fp32", rcp=dly, micro=2)
    _check_training(rank, world, "fp32", rcp=cur, gather=cur)     # FP8 gather, precomputed
    _check_training(rank, world, "fp32", rcp=dly, gather=dly)
    bf16 = _gathered_bytes(rank, world, "bf16")
    fp8 = _gathered_bytes(rank, world, "fp8")
    hp8 = _gathered_bytes(rank, world, "bf16", gather=cur)
    if rank == 0:
        torch.save(torch.tensor([bf16, fp8, hp8]), ratio_file)
    _check_dcp_same_size(rank, world, ckpt, losses_file)
    _check_ddp(rank, world)
    _check_smoke(rank, world)


def _worker4(rank, world, ckpt, losses_file):
    from tritium import recipe
    _check_training(rank, world, "fp32", out=38)
    _check_training(rank, world, "fp8", rcp=recipe.DelayedScaling(amax_history_len=4))
    cur = recipe.Float8CurrentScaling()
    _check_training(rank, world, "fp32", rcp=cur, gather=cur)
    _check_dcp_other_size(rank, world, ckpt, losses_file)


def _worker1(rank, world, ckpt, losses_file):
    _check_dcp_other_size(rank, world, ckpt, losses_file)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    paths = (str(d / "ckpt"), str(d / "losses.pt"), str(d / "bytes.pt"))
    _spawn(_worker2, 2, *paths)
    return paths


def test_fsdp_ddp_dcp_two_ranks(two_ranks):
    bf16, fp8, hp8 = torch.load(two_ranks[2], weights_only=True).tolist()
    assert fp8 <= 0.6 * bf16, (fp8, bf16)
    assert hp8 <= 0.6 * bf16, (hp8, bf16)


def test_fsdp_four_ranks_and_resume_from_two(two_ranks):
    _spawn(_worker4, 4, two_ranks[0], two_ranks[1])


def test_resume_from_two_ranks_on_one(two_ranks):
    _spawn(_worker1, 1, two_ranks[0], two_ranks[1])


# --------------------------------------------------------------------------- in-process
class _Mesh:
    def __init__(self, n):
        self.n = n

    def size(self, dim=None):
        return self.n


def _gather(shards, world, outer_size):
    inputs, metas = zip(*(s.fsdp_pre_all_gather(_Mesh(world), outer_size, None, None, None)
                          for s in shards))
    assert len({t[0].shape for t in inputs}) == 1      # every shard padded to FSDP's rows
    assert all(t[0].dtype == torch.uint8 for t in inputs)
    gathered = (torch.cat([t[0] for t in inputs]),)
    return gathered, metas[0]


def test_fp8_all_gather_uneven_shards(randn):
    """48 rows over 5 ranks (10, 10, 10, 10, 8): shards made by FSDP's chunk stay FP8, the
    gather pads the short one and drops the padding, the transpose is made from the result (by
    its first reader), and a later gather into the same output (out=) refreshes it."""
    from tritium.fp8.tensor import Float8Tensor
    w = randn(48, 32)
    scale = torch.tensor([448.0]) / w.abs().max()
    full = Float8Tensor.quantize(w, scale, torch.float8_e4m3fn, with_transpose=True)
    shards = torch.chunk(full, 5, dim=0)
    assert all(isinstance(s, Float8Tensor) and s._transpose is None for s in shards)
    assert [s.shape[0] for s in shards] == [10, 10, 10, 10, 8]
    gathered, meta = _gather(shards, 5, full.shape)
    out, inner = shards[0].fsdp_post_all_gather(gathered, meta, torch.bfloat16)
    assert isinstance(out, Float8Tensor) and out.shape == full.shape and out.dtype == torch.bfloat16
    assert torch.equal(out._data.view(torch.uint8), full._data.view(torch.uint8))
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(out.transpose_data()), bits(full._data.t()))
    assert torch.equal(out._scale_inv, full._scale_inv)
    new = Float8Tensor.quantize(randn(48, 32), scale, torch.float8_e4m3fn)
    gathered[0].copy_(torch.cat([s.fsdp_pre_all_gather(_Mesh(5), full.shape)[0][0]
                                 for s in torch.chunk(new, 5, dim=0)]))
    assert shards[0].fsdp_post_all_gather(gathered, meta, torch.bfloat16, out=out) is None
    assert torch.equal(bits(out.transpose_data()), bits(new._data.t()))


def test_high_precision_weight_gathered_as_fp8(randn):
    """enable_fp8_all_gather: each shard is cast with the weight's one scale (current scaling:
    the amax of the whole weight; delayed: the module's weight scale, recording the shard amax),
    so the gathered FP8 weight equals the single-device cast of the whole weight."""
    import tritium as te
    from tritium import recipe
    from tritium.distributed import enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
    from tritium.fp8.tensor import Float8Tensor
    for rcp in (recipe.Float8CurrentScaling(), recipe.DelayedScaling(amax_history_len=4)):
        lin = te.Linear(32, 48, device="cpu")
        enable_fp8_all_gather(lin, rcp)
        w = lin.weight
        assert type(w).__name__ == "FP8AllGatherWeight" and w.dtype == torch.float32
        hp = w._hp_shard.clone()
        shards = torch.chunk(w.detach(), 5, dim=0)                  # what FSDP makes of it
        assert all(type(s).__name__ == "FP8AllGatherWeight" for s in shards)
        if isinstance(rcp, recipe.Float8CurrentScaling):
            precompute_fp8_scales_for_fsdp(lin)                      # no mesh: no collective
            scale = torch.tensor([448.0]) / hp.abs().max()
        else:
            lin.fp8_meta.prepare(rcp, w.device)
            lin.fp8_meta.fwd.scale.fill_(8.0)
            scale = torch.tensor([8.0])
        gathered, meta = _gather(shards, 5, w.shape)
        out, _ = shards[0].fsdp_post_all_gather(gathered, meta, torch.float32)
        ref = Float8Tensor.quantize(hp, scale, torch.float8_e4m3fn)
        assert isinstance(out, Float8Tensor)
        assert torch.equal(out._data.view(torch.uint8), ref._data.view(torch.uint8))
        assert torch.equal(out._scale_inv, ref._scale_inv)
        if isinstance(rcp, recipe.DelayedScaling):                  # every shard's amax recorded
            assert torch.equal(lin.fp8_meta.fwd.amax_history[0, 1:2], hp.abs().max().reshape(1))
        with torch.no_grad():
            w.mul_(2)                                   # in place on the wrapped tensor
        assert torch.equal(w._hp_shard, 2 * hp)


def test_delayed_gather_in_backward_uses_the_forward_scale(randn):
    """FSDP2 gathers a resharded weight again in backward, after fp8_autocast's exit updated
    the delayed scale: that gather casts with the forward gather's scale (dgrad and a recompute
    read the forward's fp8 weight) and records no amax; the next forward uses the new scale."""
    import tritium as te
    from tritium import recipe
    from tritium.distributed import enable_fp8_all_gather
    rcp = recipe.DelayedScaling(amax_history_len=4)
    lin = te.Linear(32, 48, device="cpu")
    enable_fp8_all_gather(lin, rcp)
    lin.fp8_meta.prepare(rcp, lin.weight.device)
    shards = torch.chunk(lin.weight.detach(), 4, dim=0)
    fwd = lin.fp8_meta.fwd
    fwd.scale.fill_(4.0)
    forward = _gather(shards, 4, lin.weight.shape)[1][1]          # (rows, scale_inv)
    fwd.scale.fill_(16.0)                                          # the exit's update
    fwd.amax_history.zero_()
    seen = []

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(_gather(shards, 4, lin.weight.shape)[1][1])
            return g
    x = torch.zeros(1, requires_grad=True)
    InBackward.apply(x).sum().backward()
    assert torch.equal(forward, torch.tensor([0.25])) and torch.equal(seen[0], forward)
    assert not fwd.amax_history.any()                               # nothing recorded
    assert torch.equal(_gather(shards, 4, lin.weight.shape)[1][1], torch.tensor([1 / 16]))


def test_optimizer_steps_wrapped_weight(randn):
    """FusedAdam on a model whose weights are wrapped (no FSDP): it steps the wrapped tensor."""
    import tritium as te
    from tritium.distributed import enable_fp8_all_gather
    torch.manual_seed(0)
    plain = te.Linear(32, 16, device="cpu")
    wrapped = te.Linear(32, 16, device="cpu")
    wrapped.load_state_dict(plain.state_dict())
    enable_fp8_all_gather(wrapped)
    opts = [te.optimizers.FusedAdam(m.parameters(), lr=LR) for m in (plain, wrapped)]
    x = randn(4, 32)
    init = plain.weight.detach().clone()
    for m, opt in zip((plain, wrapped), opts):
        m(x).pow(2).sum().backward()
        opt.step()
    assert not torch.equal(plain.weight, init)
    torch.testing.assert_close(wrapped.weight._hp_shard, plain.weight.detach(), rtol=0, atol=0)


def test_refusals_of_sharded_scaled_states_and_current_scaled_fp8_weights():
    """Two combinations that cannot be exact under sharding are refused with the fix named,
    before any state exists: FusedAdam's fp16 / FP8 states on DTensor params (one per-rank
    factor table, which DCP would save as replicated), and FP8 weights made under
    Float8CurrentScaling sharded by fully_shard (each shard would take its own scale)."""
    import tritium as te
    from tritium import recipe
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lin = te.Linear(32, 16, params_dtype=torch.bfloat16, device="cpu")
        fully_shard(lin)
        with pytest.raises(ValueError, match="not supported with DTensor"):
            te.optimizers.FusedAdam(lin.parameters(), master_weights=True,
                                    exp_avg_dtype=torch.uint8)
        opt = te.optimizers.FusedAdam(lin.parameters(), master_weights=True)
        assert not opt.state                                       # the plain one is accepted
        with te.fp8_model_init(enabled=True, recipe=recipe.Float8CurrentScaling()):
            fp8 = te.Linear(32, 16, device="cpu")
        fully_shard(fp8)
        with pytest.raises(ValueError, match="cannot be sharded"):
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
                fp8(torch.randn(4, 32))
        dist.barrier()   # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
