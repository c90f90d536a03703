"""`tritium.kernels.adam` / `tritium.kernels.sgd` == `tritium.ref.adam` / `tritium.ref.sgd` under
the Triton interpreter, BIT FOR BIT (elementwise math in the same order, IEEE division and
square root: no reduction, so nothing may differ).

Every case runs one launch over several tensors of odd sizes (1, 31, 32, 33, 100, 130): under
the interpreter a program takes a chunk of 64 elements in steps of 32, so tensors end inside a
step, exactly at a step or chunk edge, and span several chunks. Params: fp32, bf16 and fp16
(with and without fp32 masters), FP8 e4m3/e5m2 (with masters, amax slot or none, values that
the scale pushes past the fp8 range so the clamp matters), bf16 remainders; grads fp32/bf16/
fp16; moments fp32/bf16; AdamW/L2 and decay on/off; hyperparameters from the host
(capturable=False) and from device-side tensors (capturable=True); 16-byte aligned and
misaligned storage (the kernel's vectorization hint must only be given when true). Then whole
FusedAdam / FusedSGD runs (kernel vs TRITIUM_FORCE_REF=1) over several steps.
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.tensor import Float8Tensor
from tritium.kernels import adam as kadam
from tritium.kernels import sgd as ksgd
from tritium.optimizers import FusedAdam, FusedSGD
from tritium.ref import adam as radam
from tritium.ref import sgd as rsgd

from testlib import WrappedWeight

from ._helpers import assert_same_bits, assert_same_optimizer_results, wide_randn

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

SIZES = [1, 31, 32, 33, 100, 130]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def _storage(n, dtype, aligned):
    """A contiguous tensor of n elements; misaligned = a view 1 element into a buffer."""
    if aligned:
        return torch.empty(n, dtype=dtype)
    return torch.empty(n + 1, dtype=dtype)[1:]


def _group(gen, kind, grad_dtype, moment_dtype, aligned=True):
    """Lists (params, grads, m, v, masters, fp8_meta, remainders) for one launch."""
    params, grads, ms, vs, masters, metas, rems = [], [], [], [], [], [], []
    for n in SIZES:
        w = wide_randn((n,), torch.float32, gen, decades=2.0)
        g = _storage(n, grad_dtype, aligned)
        g.copy_(wide_randn((n,), torch.float32, gen, decades=2.0).clamp(-6e4, 6e4))
        m = _storage(n, moment_dtype, aligned)
        m.copy_(torch.randn(n, generator=gen) * 0.1)
        v = _storage(n, moment_dtype, aligned)
        v.copy_(torch.rand(n, generator=gen) * 0.01)
        if kind in ("e4m3", "e5m2"):
            fp8 = E4M3 if kind == "e4m3" else E5M2
            scale = torch.tensor([FP8_MAX[fp8] / 20.0])   # |w| up to ~100: some clamp
            p = _storage(n, fp8, aligned)
            p.copy_((w * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8))
            amax = torch.rand(1, generator=gen) * 50 if n % 2 else None
            metas.append((scale, torch.zeros(1), amax))
            masters.append(w)
        elif kind.startswith("rem"):
            p = _storage(n, torch.bfloat16, aligned)
            bits, rem = radam.split_remainder(w)
            p.view(torch.int16).copy_(bits)
            rems.append(rem)
        else:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
                kind.split("+")[0]]
            p = _storage(n, dtype, aligned)
            p.copy_(w.clamp(-6e4, 6e4))
            if kind.endswith("+master"):
                masters.append(w)
        params.append(p)
        grads.append(g)
        ms.append(m)
        vs.append(v)
    return [params, grads, ms, vs, masters or None, metas or None, rems or None]


def _clone(lists):
    out = []
    for xs in lists:
        if xs is None or not xs:
            out.append(xs)
        elif isinstance(xs[0], tuple):
            out.append([tuple(None if t is None else t.clone() for t in tup) for tup in xs])
        else:
            out.append([x.clone() for x in xs])
    return out


def _assert_lists_equal(a, b, names):
    for name, xs, ys in zip(names, a, b):
        if xs is None:
            assert ys is None
            continue
        for i, (x, y) in enumerate(zip(xs, ys)):
            if isinstance(x, tuple):
                for j, (s, t) in enumerate(zip(x, y)):
                    assert_same_bits(s, t, f"{name}[{i}][{j}]", nan_as_nan=True)
            else:
                assert_same_bits(x, y, f"{name}[{i}]", nan_as_nan=True)


def _adam_hp(capturable, step=3, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, wd=0.05):
    b1, b2 = betas
    consts = [b1, 1 - b1, b2, 1 - b2, eps, wd]
    if not capturable:
        return torch.tensor([lr, 1 - b1 ** step, 1 - b2 ** step] + consts, dtype=torch.float32)
    # the device-side form of FusedAdam(capturable=True)._hp
    step_t = torch.tensor(float(step))
    bc = (1.0 - torch.pow(torch.tensor([b1, b2], dtype=torch.float64), step_t.double())).float()
    return torch.cat([torch.tensor([lr]), bc, torch.tensor(consts)])


NAMES = ["params", "grads", "exp_avg", "exp_avg_sq", "masters", "fp8_meta", "remainders"]
ADAM_CASES = [
    # kind, grad dtype, moment dtype, adam_w, decay, capturable, aligned
    ("fp32", torch.float32, torch.float32, True, True, False, True),
    ("fp32", torch.float32, torch.float32, False, True, True, True),
    ("fp32", torch.float32, torch.bfloat16, True, False, False, False),
    ("bf16+master", torch.bfloat16, torch.float32, True, True, True, True),
    ("bf16+master", torch.float32, torch.bfloat16, False, True, False, False),
    ("fp16+master", torch.float16, torch.float32, True, True, False, True),
    ("bf16", torch.bfloat16, torch.float32, True, True, False, True),
    ("fp16", torch.float16, torch.float32, False, False, True, True),
    ("e4m3", torch.bfloat16, torch.float32, True, True, False, True),
    ("e4m3", torch.float32, torch.float32, False, True, True, False),
    ("e5m2", torch.bfloat16, torch.bfloat16, True, True, False, True),
    ("rem", torch.bfloat16, torch.float32, True, True, False, True),
    ("rem", torch.bfloat16, torch.float32, False, True, True, False),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_adam_kernel_equals_ref(gen, case):
    kind, gdt, mdt, adam_w, decay, capturable, aligned = case
    lists = _group(gen, kind, gdt, mdt, aligned)
    twin, before = _clone(lists), _clone(lists)
    hp = _adam_hp(capturable)
    kadam.adam_step(*lists, hp, adam_w_mode=adam_w, weight_decay=decay, cache={})
    radam.adam_step(*twin, hp, adam_w_mode=adam_w, weight_decay=decay)
    _assert_lists_equal(lists, twin, NAMES)
    weights = 4 if lists[4] is not None else 0   # masters, else the params themselves
    assert not torch.equal(lists[weights][-1], before[weights][-1])
    assert not torch.equal(lists[2][-1], before[2][-1])


def test_adam_kernel_moves_values_and_clamps_fp8(gen):
    lists = _group(gen, "e4m3", torch.bfloat16, torch.float32)
    before = [m.clone() for m in lists[4]]
    kadam.adam_step(*lists, _adam_hp(False), adam_w_mode=True, weight_decay=True)
    assert all(not torch.equal(a, b) for a, b in zip(before, lists[4]) if a.numel() > 1)
    data = torch.cat([p.float() for p in lists[0]])
    assert data.abs().max() == 448.0  # some values were past the range: clamped, not NaN
    for (scale, scale_inv, amax), master in zip(lists[5], lists[4]):
        assert torch.equal(scale_inv, 1 / scale)
        if amax is not None:
            assert amax >= master.abs().max()


SGD_CASES = [
    # kind, grad dtype, momentum, first, nesterov, decay, wd_after
    ("fp32", torch.float32, True, True, False, True, False),
    ("fp32", torch.float32, True, False, True, True, False),
    ("fp32", torch.bfloat16, False, False, False, True, False),
    ("bf16+master", torch.bfloat16, True, False, False, True, True),
    ("fp16+master", torch.float16, True, True, True, False, False),
    ("bf16", torch.bfloat16, True, False, False, False, False),
    ("e4m3", torch.bfloat16, True, False, True, True, False),
    ("e5m2", torch.float32, False, False, False, True, True),
]


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sgd_kernel_equals_ref(gen, case):
    kind, gdt, momentum, first, nesterov, decay, wd_after = case
    params, grads, bufs, _, masters, metas, _ = _group(gen, kind, gdt, torch.float32)
    lists = [params, grads, bufs if momentum else None, masters, metas]
    twin = _clone(lists)
    hp = torch.tensor([0.05, 0.9, 0.7, 0.01], dtype=torch.float32)
    kw = dict(weight_decay=decay, wd_after_momentum=wd_after, nesterov=nesterov, first=first)
    ksgd.sgd_step(*lists, hp, cache={}, **kw)
    rsgd.sgd_step(*twin, hp, **kw)
    _assert_lists_equal(lists, twin, ["params", "grads", "momentum", "masters", "fp8_meta"])


def test_several_launches_reuse_the_tables(gen):
    """The cached tables follow a grad that moved to a new address."""
    lists = _group(gen, "bf16+master", torch.bfloat16, torch.float32)
    twin = _clone(lists)
    cache = {}
    hp = _adam_hp(False)
    for step in range(3):
        if step == 2:
            lists[1] = [g.clone() for g in lists[1]]  # new grad tensors, same values
        kadam.adam_step(*lists, hp, adam_w_mode=True, weight_decay=True, cache=cache)
        radam.adam_step(*twin, hp, adam_w_mode=True, weight_decay=True)
    _assert_lists_equal(lists, twin, NAMES)


# ----------------------------------------------------------------------------- whole optimizers
def _fp8_param(gen, shape, fp8=E4M3):
    x = torch.randn(shape, generator=gen)
    scale = torch.tensor([4.0, FP8_MAX[fp8] / 4.0])[1:]
    data = (x * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    p = Float8Tensor(data, 1 / scale, fp8, torch.bfloat16, data.t().contiguous(), scale,
                     requires_grad=True)
    p._amax = torch.zeros(1)
    return p


def _model(gen):
    return [torch.nn.Parameter(torch.randn(37, generator=gen)),
            torch.nn.Parameter(torch.randn(5, 20, generator=gen).bfloat16()),
            torch.nn.Parameter(torch.randn(70, generator=gen).bfloat16()),
            _fp8_param(gen, (8, 12))]


def _copy(params):
    out = []
    for p in params:
        if isinstance(p, Float8Tensor):
            q = Float8Tensor(p._data.clone(), p._scale_inv.clone(), p._fp8_dtype, p.dtype,
                             p._transpose.clone(), p._scale.clone(), requires_grad=True)
            q._amax = p._amax.clone()
            out.append(q)
        else:
            out.append(torch.nn.Parameter(p.detach().clone()))
    return out


def _run(make_opt, params, grads):
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adam_kernel_equals_ref(gen, setenv, capturable):
    base = _model(gen)
    grads = [[torch.randn(p.shape, generator=gen) for p in base] for _ in range(3)]

    def make(ps):
        return FusedAdam([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2}], lr=1e-2,
                         weight_decay=0.1, master_weights=True, capturable=capturable)
    kp, rp = _copy(base), _copy(base)
    kopt = _run(make, kp, grads)
    setenv("TRITIUM_FORCE_REF", "1")
    ropt = _run(make, rp, grads)
    assert_same_optimizer_results(kp, kopt, rp, ropt)


def test_fused_sgd_kernel_equals_ref(gen, setenv):
    base = _model(gen)
    grads = [[torch.randn(p.shape, generator=gen) for p in base] for _ in range(3)]

    def make(ps):
        return FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                        master_weights=True)
    kp, rp = _copy(base), _copy(base)
    kopt = _run(make, kp, grads)
    setenv("TRITIUM_FORCE_REF", "1")
    ropt = _run(make, rp, grads)
    for a, b in zip(kp, rp):
        assert_same_bits(a._data if isinstance(a, Float8Tensor) else a.detach(),
                         b._data if isinstance(b, Float8Tensor) else b.detach(), "param")
        assert_same_bits(kopt.state[a]["momentum_buffer"], ropt.state[b]["momentum_buffer"], "buf")


# ----------------------------------------------------------------------------- scaled states
SCALED_CASES = [
    # kind, exp_avg storage, exp_avg_sq storage, master storage (None: as the kind has it)
    ("fp32", torch.float16, E4M3, None),
    ("bf16+master", E4M3, E4M3, torch.float16),
    ("bf16+master", torch.bfloat16, torch.float16, torch.float16),
    ("e4m3", E4M3, torch.float32, torch.float16),
    ("rem", torch.float16, E4M3, None),
    ("fp16+master", torch.float32, torch.float32, torch.float16),
]


def _scale_states(lists, mdt, vdt, wdt):
    """Turn a group's moments (and masters) into scaled storage + their factor tables."""
    tables = []
    for i in range(len(lists[0])):
        table = torch.zeros(3, 3)
        for col, dt, row in ((2, mdt, 0), (3, vdt, 1), (4, wdt, 2)):
            if lists[col] is None or dt is None:
                continue
            x = lists[col][i]
            if radam.is_scaled(dt):
                stored = torch.empty(x.shape, dtype=dt)
                radam.quantize_state(stored, table, row, x)
                lists[col][i] = stored
            else:
                lists[col][i] = x.to(dt)
        tables.append(table)
    return lists + [tables]


@pytest.mark.parametrize("case", SCALED_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("capturable", [False, True])
def test_adam_kernel_scaled_states_equal_ref(gen, case, capturable):
    kind, mdt, vdt, wdt = case
    lists = _scale_states(_group(gen, kind, torch.bfloat16, torch.float32), mdt, vdt, wdt)
    twin, before = _clone(lists), _clone(lists)
    hp = _adam_hp(capturable)
    kw = dict(adam_w_mode=True, weight_decay=True)
    kadam.adam_step(*lists[:7], hp, cache={}, state_scales=lists[7], **kw)
    radam.adam_step(*twin[:7], hp, state_scales=twin[7], **kw)
    _assert_lists_equal(lists, twin, NAMES + ["state_scales"])
    for col in (2, 3):  # the moments moved and, where scaled, got new factors
        assert not torch.equal(lists[col][-1].float(), before[col][-1].float())
    for i, (dt, row) in enumerate(((mdt, 0), (vdt, 1))):
        if radam.is_scaled(dt):
            assert not torch.equal(lists[7][-1][row, 0], before[7][-1][row, 0])


@pytest.mark.parametrize("config", [
    dict(master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.float16),
    dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.uint8, store_param_remainders=True),
])
def test_fused_adam_scaled_states_kernel_equals_ref(gen, setenv, config):
    base = _model(gen)
    grads = [[torch.randn(p.shape, generator=gen) for p in base] for _ in range(3)]

    def make(ps):
        return FusedAdam(ps, lr=1e-2, weight_decay=0.1, master_weights=True, **config)
    kp, rp = _copy(base), _copy(base)
    kopt = _run(make, kp, grads)
    setenv("TRITIUM_FORCE_REF", "1")
    ropt = _run(make, rp, grads)
    assert_same_optimizer_results(kp, kopt, rp, ropt)
    for a, b in zip(kp, rp):
        assert_same_bits(kopt.state[a]["state_scales"], ropt.state[b]["state_scales"], "scales")


def test_fused_adam_kernel_on_dtensor_shards():
    """FusedAdam's kernel steps DTensor params (fully_shard over a 1-process gloo group) on their
    local tensors: the same bits as the kernel on plain params, state kept as DTensors."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    import tritium as te
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = te.Linear(32, 48, params_dtype=torch.bfloat16, device="cpu")
        sharded = te.Linear(32, 48, params_dtype=torch.bfloat16, device="cpu")
        sharded.load_state_dict(plain.state_dict())
        fully_shard(sharded)
        opts = [FusedAdam(m.parameters(), lr=1e-2, master_weights=True) for m in (plain, sharded)]
        for step in range(2):
            for p, q in zip(plain.parameters(), sharded.parameters()):
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
                q.grad = distribute_tensor(p.grad, q.device_mesh, q.placements)
            for o in opts:
                o.step()
        for p, q in zip(plain.parameters(), sharded.parameters()):
            assert isinstance(opts[1].state[q]["exp_avg"], DTensor)
            assert_same_bits(q.full_tensor(), p.detach())
            assert_same_bits(opts[1].get_master_param(q).full_tensor(), opts[0].get_master_param(p))
    finally:
        dist.destroy_process_group()


def test_fused_adam_kernel_steps_the_inside_of_a_weight_wrapper(gen):
    """A param wrapped by another library (torchao's float8 weights under FSDP2) is stepped on
    its inner tensor, also once the wrapper carries a precomputed scale beside it: the kernel
    reads raw pointers and a wrapper has none. Same bits as plain."""
    plain = [torch.nn.Parameter(wide_randn((n,), torch.bfloat16, gen, decades=1.0))
             for n in (33, 130)]
    wrapped = [torch.nn.Parameter(WrappedWeight(p.detach().clone())) for p in plain]
    before = [p.detach().clone() for p in plain]
    opts = [FusedAdam(ps, lr=1e-2, master_weights=True) for ps in (plain, wrapped)]
    for step in range(2):
        for p, q in zip(plain, wrapped):
            q._precomputed_scale = torch.ones(()) if step else None
            p.grad = wide_randn(p.shape, torch.bfloat16, gen, decades=1.0)
            q.grad = p.grad.clone()
        for o in opts:
            o.step()
    for p, q, b in zip(plain, wrapped, before):
        assert isinstance(q, WrappedWeight) and not torch.equal(q._tensor, b)
        assert_same_bits(q._tensor, p.detach())
