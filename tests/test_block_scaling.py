"""Block-scaled FP8 (Float8BlockScaling) and MXFP8 emulation: recipes, casts, Linear, accuracy.

The Linear checks compare with an emulation written here from the recipe's definition
(DESIGN.md section 13, OCP MX v1.0), not from tritium's code: quantize each block with
scale = 2^floor(log2(448 / amax)), dequantize, multiply slice by slice (128 of K) in fp32.
"""
from __future__ import annotations

import math

import pytest
import torch

import tritium as te
from tritium import recipe
from tritium.fp8.global_state import is_fp8_block_scaling_available, is_mxfp8_available
from tritium.fp8.recipe import recipe_from_dict
from tritium.ref.block_cast import e8m0_bits, quantize_blocks, quantize_mx
from testlib import FP32_TOL

pytestmark = pytest.mark.cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ------------------------------------------------------------------------------ recipes
def test_float8_block_scaling_defaults_are_te_s():
    r = recipe.Float8BlockScaling()
    assert r.fp8_format is recipe.Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == recipe.QParams(power_2_scale=True, amax_epsilon=0.0)
    for mm in (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad):
        assert mm.use_split_accumulator
    assert r.float8_block_scaling() and not r.float8_per_tensor_scaling() and not r.delayed()
    assert recipe.MXFP8BlockScaling().mxfp8()
    assert recipe.MXFP8BlockScaling().fp8_format is recipe.Format.E4M3
    assert is_fp8_block_scaling_available() and is_mxfp8_available()


@pytest.mark.parametrize("kwargs,error", [
    (dict(fp8_format=recipe.Format.E5M2), ValueError),
    (dict(w_block_scaling_dim=3), ValueError),
    (dict(x_block_scaling_dim=2, w_block_scaling_dim=2), ValueError),
    (dict(w_block_scaling_dim=2, grad_block_scaling_dim=2), ValueError),
    (dict(x_block_scaling_dim=2, w_block_scaling_dim=1), NotImplementedError),
    (dict(fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=False)), ValueError),
    (dict(fp8_quant_fwd_inp=recipe.QParams(amax_epsilon=-1.0)), ValueError),
    (dict(fp8_dpa=True), NotImplementedError),
])
def test_float8_block_scaling_validation(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs)).split("_")[0]):
        recipe.Float8BlockScaling(**kwargs)


@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(
    fp8_format=recipe.Format.HYBRID, w_block_scaling_dim=1,
    fp8_quant_bwd_grad=recipe.QParams(power_2_scale=False, amax_epsilon=1e-6)),
    recipe.MXFP8BlockScaling(fp8_format=recipe.Format.HYBRID)])
def test_block_recipes_round_trip_through_dicts(r):
    assert recipe_from_dict(r.to_dict()) == r


# ------------------------------------------------------------------------------ casts
def _emulated_blocks(x, fp8_dtype=E4M3, block_2d=False):
    """Quantize then dequantize x [M, K] in 1x128 tiles (or 128x128 blocks), from the recipe."""
    limit = torch.finfo(fp8_dtype).max
    m, k = x.shape
    out = torch.empty(m, k)
    rows = range(0, m, 128) if block_2d else range(m)
    for r0 in rows:
        r1 = min(m, r0 + 128) if block_2d else r0 + 1
        for c0 in range(0, k, 128):
            blk = x[r0:r1, c0:c0 + 128].float()
            amax = blk.abs().max().item()
            scale = 1.0 if amax == 0 else 2.0 ** math.floor(math.log2(limit / amax))
            q = (blk * scale).clamp(-limit, limit).to(fp8_dtype)
            out[r0:r1, c0:c0 + 128] = q.float() / scale
    return out


def test_1x128_and_128x128_casts_match_the_definition(randn):
    x = randn(130, 300) * torch.logspace(-3, 3, 130)[:, None]
    x[5, :128] = 0
    q = quantize_blocks(x, E4M3, rowwise=True, columnwise=True)
    assert q.scale_inv.shape == (3, 130) and q.scale_inv_t.shape == (2, 300)  # slice-major
    deq = q.data.float() * q.scale_inv.t().repeat_interleave(128, 1)[:, :300]
    assert torch.equal(deq, _emulated_blocks(x))
    deq_t = q.data_t.float() * q.scale_inv_t.t().repeat_interleave(128, 1)[:, :130]
    assert torch.equal(deq_t, _emulated_blocks(x.t().contiguous()))
    assert q.scale_inv[0, 5] == 1 and q.data[5, :128].float().abs().max() == 0
    # the columnwise form is made from high precision: not the rowwise numbers transposed
    assert not torch.equal(deq_t, deq.t())
    w = quantize_blocks(x, E4M3, block_2d=True, rowwise=True, columnwise=True)
    assert w.scale_inv.shape == (2, 3)
    assert torch.equal(w.data.float() * w.scale_inv.repeat_interleave(128, 0)[:130]
                       .repeat_interleave(128, 1)[:, :300], _emulated_blocks(x, block_2d=True))
    assert torch.equal(w.data_t.view(torch.uint8), w.data.t().contiguous().view(torch.uint8))
    assert torch.equal(w.scale_inv_t, w.scale_inv.t())


# ------------------------------------------------------------------------------ MXFP8
def test_mx_scale_selection_saturation_zero_and_subnormal_blocks():
    x = torch.zeros(1, 160)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, 2.0 ** -16, 3 * 2.0 ** -18   # block 0: amax 1
    x[0, 32], x[0, 33] = 500.0, -448.0                         # block 1: amax 500
    x[0, 64], x[0, 65] = 448.0, 0.875                           # block 2: amax 448
    # block 3 (elements 96..127): all zero
    x[0, 128], x[0, 129] = 2.0 ** -130, -0.75 * 2.0 ** -130     # block 4: fp32 subnormals
    data, scale = quantize_mx(x, E4M3)
    # X = 2^(floor(log2 amax) - 8), E8M0 range [-127, 127]; zero block: 2^-127
    assert scale.tolist() == [[2.0 ** -8, 1.0, 1.0, 2.0 ** -127, 2.0 ** -127]]
    assert e8m0_bits(scale).tolist() == [[119, 127, 127, 0, 0]]
    d = data.float()[0]
    assert d[0] == 256 and d[1] == 2.0 ** -8       # 2^-8: an E4M3 subnormal (2 * 2^-9)
    assert d[2] == 2 * 2.0 ** -9                   # 1.5 * 2^-9 rounds to even: 2 * 2^-9
    assert d[32] == 448 and d[33] == -448          # 500 / 1 saturates to the E4M3 max
    assert d[64] == 448 and d[65] == 0.875
    assert d[96:128].abs().max() == 0
    assert d[128] == 0.125 and d[129] == -0.09375  # x * 2^127, exact
    _, s5 = quantize_mx(torch.tensor([[1.0] * 32]), E5M2)
    assert s5.item() == 2.0 ** -15                 # emax(E5M2) = 15


def test_mx_round_up_rule_never_saturates():
    """TE's rule: X = 2^ceil(log2(amax / 448)) (the exponent rounded up), so amax / X <= 448."""
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 32], x[0, 64] = 500.0, 448.0, 1.0
    data, scale = quantize_mx(x, E4M3, round_up=True)
    assert scale.tolist() == [[2.0, 1.0, 2.0 ** -8]]
    assert data.float()[0, [0, 32, 64]].tolist() == [256.0, 448.0, 256.0]   # 500 / 2 -> 256
    y = torch.randn(16, 64) * torch.logspace(-10, 10, 16)[:, None]
    d, s = quantize_mx(y, E4M3, round_up=True)
    assert (y.abs() / s.repeat_interleave(32, 1) <= 448).all()
    assert (d.float().abs().view(16, 2, 32).amax(-1) >= 224).all()   # the top binade: [224, 448]


def test_mx_on_random_data_is_within_half_an_e4m3_step(randn):
    x = randn(8, 96) * torch.logspace(-20, 20, 8)[:, None]
    # one element per block above the block's amax, at 475 * X: it saturates
    e = torch.floor(torch.log2(x.abs().view(8, 3, 32).amax(-1))) + 1
    x[:, ::32] = 475 * torch.exp2(e - 8)
    data, scale = quantize_mx(x, E4M3)
    s = scale.repeat_interleave(32, 1)
    deq = data.float() * s
    # x / X < 2^9: above 448 it saturates; elsewhere the error is at most half a step, 2^-4
    # relative for E4M3 normals and 2^-10 * X for its subnormals
    over = x.abs() / s > 448
    assert over[:, ::32].all() and torch.equal(deq[over], 448 * s[over] * x[over].sign())
    step = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    assert ((deq - x).abs() <= step)[~over].all()
    assert (data.float().abs() > 0).float().mean() > 0.9


# ------------------------------------------------------------------------------ Linear
def _emulated_linear(x, w, b, dy, w_2d: bool, mx: bool = False, grad_dtype=E4M3):
    """fprop, dgrad, wgrad of a block-scaled Linear, from the recipe's definition."""
    def q(t, two_d=False, dtype=E4M3):
        if mx:
            d, s = quantize_mx(t, dtype)
            return d.float() * s.repeat_interleave(32, 1)[:, :t.shape[1]]
        return _emulated_blocks(t, dtype, block_2d=two_d)

    def gemm(a, bt):  # a [M, K] @ bt [N, K]^T, slice by slice of 128 in fp32
        out = torch.zeros(a.shape[0], bt.shape[0])
        for k0 in range(0, a.shape[1], 128):
            out += a[:, k0:k0 + 128] @ bt[:, k0:k0 + 128].t()
        return out

    y = gemm(q(x), q(w, w_2d)) + b
    w_t = q(w, True).t() if w_2d else q(w.t().contiguous())
    dx = gemm(q(dy, dtype=grad_dtype), w_t.contiguous())
    dw = gemm(q(dy.t().contiguous(), dtype=grad_dtype), q(x.t().contiguous()))
    return y, dx, dw


@pytest.mark.parametrize("r,w_2d,mx", [
    (recipe.Float8BlockScaling(), True, False),
    (recipe.Float8BlockScaling(w_block_scaling_dim=1), False, False),
    (recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID), True, False),
    (recipe.MXFP8BlockScaling(), False, True),
    (recipe.MXFP8BlockScaling(fp8_format=recipe.Format.HYBRID), False, True)])
def test_linear_fprop_dgrad_wgrad_equal_the_emulation(randn, r, w_2d, mx):
    t, k, n = 40, 272, 144      # partial blocks in every dim, tokens not a multiple of 16
    layer = te.Linear(k, n)
    x = (randn(t, k) * torch.logspace(-2, 2, t)[:, None]).requires_grad_()
    dy = randn(t, n) * torch.logspace(1, -1, t)[:, None]
    with te.fp8_autocast(fp8_recipe=r):
        y = layer(x)
    y.backward(dy)
    grad_dtype = E5M2 if r.fp8_format is recipe.Format.HYBRID else E4M3
    want_y, want_dx, want_dw = _emulated_linear(x.detach(), layer.weight.detach(),
                                                layer.bias.detach(), dy, w_2d, mx, grad_dtype)
    torch.testing.assert_close(y.detach(), want_y, **FP32_TOL)
    torch.testing.assert_close(x.grad, want_dx, **FP32_TOL)
    torch.testing.assert_close(layer.weight.grad, want_dw, **FP32_TOL)
    torch.testing.assert_close(layer.bias.grad, dy.sum(0), **FP32_TOL)


def test_main_grad_and_torch_autocast(randn):
    r = recipe.Float8BlockScaling()
    plain = te.Linear(256, 128, bias=False)
    fused = te.Linear(256, 128, bias=False, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        fused.weight.copy_(plain.weight)
    start = randn(128, 256)
    fused.weight.main_grad = start.clone()
    x, dy = randn(48, 256), randn(48, 128)
    for layer in (plain, fused):
        with te.fp8_autocast(fp8_recipe=r):
            layer(x).backward(dy)
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad, start + plain.weight.grad, **FP32_TOL)
    # torch.autocast: the input is cast to bf16, the fp32 weight is quantized as it is
    xb = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), te.fp8_autocast(fp8_recipe=r):
        y = plain(xb)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        want = plain(x.bfloat16().float())   # the same fp8 operands, output rounded once
    assert y.dtype == torch.bfloat16 and torch.equal(y, want.bfloat16())
    y.float().sum().backward()
    assert xb.grad.dtype == torch.float32 and xb.grad.abs().max() > 0


def test_weight_cache_across_microbatches(randn):
    layer = te.Linear(128, 256)
    x = randn(32, 128)
    r = recipe.Float8BlockScaling()
    with te.fp8_autocast(fp8_recipe=r):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2)
        cached = layer(x, is_first_microbatch=False)
        fresh = layer(x, is_first_microbatch=True)
    assert torch.equal(first, cached)
    assert not torch.equal(first, fresh)


def test_block_scaling_halves_tensorwise_error_on_tokens_spanning_1e6(randn):
    t, k, n = 256, 256, 128
    u = torch.rand(t, 1)
    x = randn(t, k) * 10.0 ** (6 * u - 3)
    layer = te.Linear(k, n, bias=False)
    exact = x.double() @ layer.weight.detach().double().t()

    def per_token_error(r):
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
            y = layer(x).double()
        return ((y - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()

    block = per_token_error(recipe.Float8BlockScaling())
    tensorwise = per_token_error(recipe.Float8CurrentScaling())
    assert block <= 0.5 * tensorwise, (block, tensorwise)
    assert block < 0.06


@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(), recipe.MXFP8BlockScaling()])
def test_layernorm_linear_and_mlp_under_block_recipes(randn, r):
    ln_lin = te.LayerNormLinear(128, 64)
    ln, lin = te.LayerNorm(128), te.Linear(128, 64)
    with torch.no_grad():
        lin.weight.copy_(ln_lin.weight)
        lin.bias.copy_(ln_lin.bias)
    x = randn(24, 128)
    with te.fp8_autocast(fp8_recipe=r):
        assert torch.equal(ln_lin(x), lin(ln(x)))
    mlp = te.LayerNormMLP(128, 256)
    xg = x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = mlp(xg)
    y.sum().backward()
    hp = mlp(x)
    assert ((y - hp).norm() / hp.norm()) < 0.1
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().max() > 0
    assert mlp.fc1_weight.grad.abs().max() > 0 and mlp.fc2_weight.grad.abs().max() > 0


def test_block_recipe_checkpoint_and_unsupported_modules(randn):
    layer = te.Linear(64, 32)
    r = recipe.Float8BlockScaling(w_block_scaling_dim=1)
    with te.fp8_autocast(fp8_recipe=r):
        layer(randn(16, 64))
    other = te.Linear(64, 32)
    other.load_state_dict(layer.state_dict())
    assert other.fp8_meta.recipe == r

    with pytest.raises(NotImplementedError, match="fp8_model_init"):
        with te.fp8_model_init(recipe=recipe.MXFP8BlockScaling()):
            pass
    with pytest.raises(TypeError, match="fp8_recipe must be"):
        te.make_graphed_callables(layer, (randn(16, 64),), fp8_enabled=True,
                                  fp8_recipe=recipe.Recipe())


def test_fp8_params_run_under_block_recipes_dequantized(randn):
    with te.fp8_model_init(recipe=recipe.DelayedScaling()):
        fp8_layer = te.Linear(128, 64)
    plain = te.Linear(128, 64)
    with torch.no_grad():
        plain.weight.copy_(fp8_layer.weight.dequantize())
        plain.bias.copy_(fp8_layer.bias)
    x = randn(32, 128)
    with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
        assert torch.equal(fp8_layer(x), plain(x))


@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(), recipe.MXFP8BlockScaling()])
def test_grouped_linear_is_a_block_linear_per_group(randn, r):
    splits = [40, 0, 24]   # an expert with no tokens
    grouped = te.GroupedLinear(3, 128, 64)
    singles = [te.Linear(128, 64) for _ in splits]
    with torch.no_grad():
        for i, lin in enumerate(singles):
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
    x, dy = randn(64, 128), randn(64, 64)
    xg, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y = grouped(xg, splits)
        want = torch.cat([lin(part) for lin, part in zip(singles, xs.split(splits))])
    assert torch.equal(y, want)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(xg.grad, xs.grad)
    for i, lin in enumerate(singles):
        assert torch.equal(getattr(grouped, f"weight{i}").grad, lin.weight.grad)
    assert grouped.weight1.grad.abs().max() == 0 and grouped.weight0.grad.abs().max() > 0


def test_bench_block_scaling_tiny_runs(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_block_scaling.py"),
                          "--tiny"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name.split("-cpu-")[1] for p in tmp_path.glob("*.json")) == [
        "block_scaling_gemm_tiny.json", "block_scaling_linear_tiny.json"]


def test_flagged_block_cast_checks_its_buffers(randn):
    """quantize_blocks(skip=, out=): a missing out, a wrong flag or a buffer of the wrong
    shape is refused, naming the buffer and the shape it must have, before anything is written."""
    from tritium.fp8 import block as block_ops
    x = randn(130, 260)
    good = block_ops.quantize_blocks(x, torch.float8_e4m3fn, rowwise=True, columnwise=True)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs out="):
        block_ops.quantize_blocks(x, torch.float8_e4m3fn, skip=flag)
    with pytest.raises(ValueError, match="int32"):
        block_ops.quantize_blocks(x, torch.float8_e4m3fn, skip=flag.float(), out=good)
    bad = good._replace(scale_inv_t=torch.empty(3, 3))
    with pytest.raises(ValueError, match=r"out.scale_inv_t must be .*\(2, 260\)"):
        block_ops.quantize_blocks(x, torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                  skip=flag, out=bad)
    got = block_ops.quantize_blocks(x, torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                    skip=flag, out=good)
    assert got.data is good.data
