"""cpu tier: FusedAdam / FusedSGD checkpoints, bf16 remainders, and errors.

Resume: train 10 steps; or train 5, save the optimizer's state_dict through torch.save /
torch.load(weights_only=True) of a BytesIO, build FRESH params (copies of the model's values,
as a model checkpoint would restore) and a fresh optimizer, load, train 5 more with the same
grads: params, masters and moments are bit-identical to the uninterrupted run (fp32, bf16 +
master, FP8 + master, bf16 moments, remainders, capturable, SGD with momentum).
Remainders: the fp32 master rebuilt from (bf16 param, int16 remainder) is bit-identical to a
full-master run, and the split/join round trip is exact on every non-NaN pattern sampled.
Errors: each bad input raises a message naming the argument, and leaves every param, every
state tensor and the step counter as they were (also when the bad param is in a later group).
"""
from __future__ import annotations

import io

import pytest
import torch

from tritium.optimizers import FusedAdam, FusedSGD
from tritium.ref.adam import join_remainder, split_remainder

from test_optimizers import make_fp8
from testlib import E4M3

pytestmark = pytest.mark.cpu

SHAPES = [(1,), (1023,), (48, 40)]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _bits(t):
    if t is None:
        return None
    t = t._data if hasattr(t, "_data") else t.detach()
    return t.contiguous().view(torch.uint8).clone()


def _make(kind, randn):
    if kind == "fp8":
        return [make_fp8(randn, s) for s in SHAPES]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[kind]
    return [torch.nn.Parameter(randn(*s).to(dtype)) for s in SHAPES]


def _fresh_copy(params):
    """New param objects with the same values (what loading a model checkpoint gives)."""
    out = []
    for p in params:
        if hasattr(p, "_data"):
            from tritium.fp8.tensor import Float8Tensor
            scales = p._scale._base.clone()
            q = Float8Tensor(p._data.clone(), p._scale_inv.clone(), p._data.dtype, p.dtype, None,
                             scales[1:2], requires_grad=True)
            q._amax = None if p._amax is None else p._amax.clone()
            out.append(q)
        else:
            out.append(torch.nn.Parameter(p.detach().clone()))
    return out


def _train(cls, kw, params, grads, split=None):
    opt = cls(params, **kw)
    for k, step_grads in enumerate(grads):
        if k == split:
            sd = _roundtrip(opt.state_dict())
            params = _fresh_copy(params)
            opt = cls(params, **kw)
            opt.load_state_dict(sd)
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
    return params, opt


def _assert_same_run(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(_bits(x), _bits(y))
        if hasattr(x, "_data"):
            assert torch.equal(x._scale_inv, y._scale_inv)
            assert (x._amax is None) == (y._amax is None)
            if x._amax is not None:
                assert torch.equal(x._amax, y._amax)
        sx, sy = oa.state[x], ob.state[y]
        assert set(sx) == set(sy)
        for name in sx:
            assert torch.equal(_bits(sx[name]), _bits(sy[name])) if sx[name] is not None \
                else sy[name] is None, name
    ga, gb = oa.param_groups[0], ob.param_groups[0]
    assert int(ga.get("step", 0)) == int(gb.get("step", 0))


ADAM_RESUME = {
    "fp32": ("fp32", dict(lr=1e-2, weight_decay=0.1)),
    "bf16+master": ("bf16", dict(lr=1e-2, master_weights=True)),
    "fp8+master": ("fp8", dict(lr=1e-2, master_weights=True, weight_decay=0.01)),
    "bf16 moments": ("bf16", dict(lr=1e-2, master_weights=True, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16)),
    "remainders": ("bf16", dict(lr=1e-2, master_weights=True, store_param_remainders=True)),
    "capturable L2": ("fp32", dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False,
                                   capturable=True)),
}


@pytest.mark.parametrize("case", list(ADAM_RESUME))
def test_adam_resume_is_bit_exact(randn, case):
    kind, kw = ADAM_RESUME[case]
    grads = [[randn(*s, scale=0.1) for s in SHAPES] for _ in range(10)]
    base = _make(kind, randn)
    whole = _train(FusedAdam, kw, _fresh_copy(base), grads)
    resumed = _train(FusedAdam, kw, _fresh_copy(base), grads, split=5)
    _assert_same_run(whole, resumed)
    assert not torch.equal(_bits(whole[0][1]), _bits(base[1]))


def test_sgd_resume_is_bit_exact(randn):
    grads = [[randn(*s) for s in SHAPES] for _ in range(8)]
    base = _make("bf16", randn)
    kw = dict(lr=0.05, momentum=0.9, nesterov=True, master_weights=True)
    _assert_same_run(_train(FusedSGD, kw, _fresh_copy(base), grads),
                     _train(FusedSGD, kw, _fresh_copy(base), grads, split=4))


def test_state_dict_is_unscaled_fp32_and_plain(randn):
    params = _make("bf16", randn)
    opt = FusedAdam(params, lr=1e-2, master_weights=True, store_param_remainders=True,
                    exp_avg_dtype=torch.bfloat16, capturable=True)
    for p in params:
        p.grad = randn(*p.shape).bfloat16()
    opt.step()
    sd = _roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["step"] == 1 and isinstance(sd["param_groups"][0]["lr"], float)
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"exp_avg", "exp_avg_sq", "master_param"}
        assert all(t.dtype == torch.float32 for t in st.values())
        assert torch.equal(st["exp_avg"], opt.state[p]["exp_avg"].float())
        assert torch.equal(st["master_param"], opt.get_master_param(p))


# ----------------------------------------------------------------------------- remainders
def test_remainder_masters_equal_full_masters(randn):
    grads = [[randn(*s, scale=0.1) for s in SHAPES] for _ in range(6)]
    base = _make("bf16", randn)
    full_p, full = _train(FusedAdam, dict(lr=1e-2, master_weights=True), _fresh_copy(base), grads)
    rem_p, rem = _train(FusedAdam, dict(lr=1e-2, master_weights=True,
                                        store_param_remainders=True), _fresh_copy(base), grads)
    for a, b in zip(full_p, rem_p):
        master = full.state[a]["master_param"]
        assert "master_param" in rem.state[b] and rem.state[b]["master_param"] is None
        assert rem.state[b]["master_remainder"].dtype == torch.int16
        assert torch.equal(rem.get_master_param(b).view(torch.int32), master.view(torch.int32))
        # the param is the master rounded to nearest, ties away from zero
        diff = (b.detach().view(torch.int16).int() - a.detach().view(torch.int16).int()).abs()
        assert diff.max() <= 1
        assert torch.equal(b.detach().view(torch.int16), split_remainder(master)[0])


def test_split_join_round_trip():
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    specials = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000,
                             0x7F7F7FFF, 0x00008000, 0x80008000, 0x3F808000, 0x3F818000,
                             0x0000FFFF, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001],
                            dtype=torch.int64)
    bits = torch.cat([bits, specials])
    w = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    p, r = split_remainder(w)
    back = join_remainder(p, r)
    nan = torch.isnan(w)
    assert torch.equal(back[~nan].view(torch.int32), w[~nan].view(torch.int32))
    assert torch.isnan(back[nan]).all() and torch.isnan(p[nan].view(torch.bfloat16)).all()
    # the param is round-to-nearest: never more than half a bf16 ulp from the master
    fin = torch.isfinite(w) & torch.isfinite(p.view(torch.bfloat16).float())
    rtne = w[fin].to(torch.bfloat16)
    assert ((p[fin].int() - rtne.view(torch.int16).int()).abs() <= 1).all()
    ties = (w[fin].view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(p[fin][~ties], rtne.view(torch.int16)[~ties])


# ----------------------------------------------------------------------------- errors
def _snapshot(params, opt):
    snap = [_bits(p) for p in params]
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                     for k, v in opt.state[p].items()} for p in params if p in opt.state}
    steps = [g.get("step") for g in opt.param_groups]
    steps = [s.clone() if isinstance(s, torch.Tensor) else s for s in steps]
    return snap, state, steps


def _assert_unchanged(params, opt, snap):
    bits, state, steps = snap
    for p, b in zip(params, bits):
        assert torch.equal(_bits(p), b)
    assert {id(p) for p in params if p in opt.state and opt.state[p]} == set(state)
    for p in params:
        for k, v in state.get(id(p), {}).items():
            now = opt.state[p][k]
            assert (now is None and v is None) or torch.equal(now, v), k
    now_steps = [g.get("step") for g in opt.param_groups]
    for a, b in zip(now_steps, steps):
        assert (a is None and b is None) or bool(torch.as_tensor(a == b).all())


def _two_groups(randn, **kw):
    a = [torch.nn.Parameter(randn(20)), torch.nn.Parameter(randn(4, 5))]
    b = [torch.nn.Parameter(randn(7)), torch.nn.Parameter(randn(9))]
    opt = FusedAdam([{"params": a}, {"params": b}], lr=1e-2, use_decoupled_grad=True, **kw)
    for p in a + b:
        p.decoupled_grad = randn(*p.shape)
    opt.step()  # every param has state and the group a step count
    return a + b, opt


BAD_GRADS = {
    "wrong shape": (lambda p: torch.zeros(p.numel() + 1), ValueError, "shape"),
    "wrong dtype": (lambda p: torch.zeros(p.shape, dtype=torch.int32), TypeError, "dtype"),
    "float64": (lambda p: torch.zeros(p.shape, dtype=torch.float64), TypeError, "float32"),
    "sparse": (lambda p: torch.zeros(p.shape).to_sparse(), RuntimeError, "sparse"),
}


@pytest.mark.parametrize("case", list(BAD_GRADS))
@pytest.mark.parametrize("capturable", [False, True])
def test_bad_grad_changes_nothing(randn, case, capturable):
    params, opt = _two_groups(randn, capturable=capturable)
    make, exc, words = BAD_GRADS[case]
    for p in params:
        p.decoupled_grad = randn(*p.shape)
    params[3].decoupled_grad = make(params[3])  # last param of the second group
    snap = _snapshot(params, opt)
    with pytest.raises(exc, match=words) as info:
        opt.step()
    assert "decoupled_grad" in str(info.value) and "param group 1, param 1" in str(info.value)
    _assert_unchanged(params, opt, snap)


def test_sparse_grad_in_p_grad(randn):
    p = torch.nn.Parameter(randn(6, 3))
    q = torch.nn.Parameter(randn(5))
    opt = FusedSGD([q, p], lr=0.1, momentum=0.9)
    q.grad = randn(5)
    p.grad = torch.zeros(6, 3).to_sparse()
    before = q.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(q.detach(), before) and q not in opt.state


def test_construction_errors(randn):
    bf, hf = torch.nn.Parameter(randn(3).bfloat16()), torch.nn.Parameter(randn(3).half())
    with pytest.raises(ValueError, match="mixes float16 and bfloat16.*separate param groups"):
        FusedAdam([bf, hf])
    FusedAdam([{"params": [bf]}, {"params": [hf]}])  # the fix works
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam([make_fp8(randn, (4, 4))])
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedSGD([make_fp8(randn, (4, 4))], lr=0.1)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam([bf], amsgrad=True)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        FusedAdam([bf], exp_avg_dtype=torch.float64)
    with pytest.raises(ValueError, match="master_weight_dtype"):
        FusedAdam([bf], master_weights=True, master_weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="store_param_remainders"):
        FusedAdam([bf], store_param_remainders=True)
    with pytest.raises(TypeError, match="float64"):
        FusedAdam([torch.nn.Parameter(randn(3).double())])
    with pytest.raises(ValueError, match="contiguous"):
        FusedAdam([torch.nn.Parameter(randn(4, 6).t())])
    with pytest.raises(ValueError, match="nesterov"):
        FusedSGD([bf], lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="lr"):
        FusedSGD([bf])
    f = make_fp8(randn, (4, 4))
    f._scale = None
    with pytest.raises(ValueError, match="_scale"):
        FusedAdam([f], master_weights=True)
    fp32 = torch.nn.Parameter(randn(3))
    with pytest.raises(ValueError, match="no master"):
        FusedAdam([fp32], master_weights=True).set_master_param(fp32, randn(3))
    with pytest.raises(ValueError, match="not one of"):
        FusedAdam([fp32], master_weights=True).set_master_param(bf, randn(3))


def test_mixed_kinds_added_later_change_nothing(randn):
    """A group that becomes invalid (bf16 and fp16 together) fails at step, before launching."""
    bf, hf = torch.nn.Parameter(randn(3).bfloat16()), torch.nn.Parameter(randn(3).half())
    ok = torch.nn.Parameter(randn(8))
    opt = FusedAdam([{"params": [ok]}, {"params": [bf]}], master_weights=True)
    opt.param_groups[1]["params"].append(hf)
    for p in (ok, bf, hf):
        p.grad = randn(*p.shape).to(p.dtype)
    snap = _snapshot([ok, bf, hf], opt)
    with pytest.raises(ValueError, match="mixes float16 and bfloat16"):
        opt.step()
    _assert_unchanged([ok, bf, hf], opt, snap)


LOAD_BREAKS = {
    "shape": (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5)), "shape"),
    "master shape": (lambda sd: sd["state"][0].__setitem__("master_param", torch.zeros(2)),
                     "shape"),
    "missing moment": (lambda sd: sd["state"][1].pop("exp_avg_sq"), "exp_avg_sq"),
    "groups": (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "groups"),
    "params": (lambda sd: sd["param_groups"][0]["params"].pop(), "params"),
    "index": (lambda sd: sd["state"].__setitem__(99, sd["state"][0]), "99"),
    "not float": (lambda sd: sd["state"][2].__setitem__("exp_avg", torch.zeros(48, 40,
                                                                                dtype=torch.int32)),
                  "float"),
}


@pytest.mark.parametrize("case", list(LOAD_BREAKS))
def test_bad_state_dict_changes_nothing(randn, case):
    params = _make("bf16", randn)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    for _ in range(2):
        for p in params:
            p.grad = randn(*p.shape).bfloat16()
        opt.step()
    sd = _roundtrip(opt.state_dict())
    for p in params:
        p.grad = randn(*p.shape).bfloat16()
    opt.step()  # the live state is now one step past the checkpoint
    lr_before = opt.param_groups[0]["lr"] = 0.5
    break_it, words = LOAD_BREAKS[case]
    break_it(sd)
    snap = _snapshot(params, opt)
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(sd)
    _assert_unchanged(params, opt, snap)
    assert opt.param_groups[0]["lr"] == lr_before and opt.param_groups[0]["step"] == 3


def test_load_missing_master_starts_from_param(randn):
    """A checkpoint from a run without masters: the master is made from the param's value."""
    params = _make("bf16", randn)
    plain = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = randn(*p.shape).bfloat16()
    plain.step()
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    opt.load_state_dict(_roundtrip(plain.state_dict()))
    for p in params:
        assert torch.equal(opt.state[p]["master_param"], p.detach().float())
    assert opt.param_groups[0]["step"] == 1


def test_fp8_load_keeps_live_tensors(randn):
    """Loading copies into existing state tensors (CUDA graphs keep their addresses)."""
    params = [make_fp8(randn, (8, 8), E4M3)]
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    params[0].grad = randn(8, 8).bfloat16()
    opt.step()
    sd = _roundtrip(opt.state_dict())
    ptrs = {k: v.data_ptr() for k, v in opt.state[params[0]].items()}
    params[0].grad = randn(8, 8).bfloat16()
    opt.step()
    opt.load_state_dict(sd)
    assert {k: v.data_ptr() for k, v in opt.state[params[0]].items()} == ptrs
    assert torch.equal(opt.state[params[0]]["master_param"], sd["state"][0]["master_param"])
