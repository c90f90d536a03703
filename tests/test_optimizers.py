"""cpu tier: FusedAdam / FusedSGD (through the PyTorch twins) against torch.optim, and the
master-weight contract for bf16 and FP8 params.

Parity: fp32 params against torch.optim.AdamW (adam_w_mode=True) and torch.optim.Adam
(adam_w_mode=False, weight decay as L2) over 10 steps at TE's fp32 tolerance; the op order
differs (torch divides sqrt(v) by sqrt(bc2), scales lr by 1/bc1 and decays the param before the
update), so results agree to rounding, not bits. The 32320x1024 tensor (a vocabulary-sized
embedding) also runs 10 steps; to keep it to seconds on the CPU its grads are one random draw
rescaled and sign-flipped per step instead of ten draws.
bf16 params with master weights: after every step each param is exactly its master rounded
to bf16, and the masters follow a pure fp32 AdamW on fp32 copies at fp32 tolerance. FP8 params
(Float8Tensor built by hand with the documented fields): fp8 data == cast(clamp(master *
scale)) bit for bit, scale_inv == 1/scale exactly, amax max-accumulated, transpose refreshed.
SGD against torch.optim.SGD over momentum / dampening / nesterov / weight decay.
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.tensor import Float8Tensor
from tritium.optimizers import FusedAdam, FusedSGD

from testlib import E4M3, E5M2, FP32_TOL, FP8_MAX

pytestmark = pytest.mark.cpu

SHAPES = [(1,), (1023,), (4096, 1024), (7, 33)]


def _params(randn, shapes, dtype=torch.float32):
    return [torch.nn.Parameter(randn(*s).to(dtype)) for s in shapes]


def _twins(params):
    """fp32 leaf copies for the torch.optim reference."""
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def _set_grads(randn, params, refs, dtype=None):
    for p, r in zip(params, refs):
        g = randn(*p.shape, scale=0.1)
        p.grad = g.to(dtype or p.dtype)
        r.grad = p.grad.float().clone()


def make_fp8(randn, shape, fp8_dtype=E4M3, scale_value=None, nominal=torch.bfloat16,
             amax=True, transpose=False):
    """A Float8Tensor param with the fields fp8_model_init provides: `_scale` a view of a
    module's scale tensor, `_scale_inv` = 1/scale, `_amax` an fp32 [1] slot (or None)."""
    x = randn(*shape, scale=0.5)
    limit = FP8_MAX[fp8_dtype]
    if scale_value is None:
        scale_value = limit / (2.0 * float(x.abs().max()))
    module_scales = torch.tensor([1.0, scale_value, 3.0], dtype=torch.float32)
    scale = module_scales[1:2]
    data = (x * scale).clamp(-limit, limit).to(fp8_dtype)
    t = data.t().contiguous() if transpose else None
    p = Float8Tensor(data, torch.ones(1) / scale, fp8_dtype, nominal, t, scale,
                     requires_grad=True)
    p._amax = torch.zeros(1) if amax else None
    return p


# ----------------------------------------------------------------------------- Adam parity
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fp32_matches_torch(randn, adam_w_mode):
    params = _params(randn, SHAPES)
    refs = _twins(params)
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = FusedAdam(params, adam_w_mode=adam_w_mode, **kw)
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(refs, foreach=False, **kw)
    start = [p.detach().clone() for p in params]
    for _ in range(10):
        _set_grads(randn, params, refs)
        opt.step()
        ref.step()
    for p, r, p0 in zip(params, refs, start):
        assert (p.detach() - p0).abs().max() > 1e-3  # the params did move
        torch.testing.assert_close(p.detach(), r.detach(), **FP32_TOL)
    for p, r in zip(params, refs):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[r]["exp_avg"], **FP32_TOL)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[r]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-12)
    assert opt.param_groups[0]["step"] == 10


def test_fp32_large_embedding_matches_torch(randn):
    params = _params(randn, [(32320, 1024)])
    refs = _twins(params)
    opt = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(refs, lr=1e-3, weight_decay=0.01)
    start = params[0].detach().clone()
    g = randn(32320, 1024)
    for step in range(10):
        params[0].grad = g * ((-1) ** step * (1 + 0.1 * step))
        refs[0].grad = params[0].grad.clone()
        opt.step()
        ref.step()
    assert not torch.equal(params[0].detach(), start)
    torch.testing.assert_close(params[0].detach(), refs[0].detach(), **FP32_TOL)


def test_bias_correction_off_formula(randn):
    p = torch.nn.Parameter(randn(257))
    w0 = p.detach().clone()
    g = randn(257, scale=0.1)
    opt = FusedAdam([p], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, bias_correction=False)
    p.grad = g
    opt.step()
    m = 0.2 * g
    v = 0.1 * g * g
    want = w0 - 1e-2 * (m / (v.sqrt() + 1e-6))
    torch.testing.assert_close(p.detach(), want, **FP32_TOL)


def test_param_groups_and_params_without_grad(randn):
    a, b, c = _params(randn, [(10,), (20,), (5,)])
    opt = FusedAdam([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=1e-3)
    c0 = c.detach().clone()
    a.grad, b.grad = randn(10), randn(20)
    opt.step()
    assert torch.equal(c.detach(), c0) and c not in opt.state
    assert opt.param_groups[1].get("step", 0) == 0
    c.grad = randn(5)
    opt.step()
    # group 1 took its first step with lr 0.5: Adam's first update is lr * sign-ish (|u| ~ 1)
    assert (c.detach() - c0).abs().max() > 0.3


def test_decoupled_grad_is_read(randn):
    p = torch.nn.Parameter(randn(64))
    q = torch.nn.Parameter(p.detach().clone())
    g = randn(64)
    p.grad = randn(64)          # ignored
    p.decoupled_grad = g.clone()
    q.grad = g.clone()
    FusedAdam([p], lr=1e-2, use_decoupled_grad=True).step()
    FusedAdam([q], lr=1e-2).step()
    assert torch.equal(p.detach(), q.detach())


def test_bf16_moments(randn):
    params = _params(randn, [(300,), (16, 16)])
    refs = _twins(params)
    opt = FusedAdam(params, lr=1e-2, exp_avg_dtype=torch.bfloat16,
                    exp_avg_sq_dtype=torch.bfloat16)
    ref = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        _set_grads(randn, params, refs)
        opt.step()
        ref.step()
    for p, r in zip(params, refs):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=2e-3)


def test_capturable_on_cpu_equals_host_bias_correction(randn):
    """capturable=True computes bias corrections on the device (float64, rounded to fp32);
    on the CPU that is bit for bit the host's float64 result."""
    params = _params(randn, [(50,), (4, 9)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = FusedAdam(params, lr=1e-2, weight_decay=0.1, capturable=True)
    b = FusedAdam(twins, lr=1e-2, weight_decay=0.1)
    assert isinstance(a.param_groups[0]["lr"], torch.Tensor)
    for _ in range(6):
        for p, q in zip(params, twins):
            p.grad = randn(*p.shape)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(params, twins):
        assert torch.equal(p.detach(), q.detach())
    assert int(a.param_groups[0]["step"].item()) == 6


# ----------------------------------------------------------------------------- master weights
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_with_master(randn, dtype):
    params = _params(randn, [(1,), (1023,), (64, 48)], dtype)
    refs = _twins(params)
    kw = dict(lr=1e-2, weight_decay=0.01)
    opt = FusedAdam(params, master_weights=True, **kw)
    ref = torch.optim.AdamW(refs, **kw)
    for _ in range(10):
        _set_grads(randn, params, refs)
        opt.step()
        ref.step()
        for p in params:
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32
            assert torch.equal(p.detach(), master.to(dtype))
    for p, r in zip(params, refs):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), **FP32_TOL)
        assert torch.equal(opt.get_master_param(p), opt.state[p]["master_param"])


def test_fp32_params_have_no_master(randn):
    p = torch.nn.Parameter(randn(8))
    opt = FusedAdam([p], master_weights=True)
    p.grad = randn(8)
    opt.step()
    assert opt.state[p]["master_param"] is None and opt.get_master_param(p) is None


def test_16bit_params_without_master(randn):
    """master_weights=False: the bf16 param is the weight (read, updated in fp32, rounded)."""
    p = torch.nn.Parameter(randn(500).bfloat16())
    r = torch.nn.Parameter(p.detach().float())
    opt = FusedAdam([p], lr=1e-2)
    p.grad = randn(500).bfloat16()
    r.grad = p.grad.float()
    opt.step()
    torch.optim.AdamW([r], lr=1e-2, weight_decay=0.0).step()
    assert opt.state[p]["master_param"] is None
    assert torch.equal(p.detach(), r.detach().bfloat16())


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_fp8_params_with_master(randn, fp8_dtype):
    params = [make_fp8(randn, (64, 32), fp8_dtype, transpose=True),
              make_fp8(randn, (77,), fp8_dtype),
              make_fp8(randn, (3, 5), fp8_dtype, amax=False)]
    refs = [torch.nn.Parameter(p.dequantize(torch.float32)) for p in params]
    kw = dict(lr=2e-2, weight_decay=0.01)
    opt = FusedAdam(params, master_weights=True, **kw)
    ref = torch.optim.AdamW(refs, **kw)
    limit = FP8_MAX[fp8_dtype]
    seen_amax = [torch.zeros(1) for _ in params]
    for _ in range(5):
        _set_grads(randn, params, refs, dtype=torch.bfloat16)
        opt.step()
        ref.step()
        for i, p in enumerate(params):
            master = opt.state[p]["master_param"]
            want = (master * p._scale).clamp(-limit, limit).to(fp8_dtype)
            assert torch.equal(p._data.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(p._scale_inv, torch.ones(1) / p._scale)
            seen_amax[i] = torch.maximum(seen_amax[i], master.abs().max().reshape(1))
            if p._amax is not None:
                assert torch.equal(p._amax, seen_amax[i])
            if p._transpose is not None:
                assert torch.equal(p._transpose.view(torch.uint8), p._data.t().view(torch.uint8))
    for p, r in zip(params, refs):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), **FP32_TOL)
    assert params[0]._scale.data_ptr() != params[0]._scale_inv.data_ptr()


def test_fp8_scale_is_read_not_written(randn):
    p = make_fp8(randn, (40,), scale_value=8.0)
    module_scales = p._scale._base
    before = module_scales.clone()
    opt = FusedAdam([p], master_weights=True, lr=1e-2)
    p.grad = randn(40).bfloat16()
    opt.step()
    assert torch.equal(module_scales, before)
    # A new scale (the module's update) is used at the next step.
    module_scales[1] = 32.0
    p.grad = randn(40).bfloat16()
    opt.step()
    assert torch.equal(p._scale_inv, torch.tensor([1 / 32.0]))
    want = (opt.state[p]["master_param"] * 32.0).clamp(-448, 448).to(E4M3)
    assert torch.equal(p._data.view(torch.uint8), want.view(torch.uint8))


def test_set_master_param(randn):
    p = torch.nn.Parameter(randn(33).bfloat16())
    f = make_fp8(randn, (6, 4))
    opt = FusedAdam([p, f], master_weights=True)
    value = randn(33)
    opt.set_master_param(p, value)
    assert torch.equal(opt.get_master_param(p), value)
    assert torch.equal(p.detach(), value.bfloat16())
    v8 = randn(6, 4, scale=0.3)
    opt.set_master_param(f, v8)
    assert torch.equal(opt.get_master_param(f), v8)
    assert torch.equal(f._data.view(torch.uint8),
                       (v8 * f._scale).clamp(-448, 448).to(E4M3).view(torch.uint8))
    assert torch.equal(f._amax, v8.abs().max().reshape(1))
    # the next step starts from the given master
    p.grad = randn(33).bfloat16()
    opt.step()
    assert not torch.equal(opt.get_master_param(p), value)
    with pytest.raises(ValueError, match="shape"):
        opt.set_master_param(p, randn(34))


# ----------------------------------------------------------------------------- SGD
SGD_CASES = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, dampening=0.3),
             dict(momentum=0.9, nesterov=True), dict(momentum=0.8, weight_decay=0.05),
             dict(weight_decay=0.05), dict(momentum=0.9, nesterov=True, weight_decay=0.01)]


@pytest.mark.parametrize("case", SGD_CASES,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_matches_torch(randn, case):
    params = _params(randn, [(1,), (1023,), (128, 64)])
    refs = _twins(params)
    opt = FusedSGD(params, lr=0.05, **case)
    ref = torch.optim.SGD(refs, lr=0.05, foreach=False, **case)
    for _ in range(10):
        _set_grads(randn, params, refs)
        opt.step()
        ref.step()
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.detach(), r.detach(), **FP32_TOL)
        if case.get("momentum"):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                       ref.state[r]["momentum_buffer"], **FP32_TOL)


def test_sgd_first_buffer_is_the_grad(randn):
    p = torch.nn.Parameter(randn(10))
    opt = FusedSGD([p], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
    w0 = p.detach().clone()
    p.grad = randn(10)
    opt.step()
    d = p.grad + 0.1 * w0
    assert torch.equal(opt.state[p]["momentum_buffer"], d)


def test_sgd_wd_after_momentum(randn):
    p = torch.nn.Parameter(randn(10))
    w0 = p.detach().clone()
    opt = FusedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True)
    p.grad = randn(10)
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], p.grad)
    torch.testing.assert_close(p.detach(), w0 - 0.1 * (p.grad + 0.1 * w0), **FP32_TOL)


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8"])
def test_sgd_master_weights(randn, kind):
    if kind == "fp8":
        params = [make_fp8(randn, (32, 16)), make_fp8(randn, (9,))]
        refs = [torch.nn.Parameter(p.dequantize(torch.float32)) for p in params]
    else:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float16
        params = _params(randn, [(32, 16), (9,)], dtype)
        refs = _twins(params)
    opt = FusedSGD(params, lr=0.05, momentum=0.9, master_weights=True)
    ref = torch.optim.SGD(refs, lr=0.05, momentum=0.9)
    for _ in range(5):
        _set_grads(randn, params, refs, dtype=torch.bfloat16 if kind == "fp8" else None)
        opt.step()
        ref.step()
        for p in params:
            master = opt.state[p]["master_param"]
            if kind == "fp8":
                want = (master * p._scale).clamp(-448, 448).to(E4M3)
                assert torch.equal(p._data.view(torch.uint8), want.view(torch.uint8))
                assert torch.equal(p._scale_inv, torch.ones(1) / p._scale)
            else:
                assert torch.equal(p.detach(), master.to(p.dtype))
    for p, r in zip(params, refs):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), **FP32_TOL)
