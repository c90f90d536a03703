"""cpu tier: FusedAdam's TE state dtypes: fp16 masters, fp16 and FP8 (torch.uint8) moments with
their per-tensor factors, get_unscaled_state / set_scaled_state, weights_only resume, and the
group step of an empty param group.

What must hold: each step is the fp32 step followed by one rounding of each scaled state into its
format, with the factor taken from the NEW values' amax (fp16: amax / 32752, E4M3: amax / 448):
compared with an fp32 FusedAdam fed the same unscaled states, the model param is bitwise equal
and every state is within half a unit of its format (|err| <= |x| * 2^-p + factor * subnormal
half-step); state_dict exports unscaled fp32 and a resume continues bitwise.
"""
from __future__ import annotations

import io

import pytest
import torch

from tritium.optimizers import FusedAdam

pytestmark = pytest.mark.cpu

E4M3 = torch.float8_e4m3fn
# per format: (relative half-ulp of normals, half the subnormal step in units of the factor d)
ROUNDING = {torch.float16: (2.0 ** -11, 2.0 ** -25), E4M3: (2.0 ** -4, 2.0 ** -10)}
CONFIGS = {
    "fp16 master": dict(master_weight_dtype=torch.float16),
    "fp8 moments": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "fp16 moments": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "all mixed": dict(master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
                      exp_avg_sq_dtype=torch.float16),
}


def _params(randn, dtype=torch.bfloat16):
    return [torch.nn.Parameter(randn(*s, scale=0.5).to(dtype)) for s in ((33,), (8, 16), (1,))]


def _within_format(got, want, stored_dtype, d):
    if stored_dtype not in ROUNDING:
        assert torch.equal(got, want)
        return
    rel, sub = ROUNDING[stored_dtype]
    bound = want.abs() * rel + d * sub + 1e-30
    err = (got - want).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0 or stored_dtype == torch.float16 or want.numel() == 1  # fp8 rounds


@pytest.mark.parametrize("config", list(CONFIGS))
def test_scaled_step_is_fp32_step_plus_one_rounding(randn, config):
    kw = dict(lr=1e-2, weight_decay=0.01, master_weights=True)
    params = _params(randn)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, **kw, **CONFIGS[config])
    ref = FusedAdam(ref_params, **kw)
    storage = {"exp_avg": opt._storage["exp_avg"], "exp_avg_sq": opt._storage["exp_avg_sq"],
               "master_param": opt._storage["master_param"]}
    for step in range(3):
        for p, q in zip(params, ref_params):
            p.grad = randn(*p.shape).to(torch.bfloat16)
            q.grad = p.grad.clone()
        if step:  # the reference starts each step from the scaled optimizer's unscaled state
            ref.load_state_dict(opt.state_dict())
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params):
            # (at step 0 an fp16 master starts as the bf16 param rounded into fp16 * factor)
            if step or storage["master_param"] == torch.float32:
                assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
            table = opt.state[p]["state_scales"]
            for row, name in enumerate(("exp_avg", "exp_avg_sq", "master_param")):
                if name == "master_param" and not step and storage[name] != torch.float32:
                    continue  # rounded twice by step 0 (at creation, then by the step)
                want = ref.get_unscaled_state(q, name)
                got = opt.get_unscaled_state(p, name)
                assert got.dtype == torch.float32 and got.shape == p.shape
                if name != "master_param":
                    assert opt.state[p][name].dtype == (E4M3 if storage[name] == E4M3
                                                        else storage[name])
                _within_format(got, want, storage[name], table[row, 0])
                if storage[name] in ROUNDING:  # the factor comes from the new values' amax
                    rng = 32752.0 if storage[name] == torch.float16 else 448.0
                    assert torch.equal(table[row, 0], want.abs().amax() / torch.tensor(rng))


def test_fp8_moments_use_the_full_range(randn):
    p = torch.nn.Parameter(randn(64, scale=1e-3))
    opt = FusedAdam([p], lr=1e-3, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    p.grad = randn(64, scale=1e-4)
    opt.step()
    for name in ("exp_avg", "exp_avg_sq"):  # tiny moments (v ~ 1e-11) still fill E4M3's range
        raw = opt.state[p][name]
        assert raw.dtype == E4M3 and raw.float().abs().max() == 448.0
        assert (opt.get_unscaled_state(p, name) != 0).float().mean() > 0.9


@pytest.mark.parametrize("config", ["fp16 master", "all mixed"])
def test_weights_only_resume_is_bitwise(randn, config, tmp_path):
    kw = dict(lr=1e-2, master_weights=True, **CONFIGS[config])
    params = _params(randn)
    opt = FusedAdam(params, **kw)
    grads = [[randn(*p.shape).to(torch.bfloat16) for p in params] for _ in range(4)]
    for gs in grads[:2]:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    sd = opt.state_dict()
    for st in sd["state"].values():  # exported unscaled fp32, equal to get_unscaled_state
        assert all(t.dtype == torch.float32 for t in st.values())
    for gs in grads[2:]:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt2 = FusedAdam(params2, **kw)
    opt2.load_state_dict(saved["opt"])
    for gs in grads[2:]:
        for p, g in zip(params2, gs):
            p.grad = g
        opt2.step()
    for a, b in zip(params, params2):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt.get_unscaled_state(a, name), opt2.get_unscaled_state(b, name))
        assert torch.equal(opt.state[a]["state_scales"], opt2.state[b]["state_scales"])


def test_get_and_set_scaled_state(randn):
    p = torch.nn.Parameter(randn(40).to(torch.bfloat16))
    opt = FusedAdam([p], master_weights=True, master_weight_dtype=torch.float16,
                    exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="first step"):
        opt.get_unscaled_state(p, "exp_avg")
    p.grad = randn(40).to(torch.bfloat16)
    opt.step()
    with pytest.raises(ValueError, match="state_name"):
        opt.get_unscaled_state(p, "momentum")
    value = randn(40, scale=3.0)
    opt.set_scaled_state(p, "exp_avg", value)
    assert opt.state[p]["exp_avg"].float().abs().max() == 448.0
    _within_format(opt.get_unscaled_state(p, "exp_avg"), value, E4M3,
                   opt.state[p]["state_scales"][0, 0])
    opt.set_scaled_state(p, "exp_avg_sq", value.abs())  # bf16: a plain cast, no factor
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg_sq"), value.abs().bfloat16().float())
    master = randn(40)
    opt.set_master_param(p, master)  # the param from the value, the fp16 master scaled
    assert torch.equal(p.detach(), master.bfloat16())
    _within_format(opt.get_master_param(p), master, torch.float16,
                   opt.state[p]["state_scales"][2, 0])


def test_fp32_params_and_capturable_with_scaled_moments(randn):
    p = torch.nn.Parameter(randn(50))
    q = torch.nn.Parameter(p.detach().clone())
    a = FusedAdam([p], lr=1e-2, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.uint8)
    b = FusedAdam([q], lr=1e-2, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.uint8,
                  capturable=True)
    for _ in range(3):
        g = randn(50)
        p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    assert torch.equal(p.detach(), q.detach())
    assert torch.equal(a.state[p]["exp_avg_sq"].view(torch.uint8),
                       b.state[q]["exp_avg_sq"].view(torch.uint8))


def test_empty_param_group_has_a_step_entry(randn):
    p = torch.nn.Parameter(randn(8))
    opt = FusedAdam([{"params": [p]}, {"params": []}], lr=1e-3)
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    p.grad = randn(8)
    opt.step()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 0]
    sd = opt.state_dict()
    assert [g["step"] for g in sd["param_groups"]] == [2, 0]
    te_style = {"state": sd["state"], "param_groups": [dict(g) for g in sd["param_groups"]]}
    del te_style["param_groups"][1]["step"]  # TE writes no step for an empty group
    opt2 = FusedAdam([{"params": [torch.nn.Parameter(p.detach().clone())]}, {"params": []}])
    opt2.load_state_dict(te_style)
    assert [g["step"] for g in opt2.param_groups] == [2, 0]


def test_resume_into_other_state_dtypes(randn):
    """A state dict saved with fp16 moments loads into FP8 moments (new factors, no overflow)."""
    p = torch.nn.Parameter(randn(64).to(torch.bfloat16))
    a = FusedAdam([p], lr=1e-2, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    p.grad = randn(64).to(torch.bfloat16)
    a.step()
    sd = a.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    b = FusedAdam([q], lr=1e-2, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    b.load_state_dict(sd)
    for row, name in enumerate(("exp_avg", "exp_avg_sq")):
        want = sd["state"][0][name]
        _within_format(b.get_unscaled_state(q, name), want, E4M3,
                       b.state[q]["state_scales"][row, 0])
