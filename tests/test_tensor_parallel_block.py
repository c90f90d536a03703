"""cpu tier: Float8BlockScaling under tensor / sequence parallelism (2 gloo processes, emulated
FP8) vs the unsharded module, and the fused norm / activation block casts under TP.

The structure of tests/test_tensor_parallel.py (one spawn runs every case): each rank builds the
TP module with its own random init, gathers the full state dict, loads it into the same module
built with tp_size=1, and runs both on the same full data under fp8_autocast(
Float8BlockScaling()). Sizes are multiples of 128 x tp (hidden 256, the split dims 512 -> 256
a rank), so every shard boundary falls on a 1x128 / 128x128 block edge and a rank's blocks are
blocks of the unsharded operands. 160 tokens: wgrad's token tiles are one whole and one
partial (the padded tail), under SP 80 rows a rank.

What is expected, and why. Block scales are local to their blocks, and with aligned shards a
rank quantizes exactly the blocks the unsharded module quantizes for its part (column: the
whole input x and its rows of the weight; row: its K-columns of x and of the weight; under
sequence parallelism the high-precision input, or the row GEMM's grad, is gathered first and
then quantized whole). So
  * BIT-IDENTICAL: every tensor whose GEMMs reduce over a dim that is whole on each rank: the
    column GEMM's output (K whole), the row GEMM's dgrad (its N is whole), every wgrad (the
    tokens are whole), the bias gradients summed over whole tokens; and what follows from those
    without another split sum (LayerNormMLP's fc1 wgrad: fc2's dgrad, the activation's
    backward, all exact).
  * fp32 TOLERANCE (TE's): where a reduction dim is split over the ranks and finished by an
    all-reduce / reduce-scatter: the row GEMM's output (K split: each rank sums its 128-slices,
    the ranks' partial sums are then added, the unsharded GEMM adds slice by slice), the column
    GEMM's dgrad (N split), the norm gradients downstream of it, and under SP the replicated
    biases and norm weights whose gradients are all-reduced from each rank's rows.
The fused norm / activation block casts run under TP where they are exact (spies prove it) and
give the unfused chain's bits (the same TP module with fused_casts(False)). Block FP8 params
(fp8_model_init) load their shards of a full block-FP8 state dict with its fp8 bytes and scales
(and gather back to them), and compute what the unsharded FP8 module does, by the same
expectations; where the shards would cut 128-element blocks, loading is refused by name.
Such shards stepped by FusedAdam(master_weights=True) / FusedSGD (each rank its own optimizer)
follow the unsharded module's optimizer: a shard's blocks are blocks of the full weight,
requantized from its slice of the fp32 master, so where a gradient is bit-identical the bytes,
scales, master and moments are that slice's bit for bit at every step.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_tensor_parallel import _gather, _seed
from testlib import assert_bits, FP32_TOL, FP8_TOL, gloo_group, spawn_results

pytestmark = pytest.mark.cpu

S, B, H, F = 80, 2, 256, 512  # S*B = 160 tokens; H, F: multiples of 128 x tp (tp = 2)

KINDS = ("linear-col", "linear-row", "lnlinear", "lnmlp-gelu", "lnmlp-swiglu")
CASES = [f"{k}/{m}" for k in KINDS for m in ("tp", "sp")]
# block FP8 params: {case: weight form}, the same form in fp8_model_init and fp8_autocast
PARAM_CASES = {"lnmlp-swiglu/tp": "128x128", "linear-row/sp": "1x128",
               "linear-col/tp": "128x128, scales not powers of 2"}

# tensors expected bit-identical to the unsharded module's (the rest: fp32 tolerance), see above
EXACT = {"linear-col": {"y", "dweight", "dbias"},
         "linear-row": {"dx", "dweight", "dbias/tp"},
         "lnlinear": {"y", "dquery_weight", "dquery_bias", "dvalue_weight", "dvalue_bias"},
         "lnmlp": {"dfc1_weight", "dfc1_bias", "dfc2_weight", "dfc2_bias/tp"}}


def _exact(kind: str, mode: str, label: str) -> bool:
    names = EXACT[kind.split("-")[0] if kind.startswith("lnmlp") else kind]
    return label in names or f"{label}/{mode}" in names


# --------------------------------------------------------------------------- worker side
def _build(kind, tp: dict, device="cpu"):
    import tritium as te
    common = dict(device=device, **tp)
    if kind == "linear-col":
        return te.Linear(H, F, parallel_mode="column", **common), H, F
    if kind == "linear-row":
        return te.Linear(F, H, parallel_mode="row", **common), F, H
    if kind == "lnlinear":   # two parts, each sharded on its own (256 -> 128 rows a rank)
        return te.LayerNormLinear(H, F, parallel_mode="column",
                                  parameters_split={"query": F // 2, "value": F // 2},
                                  **common), H, F
    return te.LayerNormMLP(H, F, activation=kind.split("-")[1], set_parallel_mode=True,
                           **common), H, H


class _Spy:
    """Counts the fused norm / activation block-cast calls (which path ran)."""

    def __init__(self):
        from tritium.fp8 import block as block_ops
        self.calls = {"norm": 0, "act_fwd": 0, "act_bwd": 0}
        for key, name in (("norm", "norm_fwd_blocks"), ("act_fwd", "activation_fwd_blocks"),
                          ("act_bwd", "activation_bwd_blocks")):
            fn = getattr(block_ops, name)

            def wrapped(*a, _fn=fn, _key=key, **k):
                self.calls[_key] += 1
                return _fn(*a, **k)
            setattr(block_ops, name, wrapped)

    def take(self) -> dict:
        out, self.calls = self.calls, dict.fromkeys(self.calls, 0)
        return out


def _perturb_norm(mod, seed):
    """Non-trivial norm parameters, the same on every rank (they are replicated)."""
    if getattr(mod, "layer_norm_weight", None) is None:
        return
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w, b = mod.layer_norm_weight, mod.layer_norm_bias
        w.add_(torch.randn(w.shape, generator=g).to(w.device))
        if b is not None:
            b.add_(torch.randn(b.shape, generator=g).to(b.device))


def _unsharded_pairs(tp_mod, got, want, group, world, in_dim, out_dim, out_blocks) -> list:
    """[(label, TP result gathered to the unsharded shape, unsharded result)] for y, dx and
    every parameter gradient. got / want: _run's (y, dx, {param: grad}); in_dim / out_dim: the
    dim x / y are split along across the ranks (-1: features, 0: sequence, None: whole);
    out_blocks: the column output's feature blocks, each sharded on its own."""
    from tritium.distributed import tensor_parallel as T
    y_tp, gx, grads = got
    if out_dim == -1:
        y_tp = T.unshard_tensor(_gather(y_tp, -1, group).chunk(world, -1), -1, out_blocks, world)
    elif out_dim is not None:
        y_tp = _gather(y_tp, out_dim, group)
    if in_dim is not None:
        gx = _gather(gx, in_dim, group)
    pairs = [("y", y_tp, want[0]), ("dx", gx, want[1])]
    sharded = T._sharded_params(tp_mod)
    for pname, grad in grads.items():
        if pname in sharded:
            dim, blocks, _ = sharded[pname]
            grad = T.unshard_tensor(_gather(grad, dim, group).chunk(world, dim), dim, blocks,
                                    world)
        pairs.append((f"d{pname}", grad, want[2][pname]))
    return pairs


def _run(mod, x, dy, rcp, fused=True):
    """y, dx and {param: grad} of one fwd+bwd under fp8_autocast(rcp)."""
    import tritium as te
    from tritium.functional.fused_cast import fused_casts
    leaf = x.clone().requires_grad_()
    with fused_casts(fused), te.fp8_autocast(fp8_recipe=rcp):
        y = mod(leaf)
    y.backward(dy)
    grads = {n: p.grad for n, p in mod.named_parameters()}
    for p in mod.parameters():
        p.grad = None
    return y.detach(), leaf.grad, grads


def _recipe(form: str):
    from tritium import recipe
    if form == "1x128":
        return recipe.Float8BlockScaling(w_block_scaling_dim=1)
    if form.startswith("128x128,"):
        return recipe.Float8BlockScaling(fp8_quant_fwd_weight=recipe.QParams(power_2_scale=False))
    return recipe.Float8BlockScaling()


def _block_parts(t) -> list:
    """The fp8 bytes and scales of a Float8BlockTensor (both forms)."""
    return [None if o is None else o.view(torch.uint8) if o.element_size() == 1 else o
            for o in t.operands()]


def _block_case(name, group, world, rank, spy, form=None):
    """form (block FP8 params): the full model is built under fp8_model_init (the same on every
    rank) and its state dict loaded into the TP one (load_full_state_dict)."""
    import tritium as te
    from tritium.distributed import tensor_parallel as T
    kind, mode = name.split("/")
    sp = mode == "sp"
    rcp = _recipe(form or "128x128")
    if form is not None:
        torch.manual_seed(_seed(name))
        with te.fp8_model_init(recipe=rcp):
            ref, k_in, n_out = _build(kind, {})
            tp_mod, _, _ = _build(kind, dict(tp_group=group, sequence_parallel=sp))
            unfused, _, _ = _build(kind, dict(tp_group=group, sequence_parallel=sp))
        _perturb_norm(ref, _seed(name))
        full_sd = ref.state_dict()
        T.load_full_state_dict(tp_mod, full_sd)
        # bit for bit: the shards hold the full model's fp8 bytes and scales (gathered back)
        back = T.gather_full_state_dict(tp_mod)
        kept = [(k, _block_parts(back[k]), _block_parts(v)) for k, v in full_sd.items()
                if hasattr(v, "operands")]
    else:
        torch.manual_seed(_seed(name) + rank)          # a different init on every rank
        tp_mod, k_in, n_out = _build(kind, dict(tp_group=group, sequence_parallel=sp))
        _perturb_norm(tp_mod, _seed(name))
        full_sd = T.gather_full_state_dict(tp_mod)
        ref, _, _ = _build(kind, {})
        ref.load_state_dict(full_sd)
        unfused, _, _ = _build(kind, dict(tp_group=group, sequence_parallel=sp))
    unfused.load_state_dict(tp_mod.state_dict())   # the same TP module, run unfused
    col = kind in ("linear-col", "lnlinear")
    in_dim = -1 if kind == "linear-row" else (0 if sp else None)
    out_dim = -1 if col else (0 if sp else None)
    out_blocks = (F // 2, F // 2) if kind == "lnlinear" else (F,)
    g = torch.Generator().manual_seed(_seed(name) + 1)  # the same data on every rank
    x = torch.randn(S, B, k_in, generator=g)
    dy = torch.randn(S, B, n_out, generator=g)
    x_loc = x if in_dim is None else x.chunk(world, in_dim)[rank]
    if out_dim == -1:   # column outputs: this rank's chunk of each block of features
        dy_loc = T.shard_tensor(dy, -1, out_blocks, world, rank)
    else:
        dy_loc = dy if out_dim is None else dy.chunk(world, out_dim)[rank]
    want = _run(ref, x, dy, rcp)
    spy.take()
    got = _run(tp_mod, x_loc, dy_loc, rcp)
    calls = spy.take()
    plain = _run(unfused, x_loc, dy_loc, rcp, fused=False)
    unfused_calls = spy.take()   # fused_casts(False): none
    fused_bits = [(lbl, a, b) for lbl, a, b in
                  [("y", got[0], plain[0]), ("dx", got[1], plain[1])]
                  + [(f"d{n}", got[2][n], plain[2][n]) for n in got[2]]]
    pairs = _unsharded_pairs(tp_mod, got, want, group, world, in_dim, out_dim, out_blocks)
    res = {"pairs": pairs, "fused_bits": fused_bits, "calls": calls,
           "unfused_calls": unfused_calls}
    if form is not None:
        res["kept"] = kept
        res["fp8_weights"] = sorted(n for n, p in tp_mod.named_parameters()
                                    if hasattr(p, "operands"))
    return res


def _layer_fused_case(mode, group, world, rank, spy):
    """A TransformerLayer (LayerNorm QKV, gelu MLP; set_parallel_mode) under TP / SP: fused ==
    unfused bit for bit (output, input and parameter gradients), and which fused casts ran."""
    import tritium as te
    torch.manual_seed(_seed(f"layer/{mode}") + rank)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, set_parallel_mode=True,
              tp_group=group, sequence_parallel=mode == "sp", device="cpu")
    layer = te.TransformerLayer(H, F, 4, **kw)
    plain = te.TransformerLayer(H, F, 4, **kw)
    plain.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(_seed(f"layer/{mode}"))
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    if mode == "sp":
        x, dy = x.chunk(world)[rank], dy.chunk(world)[rank]
    rcp = _recipe("128x128")
    spy.take()
    got = _run(layer, x, dy, rcp)
    calls = spy.take()
    want = _run(plain, x, dy, rcp, fused=False)
    pairs = [("y", got[0], want[0]), ("dx", got[1], want[1])]
    pairs += [(f"d{n}", got[2][n], want[2][n]) for n in got[2]]
    return {"fused_bits": pairs, "calls": calls, "unfused_calls": spy.take()}


def _cut_blocks_case(group, world, rank):
    """Block FP8 weights whose TP shards would cut their 128-element blocks (384 features, 192
    a rank): a full FP8 state dict is refused by FP8 shards before anything changes, loaded
    exactly by high-precision shards, and such a TP model gathers to its exact values."""
    import torch.distributed as dist
    import tritium as te
    from tritium import recipe
    from tritium.distributed import tensor_parallel as T
    torch.manual_seed(5)
    out = {}
    for mode, dim, (k, n) in (("column", 0, (H, 384)), ("row", 1, (384, H))):
        with te.fp8_model_init(recipe=recipe.Float8BlockScaling()):
            full = te.Linear(k, n, device="cpu")
            tp_fp8 = te.Linear(k, n, parallel_mode=mode, tp_group=group, device="cpu")
        tp_hp = te.Linear(k, n, parallel_mode=mode, tp_group=group, device="cpu")
        before = [p.clone() for p in _block_parts(tp_fp8.weight) if p is not None]
        try:
            T.load_full_state_dict(tp_fp8, full.state_dict())
            err = ("none", "")
        except Exception as exc:  # noqa: BLE001 - checked by the test
            err = (type(exc).__name__, str(exc))
        after = [p for p in _block_parts(tp_fp8.weight) if p is not None]
        T.load_full_state_dict(tp_hp, full.state_dict())
        back = T.gather_full_state_dict(tp_fp8)["weight"]
        out[mode] = {
            "error": err,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "hp_exact": torch.equal(tp_hp.weight.detach(),
                                    full.weight.dequantize().chunk(world, dim)[rank]),
            "gathered_values": not hasattr(back, "operands") and torch.equal(
                back, _gather(tp_fp8.weight.dequantize(), dim, group))}
    dist.barrier()   # every rank is still in step: the error left no collective half-done
    return out


def _unaligned_case(group, world, rank):
    """High-precision weights with shards that are not whole blocks (384 features, 192 a
    rank) are not refused: each rank runs a complete block-scaled GEMM of its operands, only
    in other blocks than the unsharded module's. The outputs (gathered) against it."""
    import tritium as te
    from tritium.distributed import tensor_parallel as T
    out = {}
    for mode, (k, n) in (("column", (H, 384)), ("row", (384, H))):
        torch.manual_seed(7 + rank)
        lin = te.Linear(k, n, parallel_mode=mode, tp_group=group, device="cpu")
        ref = te.Linear(k, n, device="cpu")
        ref.load_state_dict(T.gather_full_state_dict(lin))
        x = torch.randn(S, B, k, generator=torch.Generator().manual_seed(8))
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=_recipe("128x128")):
            y = lin(x if mode == "column" else x.chunk(world, -1)[rank])
            want = ref(x)
        out[mode] = (_gather(y, -1, group) if mode == "column" else y), want
    return out


# block FP8 params stepped by the optimizers: {case: (weight form, optimizer)}
OPT_CASES = {"linear-col/tp": ("128x128", "adam"), "linear-row/sp": ("1x128", "adam"),
             "lnmlp-swiglu/tp": ("128x128", "adam"), "linear-row/tp": ("128x128", "sgd")}
OPT_STEPS = 3


def _optimizer(which, params):
    from tritium.optimizers import FusedAdam, FusedSGD
    if which == "sgd":
        return FusedSGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, master_weights=True)
    return FusedAdam(params, lr=5e-3, weight_decay=0.01, master_weights=True)


def _slice_like(full, shard, dim, blocks, n_full, world, rank):
    """This rank's slice of `full` (a param or one of its block operands / optimizer states):
    along the axis where `shard` is 1/world of it, each block's chunk (block sizes scaled by
    how many entries the operand has per element of the param's `dim`: 1, or 1/128)."""
    axes = [a for a in range(full.dim()) if full.shape[a] != shard.shape[a]]
    assert len(axes) == 1, (full.shape, shard.shape)
    per = n_full // full.shape[axes[0]]
    from tritium.distributed.tensor_parallel import shard_tensor
    return shard_tensor(full, axes[0], [b // per for b in blocks], world, rank)


def _opt_case(name, group, world, rank):
    """OPT_STEPS training steps of the TP module's block FP8 shards (each rank its own
    optimizer) and of the unsharded module (the same optimizer) on the same data: after every
    step each rank's param (fp8 bytes and block scales of both forms, or its fp32 value), fp32
    master and optimizer state against that rank's slice of the unsharded one's, and the
    outputs. The norm parameters are not stepped: their gradients are split sums, and their
    values a few ulps off would feed the next fc1 input (docs/block_scaling.md)."""
    import torch.distributed as dist
    import tritium as te
    from tritium.distributed import tensor_parallel as T
    form, which = OPT_CASES[name]
    kind, mode = name.split("/")
    sp = mode == "sp"
    rcp = _recipe(form)
    torch.manual_seed(_seed(name))
    with te.fp8_model_init(recipe=rcp):
        ref, k_in, n_out = _build(kind, {})
        tp_mod, _, _ = _build(kind, dict(tp_group=group, sequence_parallel=sp))
    _perturb_norm(ref, _seed(name))
    T.load_full_state_dict(tp_mod, ref.state_dict())
    stepped = lambda m: [p for n, p in m.named_parameters()   # noqa: E731
                         if not n.startswith("layer_norm")]
    opt_ref, opt_tp = _optimizer(which, stepped(ref)), _optimizer(which, stepped(tp_mod))
    sharded = T._sharded_params(tp_mod)
    in_dim = -1 if kind == "linear-row" else (0 if sp else None)
    out_dim = -1 if kind == "linear-col" else (0 if sp else None)
    g = torch.Generator().manual_seed(_seed(name) + 2)   # the same data on every rank
    ref_params, tp_params = dict(ref.named_parameters()), dict(tp_mod.named_parameters())
    start = {n: p._data.clone() for n, p in tp_params.items() if hasattr(p, "operands")}
    outputs, params = [], []
    for step in range(OPT_STEPS):
        x, dy = torch.randn(S, B, k_in, generator=g), torch.randn(S, B, n_out, generator=g)
        x_loc = x if in_dim is None else x.chunk(world, in_dim)[rank]
        dy_loc = dy if out_dim is None else dy.chunk(world, out_dim)[rank]
        ys = []
        for mod, opt, xx, dd in ((ref, opt_ref, x, dy), (tp_mod, opt_tp, x_loc, dy_loc)):
            with te.fp8_autocast(fp8_recipe=rcp):
                y = mod(xx)
            y.backward(dd)
            opt.step()
            opt.zero_grad()
            ys.append(y.detach())
        y_tp = ys[1] if out_dim is None else _gather(ys[1], out_dim, group)
        outputs.append((y_tp, ys[0]))
        for pname, p in tp_params.items():
            if pname.startswith("layer_norm"):
                continue
            full = ref_params[pname]
            dim, blocks, _ = sharded.get(pname, (None, None, None))
            cut = (lambda f, s: f) if dim is None else (   # noqa: E731
                lambda f, s: _slice_like(f, s, dim, blocks, full.shape[dim], world, rank))
            pairs = [(f"{pname} {k}", opt_tp.state[p][k], cut(opt_ref.state[full][k],
                                                               opt_tp.state[p][k]))
                     for k in opt_tp.state[p] if torch.is_tensor(opt_tp.state[p][k])]
            if hasattr(p, "operands"):
                pairs += [(f"{pname} operand {i}", s, cut(f, s)) for i, (s, f) in
                          enumerate(zip(_block_parts(p), _block_parts(full))) if s is not None]
            else:
                pairs.append((f"{pname} value", p.detach(), cut(full.detach(), p)))
            params += [(step, rank, lbl, a.clone(), b.clone()) for lbl, a, b in pairs]
    changed = {n: not torch.equal(p._data.view(torch.uint8), start[n].view(torch.uint8))
               for n, p in tp_params.items() if n in start}
    every = [None] * world
    dist.all_gather_object(every, (params, changed))
    return {"outputs": outputs, "params": [q for r in every for q in r[0]],
            "changed": [r[1] for r in every]}


def _worker(rank, port, out_dir, world):
    import torch.distributed as dist
    with gloo_group(rank, world, port):
        group, spy = dist.group.WORLD, _Spy()
        results = {name: _block_case(name, group, world, rank, spy) for name in CASES}
        for name, form in PARAM_CASES.items():
            results[f"params:{name}"] = _block_case(name, group, world, rank, spy, form)
        results["cut"] = _cut_blocks_case(group, world, rank)
        results["unaligned"] = _unaligned_case(group, world, rank)
        for mode in ("tp", "sp"):
            results[f"layer/{mode}"] = _layer_fused_case(mode, group, world, rank, spy)
        for name in OPT_CASES:
            results[f"opt:{name}"] = _opt_case(name, group, world, rank)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("tpblock"), 2)


# --------------------------------------------------------------------------- checks
def _check(name, res):
    kind, mode = name.split(":")[-1].split("/")
    assert len(res["pairs"]) > 2
    for label, got, want in res["pairs"]:
        assert got is not None and want is not None, (name, label)
        assert got.shape == want.shape, (name, label, got.shape, want.shape)
        assert want.abs().max() > 0, (name, label)
        if _exact(kind, mode, label):
            assert_bits(got, want, f"{name} {label}")
        else:   # the split sum is finished in another order: close, and not the same bits
            torch.testing.assert_close(got, want, **FP32_TOL,
                                       msg=lambda m: f"{name} {label}: {m}")
            assert not torch.equal(got, want), f"{name} {label}: bit-identical, listed as split"


@pytest.mark.parametrize("name", CASES)
def test_block_tp_matches_unsharded(world2, name):
    _check(name, world2[name])


@pytest.mark.parametrize("name", CASES + ["layer/tp", "layer/sp"])
def test_block_tp_fused_equals_unfused(world2, name):
    """The fused casts ran where they are exact under TP (the norm's: column-parallel without
    SP; the activation's: every mode) and gave the unfused chain's bits."""
    res = world2[name]
    assert len(res["fused_bits"]) > 2
    for label, got, want in res["fused_bits"]:
        assert_bits(got, want, f"{name} {label}")
    kind, mode = name.split("/")
    norms = {"lnlinear": 1, "lnmlp-gelu": 1, "lnmlp-swiglu": 1, "layer": 2}.get(kind, 0)
    act = int(kind.startswith("lnmlp") or kind == "layer")
    assert res["calls"] == {"norm": norms if mode == "tp" else 0, "act_fwd": act,
                            "act_bwd": act}
    assert not any(res["unfused_calls"].values())


@pytest.mark.parametrize("name", list(PARAM_CASES))
def test_block_fp8_params_tp(world2, name):
    """Block FP8 params: shards loaded from the full FP8 model keep its bytes and scales, and
    the TP module computes what the unsharded FP8 module does (the expectations above)."""
    res = world2[f"params:{name}"]
    assert len(res["kept"]) == len(res["fp8_weights"]) > 0
    for key, got, want in res["kept"]:
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits(g, w, f"{name} {key} operand {i}")
    _check(name, res)


def test_block_fp8_params_cut_blocks(world2):
    for mode, res in world2["cut"].items():
        kind, text = res["error"]
        assert kind == "ValueError", (mode, res["error"])
        assert "would cut its 128-element scale blocks" in text, text
        assert "multiple of 128 x tp_size = 256" in text, text
        assert res["unchanged"] and res["hp_exact"] and res["gathered_values"], (mode, res)


def test_block_tp_unaligned_shards_run(world2):
    """Not whole blocks: no error, and the unsharded module's result to FP8 accuracy (bit for
    bit only where the other blocks happen to get the same power-of-2 scales)."""
    assert set(world2["unaligned"]) == {"column", "row"}
    for mode, (got, want) in world2["unaligned"].items():
        torch.testing.assert_close(got, want, **FP8_TOL, msg=lambda m: f"{mode}: {m}")


# stepped params whose gradients are split sums (the rest: bit-identical gradients, see above)
OPT_SPLIT = {"linear-row/sp": {"bias"}}   # replicated, all-reduced from each rank's rows


@pytest.mark.parametrize("name", list(OPT_CASES))
def test_block_fp8_params_tp_optimizer(world2, name):
    """FusedAdam(master_weights=True) / FusedSGD stepping each rank's block FP8 shards vs the
    unsharded module's optimizer, OPT_STEPS steps: where a param's gradient is bit-identical
    (every weight: tokens whole; every bias except the replicated one under SP), the shard's
    fp8 bytes and block scales (both forms), fp32 master and moments are the unsharded ones'
    slice bit for bit after every step (a shard's 128-blocks are blocks of the full weight and
    are requantized from exactly its slice of the master); the outputs as the forward cases."""
    res = world2[f"opt:{name}"]
    kind, mode = name.split("/")
    split = OPT_SPLIT.get(name, set())
    labels = {lbl for _, _, lbl, _, _ in res["params"]}
    want_parts = {"operand 0", "operand 1", "operand 2", "operand 3", "master_param"}
    want_parts |= {"exp_avg", "exp_avg_sq"} if OPT_CASES[name][1] == "adam" else {
        "momentum_buffer"}
    assert {lbl.split(" ", 1)[1] for lbl in labels if "weight" in lbl} == want_parts, labels
    assert len(res["params"]) == OPT_STEPS * 2 * len(labels)
    for step, rank, label, got, want in res["params"]:
        what = f"{name} step {step} rank {rank} {label}"
        assert got.shape == want.shape and got.dtype == want.dtype, what
        if label.split(" ")[0] in split:
            torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{what}: {m}")
            assert not torch.equal(got, want), f"{what}: bit-identical, listed as split"
        else:
            assert_bits(got, want, what)
    assert all(c and all(c.values()) for c in res["changed"]), res["changed"]  # bytes moved
    for step, (got, want) in enumerate(res["outputs"]):
        if _exact(kind, mode, "y"):
            assert_bits(got, want, f"{name} step {step} y")
        else:
            torch.testing.assert_close(got, want, **FP32_TOL,
                                       msg=lambda m: f"{name} step {step} y: {m}")
