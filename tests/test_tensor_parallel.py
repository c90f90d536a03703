"""cpu tier: tensor + sequence parallelism over gloo (2 and 4 processes) vs the unsharded module.

One process group per world size is spawned (module-scoped fixture) and runs every case. In a
case each rank builds the TP module with its own random init (so the shards differ), gathers
the full state dict (`gather_full_state_dict`), loads it into the same module built with
tp_size=1, and runs both on the same full data: the TP side on its shard of the input
(sequence rows under SP, hidden columns for a row-parallel Linear). Rank 0 saves, per case,
the TP results made whole again (outputs, input grads, parameter grads unsharded) next to the
unsharded module's; the tests compare them at TE's fp32 tolerance, in high precision and under
emulated FP8 delayed scaling (2 steps, so the second runs on updated scales; amaxes reduced
over `fp8_group` = the TP group; with fp8_mha also FP8 attention, whose output the row-parallel
projection takes in E4M3). For FP8 the scale and amax-history tensors of every rank are also
gathered (FP8 attention's too): identical bit for bit across ranks, and equal to the unsharded
module's.
Also: shard_state_dict round trip, DeviceMesh groups, te.distributed.checkpoint (recompute ==
no recompute, FP8 state included), CudaRNGStatesTracker, and the misconfiguration errors.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from testlib import FP32_TOL, fp8_states, free_port, gloo_group, spawn

pytestmark = pytest.mark.cpu

S, B = 8, 2   # sequence, batch (sbhd)

KINDS = ("linear-col", "linear-row", "lnlinear", "lnmlp-gelu", "lnmlp-swiglu", "mha",
         "layer-llama", "layer-te")
# layer-bshd: sequence parallelism splits dim 0, which for bshd is the batch
CASES2 = [f"{k}/{'sp' if sp else 'tp'}/{'fp8' if f else 'hp'}" for k in KINDS
          for sp in (False, True) for f in (False, True)] + [
              "layer-bshd/sp/hp", "layer-bshd/sp/fp8", "layer-postln/sp/hp",
              # FP8 attention handing the row-parallel projection its E4M3 output (fp8_mha)
              "mha/tp/fp8mha", "layer-llama/sp/fp8mha"]
CASES4 = ["linear-col/sp/fp8", "linear-row/sp/fp8", "lnmlp-swiglu/sp/fp8", "layer-llama/sp/fp8",
          "layer-te/tp/hp"]



def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# --------------------------------------------------------------------------- worker side
def _build(kind, tp: dict, world: int, device="cpu", dtype=torch.float32):
    """The module of `kind`; tp = {} builds the unsharded reference (same parameter names)."""
    import tritium as te
    common = dict(device=device, params_dtype=dtype, **tp)
    heads, groups = (8, 4) if world == 4 else (4, 2)
    if kind == "linear-col":
        return te.Linear(32, 64, parallel_mode="column", **common), 32
    if kind == "linear-row":
        return te.Linear(64, 32, parallel_mode="row", **common), 64
    if kind == "lnlinear":
        return te.LayerNormLinear(32, 64, normalization="RMSNorm", parallel_mode="column",
                                  parameters_split={"query": 32, "key": 16, "value": 16},
                                  **common), 32
    if kind.startswith("lnmlp"):
        act = kind.split("-")[1]
        return te.LayerNormMLP(32, 64, activation=act, set_parallel_mode=True, **common), 32
    if kind == "mha":
        return te.MultiheadAttention(64, heads, num_gqa_groups=groups, attention_dropout=0.0,
                                     input_layernorm=True, fuse_qkv_params=True,
                                     set_parallel_mode=True, **common), 64
    if kind in ("layer-llama", "layer-bshd"):
        return te.TransformerLayer(64, 128, heads, num_gqa_groups=groups, hidden_dropout=0.0,
                                   attention_dropout=0.0, normalization="RMSNorm",
                                   activation="swiglu", bias=False, fuse_qkv_params=True,
                                   qkv_weight_interleaved=False, set_parallel_mode=True,
                                   attn_input_format="bshd" if kind == "layer-bshd" else "sbhd",
                                   **common), 64
    # layer-te: TE's defaults (LayerNorm, gelu, bias, q/k/v split); layer-postln: the output
    # norm on this rank's rows under SP
    return te.TransformerLayer(64, 128, heads, num_gqa_groups=groups, hidden_dropout=0.0,
                               attention_dropout=0.0, set_parallel_mode=True,
                               output_layernorm=kind == "layer-postln", **common), 64


def _gather(t, dim, group):
    from tritium.distributed.tensor_parallel import all_gather_dim0
    return all_gather_dim0(t.movedim(dim, 0).contiguous(), group).movedim(0, dim)


def _module_case(name, group, world, rank, device="cpu", dtype=torch.float32):
    """(also run on 2 GPUs by tests/gpu/test_gpu_tensor_parallel.py, in bf16)"""
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    from tritium.distributed import tensor_parallel as T
    kind, mode, prec = name.split("/")
    sp, fp8 = mode == "sp", prec.startswith("fp8")
    torch.manual_seed(_seed(name) + rank)          # a different init on every rank
    tp_mod, hidden = _build(kind, dict(tp_group=group, sequence_parallel=sp), world, device,
                            dtype)
    full_sd = T.gather_full_state_dict(tp_mod)
    local_sd = tp_mod.state_dict()
    back = T.shard_state_dict(tp_mod, full_sd)
    roundtrip = all(torch.equal(back[k], v) for k, v in local_sd.items()
                    if isinstance(v, torch.Tensor))
    ref, _ = _build(kind, {}, world, device, dtype)
    ref.load_state_dict(full_sd)
    col = kind in ("linear-col", "lnlinear")
    in_dim = -1 if kind == "linear-row" else (0 if sp else None)
    out_dim = -1 if col else (0 if sp else None)
    out_blocks = (32, 16, 16) if kind == "lnlinear" else (64,)
    rcp = recipe.DelayedScaling(amax_history_len=4, fp8_mha=prec == "fp8mha")
    g = torch.Generator().manual_seed(_seed(name))  # the same data on every rank
    kw = {}
    if kind in ("layer-llama", "layer-bshd"):  # bshd: x [S, B, h] is read as [batch, seq, h]
        rope = te.RotaryPositionEmbedding(64 // (8 if world == 4 else 4))
        kw["rotary_pos_emb"] = rope(S if kind == "layer-llama" else B).to(device)
    got, want = [], []
    for step in range(2 if fp8 else 1):
        x = (torch.randn(S, B, hidden, generator=g) * (1 + step)).to(device, dtype)
        out_features = 32 if kind == "linear-row" or kind.startswith("lnmlp") else 64
        dy = torch.randn(S, B, out_features, generator=g).to(device, dtype)
        x_loc = x if in_dim is None else x.chunk(world, in_dim)[rank]
        if out_dim == -1:   # column outputs: this rank's chunk of each block of features
            dy_loc = T.shard_tensor(dy, -1, out_blocks, world, rank)
        else:
            dy_loc = dy if out_dim is None else dy.chunk(world, out_dim)[rank]
        leaves = (x.clone().requires_grad_(), x_loc.clone().requires_grad_())
        outs = []
        for mod, leaf, d in ((ref, leaves[0], dy), (tp_mod, leaves[1], dy_loc)):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=rcp, fp8_group=group):
                y = mod(leaf, **kw)
            y.backward(d)
            outs.append(y.detach())
        y_ref, y_tp = outs
        gx = leaves[1].grad
        if out_dim == -1:
            shards = _gather(y_tp, -1, group).chunk(world, -1)
            y_tp = T.unshard_tensor(shards, -1, out_blocks, world)
        elif out_dim is not None:
            y_tp = _gather(y_tp, out_dim, group)
        if in_dim is not None:
            gx = _gather(gx, in_dim, group)
        got += [y_tp, gx]
        want += [y_ref, leaves[0].grad]
    sharded = T._sharded_params(tp_mod)
    ref_params = dict(ref.named_parameters())
    for pname, p in tp_mod.named_parameters():
        grad = p.grad
        if pname in sharded:
            dim, blocks, _ = sharded[pname]
            shards = _gather(grad, dim, group).chunk(world, dim)
            grad = T.unshard_tensor(shards, dim, blocks, world)
        got.append(grad)
        want.append(ref_params[pname].grad)
    res = {"got": got, "want": want, "roundtrip": roundtrip}
    if fp8:
        states = fp8_states(tp_mod)
        every = [[torch.empty_like(s) for _ in range(world)] for s in states]
        for s, lst in zip(states, every):
            dist.all_gather(lst, s, group=group)
        res["same_across_ranks"] = all(torch.equal(lst[0], t) for lst in every for t in lst)
        res["states"], res["ref_states"] = states, fp8_states(ref)
        res["scales_moved"] = any(not torch.all(s == 1) for s in states[::2])
    return res


def _mesh_case(group, world, rank):
    """A column-parallel SP Linear on a 1-D DeviceMesh and on the 'tp' dim of a 2-D mesh gives
    the ProcessGroup's results bit for bit."""
    import tritium as te
    from torch.distributed.device_mesh import init_device_mesh
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(5)).chunk(world)[rank]
    outs = []
    for tp_group in (group, mesh1, mesh2, mesh2["tp"]):
        torch.manual_seed(11 + rank)
        m = te.Linear(32, 64, parallel_mode="column", sequence_parallel=True, tp_group=tp_group,
                      device="cpu")
        outs.append(m(x))
    return all(torch.equal(outs[0], o) for o in outs[1:])


def _current_scaling_case(group, world, rank):
    """Float8CurrentScaling, column-parallel SP Linear: the gathered input is cast with ONE
    scale from the amax of the whole (all ranks') input; the output columns and wgrad equal the
    independent emulation (testlib) with that scale and the local weight's and dy's scales."""
    import tritium as te
    from tritium import recipe
    from testlib import E4M3, E5M2, current_scale, emulated_linear
    torch.manual_seed(21 + rank)
    lin = te.Linear(32, 64, parallel_mode="column", sequence_parallel=True, tp_group=group,
                    device="cpu")
    g = torch.Generator().manual_seed(22)
    x = torch.randn(S, B, 32, generator=g)
    x[0, 0, 0] = 9.0 if rank == 0 else 1.0          # the largest |x| is in rank 0's rows
    dy = torch.randn(S, B, 64 // world, generator=g)
    leaf = x.chunk(world)[rank].clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = lin(leaf)
    y.backward(dy)
    want_y, _, want_dw, _ = emulated_linear(
        x, lin.weight.detach(), lin.bias.detach(), dy, current_scale(x, E4M3),
        current_scale(lin.weight, E4M3), current_scale(dy, E5M2), E4M3, E5M2)
    return {"got": [y.detach(), lin.weight.grad], "want": [want_y, want_dw]}


def _current_scaling_row_case(group, world, rank):
    """Float8CurrentScaling, row-parallel SP Linear: the backward gathers the grad rows as fp8
    cast with ONE scale from the amax of the whole (all ranks') grad; dgrad (this rank's input
    features) and wgrad equal the independent emulation with that scale."""
    import tritium as te
    from tritium import recipe
    from testlib import E4M3, E5M2, current_scale, emulated_linear
    torch.manual_seed(31 + rank)
    lin = te.Linear(64, 32, bias=False, parallel_mode="row", sequence_parallel=True,
                    tp_group=group, device="cpu")
    g = torch.Generator().manual_seed(32)
    x = torch.randn(S, B, 64, generator=g)
    dy = torch.randn(S, B, 32, generator=g)
    dy[-1, 0, 0] = 40.0                             # the largest |dy| is in the last rank's rows
    f = 64 // world
    leaf = x[..., rank * f:(rank + 1) * f].clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = lin(leaf)
    y.backward(dy.chunk(world)[rank])
    w = lin.weight.detach()
    _, want_dx, want_dw, _ = emulated_linear(
        leaf.detach(), w, None, dy, current_scale(leaf, E4M3), current_scale(w, E4M3),
        current_scale(dy, E5M2), E4M3, E5M2)
    return {"got": [leaf.grad, lin.weight.grad], "want": [want_dx, want_dw]}


def _pair_cast_case(group, world, rank):
    """A TP + SP LayerNormMLP under FP8 delayed scaling casts fc1's and fc2's weight shards in
    one pair cast (host time: one launch less): two steps' outputs, grads, amax histories and
    scales hold the bits of the two separate casts (the pair cast switched off)."""
    import importlib
    import tritium as te
    from tritium import recipe
    from testlib import fp8_states
    lnmlp = importlib.import_module("tritium.modules.layernorm_mlp")
    real, used = lnmlp.cast_weights_together, []

    def spy(plans, weights, need_t, rows=None):
        out = real(plans, weights, need_t, rows)
        used.append(all(p.weight_ready is not None for p in out))
        return out

    def run(pair):
        lnmlp.cast_weights_together = spy if pair else \
            (lambda plans, weights, need_t, rows=None: plans)
        torch.manual_seed(41 + rank)
        m = te.LayerNormMLP(32, 64, normalization="RMSNorm", activation="swiglu", bias=False,
                            set_parallel_mode=True, sequence_parallel=True, tp_group=group,
                            device="cpu")
        g = torch.Generator().manual_seed(42 + rank)
        x = torch.randn(S // world, B, 32, generator=g, requires_grad=True)
        outs = []
        for step in range(2):
            x.grad = None
            m.zero_grad(set_to_none=True)
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4),
                                 fp8_group=group):
                y = m(x * (1 + step))
            y.backward(torch.randn(y.shape, generator=g))
            outs += [y.detach(), x.grad, *(p.grad for p in m.parameters())]
        return outs + fp8_states(m)
    try:
        separate, paired = run(False), run(True)
    finally:
        lnmlp.cast_weights_together = real
    return {"used": used, "separate": separate, "paired": paired}


def _init_case(group, world, rank):
    """With get_rng_state_tracker (seeded per rank) the shards are initialised in its fork and
    differ across ranks although the default generator is seeded alike."""
    import torch.distributed as dist
    import tritium as te
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 500 + rank)
    torch.manual_seed(1)
    mlp = te.LayerNormMLP(32, 64, tp_group=group, set_parallel_mode=True, device="cpu",
                          get_rng_state_tracker=lambda: tracker)
    w = [torch.empty_like(mlp.fc1_weight) for _ in range(world)]
    dist.all_gather(w, mlp.fc1_weight.detach(), group=group)
    return all(not torch.equal(w[0], v) for v in w[1:])


def _checkpoint_case(group, world, rank):
    """te.distributed.checkpoint around a TP+SP TransformerLayer under FP8 (3 steps, with
    hidden dropout in the tracker's fork) == no recompute: outputs, input and param grads, FP8
    state. The same with distribute_saved_activations on a replicated input, and a negative
    control: torch's plain checkpoint recomputes with the updated scales and differs."""
    import torch.utils.checkpoint as tuc
    import tritium as te
    from tritium import recipe
    tracker = te.CudaRNGStatesTracker()

    def run(how):
        torch.manual_seed(3 + rank)
        tracker.reset()
        tracker.add("model-parallel-rng", 1000 + rank)
        layer = te.TransformerLayer(64, 128, 4, num_gqa_groups=2, hidden_dropout=0.25,
                                    attention_dropout=0.0, normalization="RMSNorm",
                                    activation="swiglu", tp_group=group, sequence_parallel=True,
                                    set_parallel_mode=True, get_rng_state_tracker=lambda: tracker,
                                    device="cpu")
        torch.manual_seed(77)
        rcp = recipe.DelayedScaling(amax_history_len=4)
        g = torch.Generator().manual_seed(9)
        res = []
        for step in range(3):
            x = torch.randn(S, B, 64, generator=g).chunk(world)[rank].requires_grad_()
            with te.fp8_autocast(fp8_recipe=rcp, fp8_group=group):
                if how == "none":
                    y = layer(x, is_first_microbatch=step == 0)
                elif how == "torch":
                    y = tuc.checkpoint(lambda t: layer(t, is_first_microbatch=step == 0), x,
                                       use_reentrant=True)
                else:
                    y = te.distributed.checkpoint(layer, x, get_rng_state_tracker=lambda: tracker,
                                                  use_reentrant=how != "non-reentrant",
                                                  is_first_microbatch=step == 0)
            y.backward(torch.randn(y.shape, generator=g))
            res += [y.detach(), x.grad]
        return res + [p.grad for p in layer.parameters()] + fp8_states(layer)

    base = run("none")
    eq = lambda a, b: len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))  # noqa
    out = {"reentrant": eq(base, run("reentrant")), "non-reentrant": eq(base, run("non-reentrant")),
           "torch-differs": not eq(base, run("torch"))}
    # distribute_saved_activations: a replicated input saved as 1/tp, gathered for the recompute
    torch.manual_seed(4)
    mlp = te.LayerNormMLP(32, 64, activation="swiglu", tp_group=group, set_parallel_mode=True,
                          device="cpu")
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(6))
    dy = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(7))
    grads = []
    for dist_saved in (None, True):
        leaf = x.clone().requires_grad_()
        mlp.zero_grad()
        y = (mlp(leaf) if dist_saved is None else te.distributed.checkpoint(
            mlp, leaf, distribute_saved_activations=True, tp_group=group))
        y.backward(dy)
        grads.append([y.detach(), leaf.grad] + [p.grad.clone() for p in mlp.parameters()])
    out["distributed"] = eq(*grads)
    return out


def _rng_case(group, world, rank):
    """Masks outside fork: the same on every rank; inside: different per rank; the default
    stream after a fork is what it would have been without it; states replay."""
    import torch.distributed as dist
    import tritium as te
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 2000 + rank)
    ones = torch.ones(256)
    torch.manual_seed(42)
    outside = torch.nn.functional.dropout(ones, 0.5)
    saved = tracker.get_states()
    with tracker.fork():
        inside = torch.nn.functional.dropout(ones, 0.5)
    after = torch.nn.functional.dropout(ones, 0.5)
    torch.manual_seed(42)
    torch.nn.functional.dropout(ones, 0.5)
    after_plain = torch.nn.functional.dropout(ones, 0.5)
    tracker.set_states(saved)
    with tracker.fork():
        replay = torch.nn.functional.dropout(ones, 0.5)
    # MultiheadAttention draws its attention dropout (this rank's heads) from the fork
    mha = te.MultiheadAttention(64, 4, attention_dropout=0.5, tp_group=group,
                                set_parallel_mode=True, get_rng_state_tracker=lambda: tracker,
                                device="cpu")
    before = tracker.get_states()["model-parallel-rng"]
    default_before = torch.get_rng_state()
    mha(torch.randn(S, B, 64, generator=torch.Generator().manual_seed(3)))
    attn_fork = (not torch.equal(before, tracker.get_states()["model-parallel-rng"])
                 and torch.equal(default_before, torch.get_rng_state()))
    both = [torch.empty(2, 256) for _ in range(world)]
    dist.all_gather(both, torch.stack([outside, inside]), group=group)
    errors = {}
    for label, fn in (("dup-seed", lambda: tracker.add("other", 2000 + rank)),
                      ("dup-name", lambda: tracker.add("model-parallel-rng", 1)),
                      ("unknown", lambda: tracker.fork("nope").__enter__())):
        try:
            fn()
            errors[label] = "none"
        except Exception as exc:  # noqa: BLE001 - checked by the test
            errors[label] = type(exc).__name__
    return {"outside_same": all(torch.equal(both[0][0], b[0]) for b in both),
            "inside_differ": all(not torch.equal(both[0][1], b[1]) for b in both[1:]),
            "continues": torch.equal(after, after_plain), "replay": torch.equal(inside, replay),
            "attention_in_fork": attn_fork,
            "errors": errors}


def _errors(group, world, rank):
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    from tritium.distributed import tensor_parallel as T
    from torch.distributed.device_mesh import init_device_mesh
    solo = dist.new_group([0])
    sp_lin = te.Linear(32, 64, parallel_mode="column", tp_group=group, sequence_parallel=True,
                       device="cpu")

    def _sp_fp8(ctx):
        with ctx:
            sp_lin(torch.randn(4, 32))
    calls = {
        "size-mismatch": lambda: te.Linear(32, 64, parallel_mode="column", tp_group=group,
                                           tp_size=world + 1, device="cpu"),
        "mode": lambda: te.Linear(32, 64, parallel_mode="diagonal", tp_group=group, device="cpu"),
        "out-divisible": lambda: te.Linear(32, 63, parallel_mode="column", tp_group=group,
                                           device="cpu"),
        "heads": lambda: te.MultiheadAttention(48, 3, tp_group=group, set_parallel_mode=True,
                                               device="cpu"),
        "gqa": lambda: te.MultiheadAttention(64, 4, num_gqa_groups=1, tp_group=group,
                                             set_parallel_mode=True, device="cpu"),
        "ffn": lambda: te.LayerNormMLP(32, 63, tp_group=group, set_parallel_mode=True,
                                       device="cpu"),
        "mha-mode": lambda: te.MultiheadAttention(64, 4, tp_group=group, device="cpu"),
        "set-group": lambda: te.Linear(32, 64, parallel_mode="column", tp_group=group,
                                       device="cpu").set_tensor_parallel_group(solo),
        "mesh-2d": lambda: te.Linear(32, 64, parallel_mode="column", device="cpu",
                                     tp_group=init_device_mesh("cpu", (1, world),
                                                               mesh_dim_names=("dp", "x"))),
        "seq-scatter": lambda: T.scatter_to_sequence_parallel_region(torch.randn(3, 2, 4),
                                                                     group),
        "seq-row": lambda: te.Linear(64, 32, parallel_mode="row", tp_group=group,
                                     sequence_parallel=True, device="cpu")(
                                         torch.randn(3, 2, 64 // world)),
        "no-group": lambda: te.Linear(32, 64, parallel_mode="column", tp_size=2 * world,
                                      device="cpu")(torch.randn(2, 32)),
        "sp-scales": lambda: _sp_fp8(te.fp8_autocast(
            fp8_recipe=recipe.DelayedScaling(reduce_amax=False))),
        "sp-amax-group": lambda: _sp_fp8(te.fp8_autocast(fp8_group=solo)),
    }
    out = {}
    for label, fn in calls.items():
        try:
            fn()
            out[label] = ("none", "")
        except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
            out[label] = (type(exc).__name__, str(exc))
    dist.barrier()   # every rank is still in step: no error left a collective half-done
    return out


def _worker(rank, world, port, out_dir, cases):
    import torch.distributed as dist
    with gloo_group(rank, world, port):
        group = dist.group.WORLD
        results = {name: _module_case(name, group, world, rank) for name in cases}
        if world == 2:
            results["mesh"] = _mesh_case(group, world, rank)
            results["checkpoint"] = _checkpoint_case(group, world, rank)
            results["rng"] = _rng_case(group, world, rank)
            results["current"] = _current_scaling_case(group, world, rank)
            results["current_row"] = _current_scaling_row_case(group, world, rank)
            results["init"] = _init_case(group, world, rank)
            results["pair"] = _pair_cast_case(group, world, rank)
            results["errors"] = _errors(group, world, rank)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))


def _spawn(world, tmp_path_factory, cases):
    out = tmp_path_factory.mktemp(f"tp{world}")
    spawn(_worker, world, world, free_port(), str(out), cases)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, tmp_path_factory, tuple(CASES2))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, tmp_path_factory, tuple(CASES4))


# --------------------------------------------------------------------------- checks
def _check(name, res):
    assert res["roundtrip"], f"{name}: shard_state_dict(gather_full_state_dict(m)) != m's shards"
    assert len(res["got"]) == len(res["want"]) > 2
    for i, (a, b) in enumerate(zip(res["got"], res["want"])):
        assert a is not None and b is not None, (name, i)
        assert a.shape == b.shape, (name, i, a.shape, b.shape)
        assert b.abs().max() > 0, (name, i)
        torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"{name} tensor {i}: {m}")
    if name.split("/")[-1].startswith("fp8"):
        assert res["same_across_ranks"], f"{name}: FP8 scales / amax histories differ by rank"
        assert res["scales_moved"], f"{name}: the scales never left 1.0"
        for a, b in zip(res["states"], res["ref_states"]):
            torch.testing.assert_close(a, b, **FP32_TOL)


@pytest.mark.parametrize("name", CASES2)
def test_tp2_matches_unsharded(world2, name):
    _check(name, world2[name])


@pytest.mark.parametrize("name", CASES4)
def test_tp4_matches_unsharded(world4, name):
    _check(name, world4[name])


def test_device_mesh_groups(world2):
    assert world2["mesh"]


def test_checkpoint_recompute_equals_no_recompute(world2):
    res = world2["checkpoint"]
    assert res["reentrant"] and res["non-reentrant"], res
    assert res["distributed"], res
    assert res["torch-differs"], "the negative control (torch.utils.checkpoint) should differ"


def test_current_scaling_one_scale_for_the_gathered_input(world2):
    res = world2["current"]
    for i, (a, b) in enumerate(zip(res["got"], res["want"])):
        torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"tensor {i}: {m}")


def test_current_scaling_one_scale_for_the_gathered_grad(world2):
    res = world2["current_row"]
    for i, (a, b) in enumerate(zip(res["got"], res["want"])):
        torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"tensor {i}: {m}")


def test_mlp_weight_pair_cast_same_bits_under_tp_sp(world2):
    from testlib import assert_bits
    res = world2["pair"]
    assert res["used"] == [True, True]
    assert res["separate"][0].abs().max() > 0
    for i, (a, b) in enumerate(zip(res["separate"], res["paired"])):
        assert_bits(b, a, f"tensor {i}")


def test_tracker_initialises_different_shards(world2):
    assert world2["init"]


def test_rng_tracker(world2):
    res = world2["rng"]
    assert res["outside_same"] and res["inside_differ"], res
    assert res["continues"] and res["replay"] and res["attention_in_fork"], res
    assert res["errors"] == {"dup-seed": "ValueError", "dup-name": "ValueError",
                             "unknown": "KeyError"}


ERRORS = {
    "size-mismatch": ("ValueError", "tp_group has 2 ranks but tp_size=3"),
    "mode": ("ValueError", "parallel_mode must be None, 'column' or 'row'"),
    "out-divisible": ("ValueError", "out_features=63 is not divisible by tp_size=2"),
    "heads": ("ValueError", "num_attention_heads=3 is not divisible by tp_size=2"),
    "gqa": ("ValueError", "num_gqa_groups=1 is not divisible by tp_size=2"),
    "ffn": ("ValueError", "ffn_hidden_size=63 is not divisible by tp_size=2"),
    "mha-mode": ("ValueError", "needs set_parallel_mode=True"),
    "set-group": ("ValueError", "the group has 1 ranks but the module was built with tp_size=2"),
    "mesh-2d": ("ValueError", "without a dim named 'tp'"),
    "seq-scatter": ("ValueError", "not divisible by tp_size=2"),
    "seq-row": ("ValueError", "must be a multiple of tp_size"),
    "no-group": ("ValueError", "no tp_group was given and the default group has 2 ranks"),
    "sp-scales": ("ValueError", "use a recipe with reduce_amax=True"),
    "sp-amax-group": ("ValueError", "an fp8_group (fp8_autocast) that contains the TP group"),
}


@pytest.mark.parametrize("label", list(ERRORS))
def test_misconfiguration_errors(world2, label):
    kind, text = ERRORS[label]
    got_kind, got_text = world2["errors"][label]
    assert got_kind == kind and text in got_text, (label, got_kind, got_text)
