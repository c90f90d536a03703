"""cpu tier: parallel_cross_entropy and linear_cross_entropy against fp64 torch at fp32
tolerance (loss and gradients; ignore index, label smoothing, reductions, z-loss, bf16 inputs,
vocabularies that are not a multiple of the chunk), the module form, the emulated FP8 lm_head,
bad arguments, and both functions vocab-parallel on 2 gloo ranks against the unsharded result.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tritium as te
from tritium import recipe
from testlib import BF16_TOL, FP32_TOL, free_port, gloo_group, spawn

pytestmark = pytest.mark.cpu


def _oracle(logits, target, reduction, eps=0.0, z=0.0, ignore=-100):
    """fp64 torch: cross-entropy (+ z * lse^2 on non-ignored tokens), torch's reductions."""
    lg = logits.double()
    per = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), target.reshape(-1), reduction="none",
                          ignore_index=ignore, label_smoothing=eps)
    valid = target.reshape(-1) != ignore
    if z:
        per = per + z * torch.logsumexp(lg.reshape(-1, lg.shape[-1]), -1) ** 2 * valid
    if reduction == "none":
        return per.reshape(target.shape)
    return per.sum() / valid.sum() if reduction == "mean" else per.sum()


def _targets(shape, v, ignore=-100):
    t = torch.randint(0, v, shape)
    t.view(-1)[::5] = ignore
    return t


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_parallel_cross_entropy_fp32(randn, layout, reduce_loss, eps):
    v = 77
    x = randn(3, 5, v, scale=3.0, requires_grad=True)
    t = _targets((3, 5), v)
    loss = te.parallel_cross_entropy(x, t, eps, reduce_loss, None, -100)
    assert loss.dtype == torch.float32
    assert loss.shape == (() if reduce_loss else (3, 5))
    # a reduced loss is a new tensor: FSDP2 warns of view outputs (in-place ops drop its hooks)
    assert not (reduce_loss and loss._is_view())
    gout = torch.tensor(1.7) if reduce_loss else randn(3, 5)
    loss.backward(gout)
    xd = x.detach().double().requires_grad_()
    want = _oracle(xd, t, "mean" if reduce_loss else "none", eps)
    want.backward(gout.double())
    torch.testing.assert_close(loss.double(), want, **FP32_TOL)
    torch.testing.assert_close(x.grad.double(), xd.grad, **FP32_TOL)
    assert (x.grad.reshape(-1, v)[t.reshape(-1) == -100] == 0).all()


def test_parallel_cross_entropy_bf16_and_ignore_idx(randn):
    v = 50
    x = randn(4, 6, v, scale=2.0, dtype=torch.bfloat16, requires_grad=True)
    t = _targets((4, 6), v, ignore=7)  # a positive ignore index inside the vocabulary
    x0 = x.detach().clone()
    loss = te.parallel_cross_entropy(x, t, reduce_loss=True, ignore_idx=7)
    loss.backward()
    assert torch.equal(x.detach(), x0), "the caller's logits must stay intact"
    xd = x.detach().double().requires_grad_()
    want = _oracle(xd, t, "mean", ignore=7)
    want.backward()
    torch.testing.assert_close(loss.double(), want, **FP32_TOL)  # fp32 math on bf16 inputs
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), xd.grad, **BF16_TOL)


def _lce_case(randn, t_len, h, v, dtype=torch.float32, bias=False):
    hid = randn(t_len, h, dtype=dtype, requires_grad=True)
    w = randn(v, h, scale=0.4, dtype=dtype, requires_grad=True)
    b = randn(v, scale=0.5, dtype=dtype, requires_grad=True) if bias else None
    return hid, w, b, _targets((t_len,), v)


def _lce_oracle(hid, w, b, t, gout, **kw):
    hd, wd = (x.detach().double().requires_grad_() for x in (hid, w))
    bd = None if b is None else b.detach().double().requires_grad_()
    logits = hd @ wd.t() + (0 if bd is None else bd)
    want = _oracle(logits, t, **kw)
    want.backward(gout.double())
    return want, hd.grad, wd.grad, None if bd is None else bd.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps,z", [(0.0, 0.0), (0.1, 1e-2)])
@pytest.mark.parametrize("chunk_size", [16, None])
def test_linear_cross_entropy_fp32(randn, reduction, eps, z, chunk_size):
    hid, w, b, t = _lce_case(randn, 45, 24, 61, bias=True)  # 45 tokens: 3 chunks, a ragged one
    loss = te.linear_cross_entropy(hid, w, t, reduction=reduction, label_smoothing=eps,
                                   lse_square_scale=z, bias=b, chunk_size=chunk_size)
    assert not (reduction != "none" and loss._is_view())
    gout = randn(45) if reduction == "none" else torch.tensor(0.8)
    loss.backward(gout)
    want, dh, dw, db = _lce_oracle(hid, w, b, t, gout, reduction=reduction, eps=eps, z=z)
    torch.testing.assert_close(loss.double(), want, **FP32_TOL)
    for got, ref in ((hid.grad, dh), (w.grad, dw), (b.grad, db)):
        torch.testing.assert_close(got.double(), ref, **FP32_TOL)


def test_default_chunk_is_whole_row_tiles():
    """The default chunk: the most rows whose logits fit CHUNK_BYTES, rounded down to the GEMMs'
    128-row tile where at least one fits, else to 16 (FP8 GEMM dims)."""
    from tritium.functional.linear_cross_entropy import CHUNK_BYTES, chunk_rows
    for vocab, itemsize in ((128256, 2), (32000, 4), (50257, 2)):
        c = chunk_rows(8192, vocab, itemsize, None)
        assert c % 128 == 0 and c * vocab * itemsize <= CHUNK_BYTES
        assert (c + 128) * vocab * itemsize > CHUNK_BYTES
    huge = CHUNK_BYTES // 100  # fewer than 128 rows fit
    c = chunk_rows(8192, huge, 1, None)
    assert c % 16 == 0 and 16 <= c < 128 and c * huge <= CHUNK_BYTES
    assert chunk_rows(8192, 128256, 2, 40) == 40


def test_linear_cross_entropy_bf16_3d_and_module(randn):
    hid = randn(2, 19, 32, dtype=torch.bfloat16, requires_grad=True)
    w = randn(83, 32, scale=0.3, dtype=torch.bfloat16, requires_grad=True)
    t = _targets((2, 19), 83)
    loss_fn = te.LinearCrossEntropyLoss(lse_square_scale=1e-3, chunk_size=16,
                                        accum_dtype=torch.float32)
    loss = loss_fn(hid, w, t)
    loss.backward()
    # oracle: the bf16 logits an HF lm_head produces, cross-entropy in fp64
    hd, wd = (x.detach().double().requires_grad_() for x in (hid, w))
    want = _oracle((hd @ wd.t()), t, "mean", z=1e-3)
    want.backward()
    torch.testing.assert_close(loss.double(), want, **BF16_TOL)
    assert w.grad.dtype == torch.bfloat16 and hid.grad.shape == hid.shape
    # bf16 logits and dlogits (one rounding each, 2^-9 relative) feed the gradient GEMMs:
    # elementwise, cancellation makes some entries' relative error large; norm-wise it is small
    for got, ref in ((hid.grad, hd.grad), (w.grad, wd.grad)):
        assert (got.double() - ref).norm() / ref.norm() < 1e-2


def test_linear_cross_entropy_no_grad_and_frozen_weight(randn):
    hid, w, _, t = _lce_case(randn, 20, 16, 40)
    with torch.no_grad():
        loss = te.linear_cross_entropy(hid, w, t)
    torch.testing.assert_close(loss.double(), _oracle(hid.detach() @ w.detach().t(), t, "mean"),
                               **FP32_TOL)
    w.requires_grad_(False)
    te.linear_cross_entropy(hid, w, t, reduction="sum").backward()
    assert w.grad is None and hid.grad is not None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_linear_cross_entropy_fp8_emulated(randn, reduction, z):
    """Every path of the FP8 head: the gradient scaled by its bound with the weight gradient
    gathered over chunks (z = 0; in the forward for mean / sum, in the recompute for none), or
    per chunk by its measured amax (the z-loss has no bound)."""
    hid, w, _, t = _lce_case(randn, 40, 32, 96)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        loss = te.linear_cross_entropy(hid, w, t, fp8=True, chunk_size=16, reduction=reduction,
                                       lse_square_scale=z)
    gout = randn(40) if reduction == "none" else torch.tensor(0.8)
    loss.backward(gout)
    want, dh, dw, _ = _lce_oracle(hid, w, None, t, gout, reduction=reduction, z=z)
    # FP8 logits: per-token losses off by a few percent at most, their sum by less
    assert (loss.double() - want).norm() / want.norm() < 2e-2
    # FP8 operands: gradients within a few percent of their norm, not bitwise
    for got, ref in ((hid.grad, dh), (w.grad, dw)):
        assert (got.double() - ref).norm() / ref.norm() < 0.1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp8_head_weight_gradient_groups(randn, monkeypatch, reduction):
    """The FP8 head's weight gradient over groups of chunks (one GEMM per group: 40 tokens in
    16-row chunks = 16 + 16 + 8 (padded) rows in one group) equals one GEMM per chunk (groups of
    one chunk) up to fp32 summation order: the same quantized operands, the same scales."""
    from tritium.functional import linear_cross_entropy as lce
    hid, w, _, t = _lce_case(randn, 40, 32, 96)
    grads = []
    for group_bytes in (lce.WGRAD_GROUP_BYTES, 1):
        monkeypatch.setattr(lce, "WGRAD_GROUP_BYTES", group_bytes)
        h, ww = hid.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            loss = te.linear_cross_entropy(h, ww, t, fp8=True, chunk_size=16, reduction=reduction)
        loss.backward(torch.ones_like(loss))
        grads.append((h.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0])  # dh: per chunk either way
    scale = grads[1][1].abs().max().item()
    assert scale > 0
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6 * scale)
    with pytest.raises(ValueError, match="divisible by 16"):
        with te.fp8_autocast():
            te.linear_cross_entropy(hid, w[:90], t.clamp(max=89), fp8=True)


def test_bad_arguments(randn):
    hid, w, _, t = _lce_case(randn, 8, 16, 20)
    with pytest.raises(ValueError, match="reduction"):
        te.linear_cross_entropy(hid, w, t, reduction="avg")
    with pytest.raises(TypeError, match="share one dtype"):
        te.linear_cross_entropy(hid, w.double(), t)
    with pytest.raises(ValueError, match="target has shape"):
        te.linear_cross_entropy(hid, w, t[:5])
    with pytest.raises(ValueError, match="label_smoothing"):
        te.parallel_cross_entropy(randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 1.5)
    with pytest.raises(TypeError, match="integer tensor"):
        te.parallel_cross_entropy(randn(2, 3, 5), torch.zeros(2, 3))


# ---- vocab-parallel on 2 gloo ranks ----------------------------------------------------------

WORLD = 2



def _case(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 7, 2 * 27, generator=gen) * 3
    hid = torch.randn(22, 16, generator=gen)
    w = torch.randn(2 * 26, 16, generator=gen) * 0.5
    t1 = torch.randint(0, 54, (2, 7), generator=gen)
    t2 = torch.randint(0, 52, (22,), generator=gen)
    t1[0, 3] = t2[4] = -100
    return logits, hid, w, t1, t2


def _worker(rank: int, port: int, out_dir: str, seed: int):
    with gloo_group(rank, WORLD, port):
        logits, hid, w, t1, t2 = _case(seed)
        x = logits[..., rank * 27:(rank + 1) * 27].clone().requires_grad_()
        loss1 = te.parallel_cross_entropy(x, t1, 0.1, False, dist.group.WORLD)
        loss1.backward(torch.linspace(0.5, 1.5, 14).reshape(2, 7))
        h = hid.clone().requires_grad_()
        ws = w[rank * 26:(rank + 1) * 26].clone().requires_grad_()
        loss2 = te.linear_cross_entropy(h, ws, t2, label_smoothing=0.1, lse_square_scale=1e-2,
                                        tp_group=dist.group.WORLD, chunk_size=8)
        loss2.backward()
        res = {"loss1": loss1.detach(), "dx": x.grad, "loss2": loss2.detach(), "dh": h.grad,
               "dw": ws.grad}
        h.grad = ws.grad = None  # reduction="none": the backward recomputes the logits
        loss3 = te.linear_cross_entropy(h, ws, t2, reduction="none", tp_group=dist.group.WORLD,
                                        chunk_size=8)
        loss3.backward(torch.linspace(-1, 1, 22))
        res.update(loss3=loss3.detach(), dh3=h.grad, dw3=ws.grad)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_vocab_parallel_two_ranks(tmp_path, _seed):
    spawn(_worker, WORLD, free_port(), str(tmp_path), _seed)
    logits, hid, w, t1, t2 = _case(_seed)
    x = logits.clone().requires_grad_()
    want1 = te.parallel_cross_entropy(x, t1, 0.1)
    want1.backward(torch.linspace(0.5, 1.5, 14).reshape(2, 7))
    h, wf = hid.clone().requires_grad_(), w.clone().requires_grad_()
    want2 = te.linear_cross_entropy(h, wf, t2, label_smoothing=0.1, lse_square_scale=1e-2)
    want2.backward()
    h3, w3 = hid.clone().requires_grad_(), w.clone().requires_grad_()
    want3 = te.linear_cross_entropy(h3, w3, t2, reduction="none")
    want3.backward(torch.linspace(-1, 1, 22))
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["loss1"], want1.detach(), **FP32_TOL)
        torch.testing.assert_close(got["dx"], x.grad[..., rank * 27:(rank + 1) * 27], **FP32_TOL)
        torch.testing.assert_close(got["loss2"], want2.detach(), **FP32_TOL)
        torch.testing.assert_close(got["dh"], h.grad, **FP32_TOL)
        torch.testing.assert_close(got["dw"], wf.grad[rank * 26:(rank + 1) * 26], **FP32_TOL)
        torch.testing.assert_close(got["loss3"], want3.detach(), **FP32_TOL)
        torch.testing.assert_close(got["dh3"], h3.grad, **FP32_TOL)
        torch.testing.assert_close(got["dw3"], w3.grad[rank * 26:(rank + 1) * 26], **FP32_TOL)


def test_every_token_ignored(randn):
    """torch's mean over no tokens is NaN; the gradients are 0 (nothing to learn from)."""
    hid, w, _, t = _lce_case(randn, 12, 16, 20)
    t[:] = -100
    loss = te.linear_cross_entropy(hid, w, t)
    loss.backward()
    assert torch.isnan(loss) and (hid.grad == 0).all() and (w.grad == 0).all()
    x = randn(2, 6, 20, requires_grad=True)
    loss = te.parallel_cross_entropy(x, t.reshape(2, 6), reduce_loss=True)
    loss.backward()
    assert torch.isnan(loss) and (x.grad == 0).all()
