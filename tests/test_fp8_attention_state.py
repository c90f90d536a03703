"""cpu tier: FP8 attention's delayed-scaling state in checkpoints (DotProductAttention extra state).

* Round trip: a TransformerLayer trained 3 steps under DelayedScaling(fp8_dpa=True) is saved
  with torch.save, loaded with torch.load(weights_only=True) into a fresh layer (another init),
  and both step on: outputs, gradients, params and every FP8 state stay bit-identical (the next
  step's q/k/v casts use the saved scales).
* Older checkpoints (no `core_attention._extra_state` entry) and ones saved without fp8_dpa (None)
  load with strict=True and leave the attention state empty; strict still reports other keys.
* A bad saved state (slots, history length vs its recipe, version, dtype, missing tensors, a
  recipe without a state) raises an error naming the module and the fix, changing nothing
  (MultiheadAttention checks its core attention's entry before any of its submodules loads).
* DCP (tritium.distributed.checkpointing, one process): the attention state goes through like
  the GEMM modules' state and resumes bit for bit; an older DCP checkpoint loads too.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tritium as te
from tritium import recipe

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

RCP = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4, margin=1)
KEY = "self_attention.core_attention._extra_state"


def _layer(seed):
    torch.manual_seed(seed)
    return te.TransformerLayer(128, 256, 2, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, device="cpu")


def _step(model, opt, x, rcp=RCP):
    x = x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=rcp):
        y = model(x)
    opt.zero_grad()
    y.float().square().mean().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    opt.step()
    return [y.detach()] + grads


def _states(model):
    out = {}
    for name, m in model.named_modules():
        states = [("attn", getattr(m, "fp8_attn_state", None))]
        if hasattr(m, "fp8_meta"):
            states += [("fwd", m.fp8_meta.fwd), ("bwd", m.fp8_meta.bwd)]
        for tag, st in states:
            if st is not None:
                out[f"{name}.{tag}.scale"] = st.scale
                out[f"{name}.{tag}.hist"] = st.amax_history
    return out


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = list(a.values()), list(b.values())
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


def _round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture
def trained(randn):
    data = [randn(32, 2, 128, scale=1.5 ** k).to(torch.bfloat16) for k in range(5)]
    model = _layer(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for x in data[:3]:
        _step(model, opt, x)
    return model, opt, data


def test_round_trip_resumes_bit_identically(trained):
    model, opt, data = trained
    ckpt = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    extra = ckpt["model"][KEY]
    assert extra["version"] == 1 and extra["recipe"] == RCP.to_dict()
    assert extra["qkv_amax_history"].shape == (4, 3)
    assert not torch.equal(extra["qkv_scale"], torch.ones(3))   # the scales have moved
    fresh = _layer(1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh.self_attention.layernorm_qkv.query_weight,
                           model.self_attention.layernorm_qkv.query_weight)
    fresh.load_state_dict(ckpt["model"], strict=True)
    fresh_opt.load_state_dict(ckpt["opt"])
    st = fresh.self_attention.core_attention.fp8_attn_state
    assert st.recipe == RCP and st.fp8_dtype == torch.float8_e4m3fn
    _assert_same(_states(fresh), _states(model))
    for x in data[3:]:
        _assert_same(_step(model, opt, x), _step(fresh, fresh_opt, x))
        _assert_same(dict(model.named_parameters()), dict(fresh.named_parameters()))
        _assert_same(_states(model), _states(fresh))


def test_older_checkpoints_load_strict_and_start_fresh(trained, randn):
    model, opt, data = trained
    sd = dict(model.state_dict())
    del sd[KEY]                          # written before the attention state was saved
    fresh = _layer(1)
    _step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.0), data[0])   # it has a state now
    fresh.load_state_dict(_round_trip(sd), strict=True)
    assert fresh.self_attention.core_attention.fp8_attn_state is None
    _assert_same(dict(model.named_parameters()), dict(fresh.named_parameters()))
    # the state starts fresh, as a model that never ran: scales 1 at the first step
    other = _layer(1)
    other.load_state_dict(sd)
    _assert_same(_step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.0), data[3]),
                 _step(other, torch.optim.SGD(other.parameters(), lr=0.0), data[3]))
    # saved without fp8_dpa: None; strict loading still reports other missing keys
    plain = _layer(2)
    psd = plain.state_dict()
    assert psd[KEY] is None
    fresh.load_state_dict(_round_trip(psd), strict=True)
    assert fresh.self_attention.core_attention.fp8_attn_state is None
    del psd["self_attention.layernorm_qkv.query_weight"]
    with pytest.raises(RuntimeError, match="self_attention.layernorm_qkv.query_weight"):
        fresh.load_state_dict(psd, strict=True)


def _bad(good):
    def edit(**changes):
        return {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in good.items()},
                **changes}
    return {
        "slots": (edit(qkv_scale=torch.ones(2), qkv_amax_history=torch.zeros(4, 2)), "3 slots"),
        "history-len": (edit(qkv_amax_history=torch.zeros(8, 3)), "amax_history_len is 4"),
        "version": (edit(version=2), "version 2"),
        "dtype": (edit(qkv_scale=torch.ones(3, dtype=torch.float64)), "float32"),
        "missing": ({k: v for k, v in good.items() if k != "qkv_scale"}, "lacks qkv_scale"),
        "current-recipe": (edit(recipe=recipe.Float8CurrentScaling(fp8_dpa=True).to_dict()),
                           "only DelayedScaling"),
        "not-a-dict": ([1, 2], "got list"),
    }


@pytest.mark.parametrize("case", list(_bad({"recipe": {}})))
def test_bad_state_names_the_module_and_changes_nothing(trained, case):
    model, _, _ = trained
    attn = model.self_attention.core_attention
    bad, words = _bad(attn.get_extra_state())[case]
    before = _states(model)
    before = {k: v.clone() for k, v in before.items()}
    with pytest.raises(ValueError, match=words) as err:
        attn.set_extra_state(bad)
    assert "drop this _extra_state entry" in str(err.value)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    sd = {k: (v + 1 if torch.is_tensor(v) and v.is_floating_point() else v)
          for k, v in model.state_dict().items()}    # other values, all of which must not load
    sd[KEY] = bad
    with pytest.raises(ValueError, match="'self_attention.core_attention'.*" + words):
        model.load_state_dict(sd)
    _assert_same(_states(model), before)
    _assert_same(dict(model.named_parameters()), params)


def test_dcp_round_trip_and_older_checkpoint(trained, tmp_path):
    from tritium.distributed import checkpointing
    model, opt, data = trained
    checkpointing.save(str(tmp_path / "new"), model, opt)
    fresh = _layer(1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="fp8_recipe="):
        checkpointing.load(str(tmp_path / "new"), fresh, fresh_opt)
    checkpointing.load(str(tmp_path / "new"), fresh, fresh_opt, fp8_recipe=RCP)
    _assert_same(_states(fresh), _states(model))
    for x in data[3:]:
        _assert_same(_step(model, opt, x), _step(fresh, fresh_opt, x))
        _assert_same(_states(model), _states(fresh))
    # an older checkpoint (no entry for the attention state) and one saved without it (None)
    # load into a model that has one, which then has none (GEMM states and params load)
    for name, value in (("older", "drop"), ("none", None)):
        state = checkpointing.get_state_dict(model, opt)
        if value == "drop":
            del state["model"][KEY]
        else:
            state["model"][KEY] = None
        dcp.save(state, checkpoint_id=str(tmp_path / name))
        checkpointing.load(str(tmp_path / name), fresh, fresh_opt)
        assert fresh.self_attention.core_attention.fp8_attn_state is None
        _assert_same(dict(model.named_parameters()), dict(fresh.named_parameters()))
        _assert_same({k: v for k, v in _states(model).items() if ".attn." not in k},
                     _states(fresh))
        _step(fresh, fresh_opt, data[0])     # a fresh attention state again
