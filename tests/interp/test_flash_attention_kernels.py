"""`tritium.kernels.flash_attention` vs `tritium.ref.flash_attention` under the Triton interpreter.

Not bit for bit: the kernel's online softmax and tiled sums reorder fp32 additions, so the
contract is fp32 reduction-order tolerance (rtol 1e-5, atol 1e-5 x the tensor's scale). Inputs
are fp32 and fp16 (the interpreter computes bf16 tl.dot wrongly, see conftest.py); with fp16
the kernel's split products (16-bit head + tail of P and dS) must still reach that tolerance,
which a single 16-bit rounding of P (split=False) does not: checked too. Cases cover 16-row
interpreter tiles with masked tails, causal (s_q == s_kv and top-left with s_q != s_kv) and
no_mask with s_q != s_kv (CP's half-q or half-kv blocks), GQA, strided views, and a backward
fed a foreign (out, lse) pair (a CP ring's merged one); bands on the diagonal (sliding windows,
bottom-right alignment) and packed sequences (varlen / thd). The launch options of `Cfg` (K/V or
Q/dO loads through TMA descriptors, the warp-specialized forward loop, dq by atomic adds from
the dk/dv kernel) and the 16-bit out / grads option (rounded once from the same fp32 values, so
within one 16-bit rounding of the twin's) are checked against the twin too.
"""
from __future__ import annotations

import math

import pytest
import torch

from tritium.kernels import flash_attention as K
from tritium.ref import flash_attention as R

pytestmark = [pytest.mark.interp,  # the interpreter's own numpy warning on tensor loop bounds
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]

# (s_q, s_kv, h, h_kv, d, causal)
CASES = [(16, 16, 2, 2, 16, True), (33, 33, 2, 1, 16, True), (48, 48, 2, 2, 32, False),
         (17, 40, 2, 2, 32, False), (40, 24, 2, 1, 16, False), (24, 40, 2, 2, 16, True),
         (20, 20, 2, 1, 64, True), (16, 24, 1, 1, 128, False)]
# launch options (interpreter-sized tiles)
OPTIONS = {"tma-ws": K.Cfg(16, 16, 4, 1, tma=True, ws=True),
           "atomic-dq": K.Cfg(16, 16, 4, 1, atomic_dq=True),
           "tma-atomic-dq": K.Cfg(16, 16, 4, 1, tma=True, atomic_dq=True)}


def close(got, want, what, rtol=1e-5, atol=1e-5):
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {got.shape}"
    scale = want.abs().max().item() or 1.0
    err = (got - want.float()).abs()
    bound = atol * scale + rtol * want.float().abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance; "
                           f"max err {err.max().item():.3e} (scale {scale:.3e})")


def data(s_q, s_kv, h, h_kv, d, dtype, gen, strided=False):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    if strided:  # q/k/v as column slices of a fused tensor, s-major
        qkv = rnd(1, s_q, h + 2 * h_kv, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + h_kv], qkv[:, :, h + h_kv:]
    else:
        q, k, v = rnd(1, s_q, h, d), rnd(1, s_kv, h_kv, d), rnd(1, s_kv, h_kv, d)
    return q, k, v, rnd(1, s_q, h, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}-hk{}-d{}-{}".format(
    *c[:5], "causal" if c[5] else "nomask"))
def test_fwd_bwd_match_twin(case, dtype, gen):
    s_q, s_kv, h, h_kv, d, causal = case
    q, k, v, do = data(s_q, s_kv, h, h_kv, d, dtype, gen)
    scale = 1.0 / math.sqrt(d)
    out, lse = K.flash_attention_fwd(q, k, v, causal, scale)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, scale)
    close(out, r_out, "out")
    close(lse, r_lse, "lse")
    assert lse.shape == (1, h, s_q)
    grads = K.flash_attention_bwd(do, q, k, v, out, lse, causal, scale)
    r_grads = R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, scale)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, r_grads, (q, k, v)):
        assert g.shape == x.shape
        close(g, r, name)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", [(33, 33, 4, 2, 16, True), (17, 40, 2, 1, 32, False),
                                  (24, 40, 2, 2, 16, True)],
                         ids=["gqa-causal", "gqa-nomask-q17-kv40", "causal-q24-kv40"])
def test_launch_options_match_twin(option, case, gen, monkeypatch):
    monkeypatch.setattr(K, "INTERP_CFG", OPTIONS[option])
    s_q, s_kv, h, h_kv, d, causal = case
    q, k, v, do = data(s_q, s_kv, h, h_kv, d, torch.float16, gen)
    if option.startswith("tma"):
        assert K._srcs(OPTIONS[option], q, k, v)[1], "the TMA path must be taken"
    out, lse = K.flash_attention_fwd(q, k, v, causal, 0.25)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.25)
    close(out, r_out, "out")
    close(lse, r_lse, "lse")
    grads = K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.25)
    for name, g, r in zip(("dq", "dk", "dv"), grads,
                          R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, 0.25)):
        close(g, r, name)


# (s_q, s_kv, h, h_kv, d, causal, band): sliding windows (lo, hi) on the diagonal j - i,
# top-left and bottom-right aligned, with and without causal, bands narrower than a 16-row tile
# (masked on both sides of one block), wider (wholly visible blocks between masked ones), one
# that leaves rows with no key at all, and bottom-right causal with s_q != s_kv
BANDS = [(48, 48, 2, 1, 16, True, (-20, None)), (48, 48, 2, 2, 16, False, (-5, 7)),
         (64, 64, 2, 1, 32, False, (-33, 18)), (40, 24, 2, 2, 16, False, (-3, 3)),
         (24, 56, 2, 1, 16, False, (32 - 9, 32)), (24, 56, 2, 2, 16, False, (None, 32)),
         (33, 33, 2, 2, 16, False, (20, None)), (17, 50, 2, 1, 16, False, (2, 20))]


@pytest.mark.parametrize("option", ["default", "tma-atomic-dq"])
@pytest.mark.parametrize("case", BANDS, ids=lambda c: "q{}-kv{}-hk{}-d{}-{}-{}".format(
    c[0], c[1], c[3], c[4], "causal" if c[5] else "nomask", c[6]))
def test_band_fwd_bwd_match_twin(case, option, gen, monkeypatch):
    """A band (sliding window / bottom-right alignment): the kernel visits only the key blocks
    the band reaches and masks where it cuts one; out, lse (-inf on rows that see no key) and
    the gradients equal the twin's under the same band."""
    if option != "default":
        monkeypatch.setattr(K, "INTERP_CFG", OPTIONS[option])
    s_q, s_kv, h, h_kv, d, causal, band = case
    q, k, v, do = data(s_q, s_kv, h, h_kv, d, torch.float16, gen)
    out, lse = K.flash_attention_fwd(q, k, v, causal, 0.3, band=band)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.3, band=band)
    close(out, r_out, "out")
    assert torch.equal(lse.isinf(), r_lse.isinf())
    close(lse.nan_to_num(neginf=0.0), r_lse.nan_to_num(neginf=0.0), "lse")
    assert not torch.equal(r_out, R.flash_attention_fwd(q, k, v, causal, 0.3)[0]), \
        "the band must hide something in every case"
    grads = K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.3, band=band)
    r_grads = R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, 0.3, band=band)
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        assert r.abs().max() > 0
        close(g, r, name)


# packed sequences (thd): lengths of q and kv per sequence, causal, band
VARLEN = [([5, 33, 17], [5, 33, 17], True, None), ([20, 1, 40], [24, 9, 40], False, None),
          ([30, 12], [30, 12], False, (-6, 3)), ([18, 0, 25], [18, 7, 25], True, (-9, None)),
          ([16, 40], [0, 40], False, None)]


@pytest.mark.parametrize("option", ["default", "atomic-dq"])
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"q{c[0]}-kv{c[1]}-causal{c[2]}-{c[3]}")
def test_varlen_fwd_bwd_match_twin(case, option, gen, monkeypatch):
    """thd: each packed sequence attends alone (causal and bands within it; a sequence with no
    keys outputs 0 and lse -inf); GQA; the kernels launched over (longest sequence) x
    (sequences x heads), programs past a sequence's end doing nothing."""
    if option != "default":
        monkeypatch.setattr(K, "INTERP_CFG", OPTIONS[option])
    lq, lk, causal, band = case
    h, h_kv, d = 4, 2, 16
    cu_q = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_kv = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    varlen = (cu_q, cu_kv, max(lq), max(lk))
    q = torch.randn(sum(lq), h, d, generator=gen).half()
    k, v = (torch.randn(sum(lk), h_kv, d, generator=gen).half() for _ in range(2))
    do = torch.randn(sum(lq), h, d, generator=gen).half()
    out, lse = K.flash_attention_fwd(q, k, v, causal, 0.3, band=band, varlen=varlen)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.3, band=band, varlen=varlen)
    assert out.shape == q.shape and lse.shape == (h, sum(lq))
    close(out, r_out, "out")
    assert torch.equal(lse.isinf(), r_lse.isinf())
    close(lse.nan_to_num(neginf=0.0), r_lse.nan_to_num(neginf=0.0), "lse")
    grads = K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.3, band=band, varlen=varlen)
    r_grads = R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, 0.3, band=band,
                                    varlen=varlen)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, r_grads, (q, k, v)):
        assert g.shape == x.shape and r.abs().max() > 0
        close(g, r, name)
    # a packed batch is not one long sequence: the first sequence's rows see none of the rest
    whole = R.flash_attention_fwd(q[None], k[None], v[None], causal, 0.3, band=band)[0][0]
    assert not torch.equal(whole, r_out)


@pytest.mark.parametrize("option", ["default", "tma-atomic-dq"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_16bit_outputs_match_twin(causal, split, option, gen, monkeypatch):
    """out / dq / dk / dv in the input dtype (what an attention backend returns): split ->
    within one fp16 rounding of the twin's rounded values; nosplit (P / dS rounded to fp16 once)
    -> within a 16-bit kernel's error of them. lse stays fp32."""
    if option != "default":
        monkeypatch.setattr(K, "INTERP_CFG", OPTIONS[option])
    q, k, v, do = data(33, 40, 4, 2, 32, torch.float16, gen)
    f16 = torch.float16
    out, lse = K.flash_attention_fwd(q, k, v, causal, 0.25, split=split, out_dtype=f16)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.25, out_dtype=f16)
    assert out.dtype == f16 and lse.dtype == torch.float32
    tol = dict(rtol=1e-3, atol=1e-5) if split else dict(rtol=0.0, atol=4e-3)
    close(out.float(), r_out.float(), "out", **tol)
    close(lse, r_lse, "lse", **(dict() if split else tol))
    grads = K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.25, split=split,
                                  grad_dtype=f16)
    # the same (out, lse) to both: a 1-ulp difference of the rounded outs would move delta
    r_grads = R.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.25, grad_dtype=f16)
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        assert g.dtype == r.dtype == f16
        close(g.float(), r.float(), name, **tol)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_head_dim_256_forward(causal, gen):
    """d=256: the forward (both modes, 16-bit out too); the backward refuses it."""
    q, k, v, do = data(20, 24, 2, 1, 256, torch.float16, gen)
    r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.0625)
    out, lse = K.flash_attention_fwd(q, k, v, causal, 0.0625)
    close(out, r_out, "out")
    close(lse, r_lse, "lse")
    out16, _ = K.flash_attention_fwd(q, k, v, causal, 0.0625, split=False, out_dtype=q.dtype)
    close(out16.float(), r_out, "out (nosplit, fp16)", rtol=0.0, atol=4e-3)
    assert K.supported(q, k, v, backward=False) and not K.supported(q, k, v)
    with pytest.raises(ValueError, match="head dim"):
        K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.0625)


def test_strided_views_gqa(gen):
    q, k, v, do = data(33, 33, 4, 2, 16, torch.float16, gen, strided=True)
    assert not q.is_contiguous()
    for causal in (True, False):
        out, lse = K.flash_attention_fwd(q, k, v, causal, 0.3)
        r_out, r_lse = R.flash_attention_fwd(q, k, v, causal, 0.3)
        close(out, r_out, "out")
        close(lse, r_lse, "lse")
        for name, g, r in zip("qkv", K.flash_attention_bwd(do, q, k, v, out, lse, causal, 0.3),
                              R.flash_attention_bwd(do, q, k, v, r_out, r_lse, causal, 0.3)):
            close(g, r, "d" + name)


def test_backward_takes_a_merged_out_lse(gen):
    """CP's backward passes the (out, lse) merged over two KV blocks to each block's backward;
    the per-block grads must be the ref's for that foreign pair, and sum to the full grads."""
    s, h, d = 32, 2, 16
    q, k, v, do = data(s, 2 * s, h, h, d, torch.float16, gen)
    scale = 0.25
    full_out, full_lse = R.flash_attention_fwd(q, k, v, False, scale)
    total = [torch.zeros(x.shape) for x in (q, k, v)]
    for part in (slice(0, s), slice(s, 2 * s)):
        kb, vb = k[:, part], v[:, part]
        out_i, lse_i = K.flash_attention_fwd(q, kb, vb, False, scale)
        close(out_i, R.flash_attention_fwd(q, kb, vb, False, scale)[0], "block out")
        g = K.flash_attention_bwd(do, q, kb, vb, full_out, full_lse, False, scale)
        r = R.flash_attention_bwd(do, q, kb, vb, full_out, full_lse, False, scale)
        for name, a, b in zip(("dq", "dk", "dv"), g, r):
            close(a, b, "block " + name)
        total[0] += g[0]
        total[1][:, part] += g[1]
        total[2][:, part] += g[2]
    for name, a, b in zip(("dq", "dk", "dv"), total,
                          R.flash_attention_bwd(do, q, k, v, full_out, full_lse, False, scale)):
        close(a, b, "sum " + name, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("option", ["default", "atomic-dq"])
def test_backward_shares_delta_and_sums_dq_into_a_buffer(layout, option, gen, monkeypatch):
    """A CP rank's blocks share one delta = rowsum(dO * out) (`flash_attention_delta`, the
    twin's value) and one fp32 dq: with `delta=` and `dq_acc=` (rows of a larger buffer that
    holds earlier blocks' sums) the block's dq is added into the buffer's rows, returned as dq,
    the other rows untouched, dk / dv as without them; the twin the same; bad ones named."""
    if option != "default":
        monkeypatch.setattr(K, "INTERP_CFG", OPTIONS[option])
    h, h_kv, d, scale = 2, 1, 16, 0.3
    if layout == "bshd":
        q, k, v, do = data(24, 40, h, h_kv, d, torch.float16, gen)
        varlen, causal, n = None, False, 24
    else:
        cu = torch.tensor([0, 7, 26], dtype=torch.int32)
        varlen, causal, n = (cu, cu, 19, 19), True, 26
        q, do = (torch.randn(n, h, d, generator=gen).half() for _ in range(2))
        k, v = (torch.randn(n, h_kv, d, generator=gen).half() for _ in range(2))
    out, lse = R.flash_attention_fwd(q, k, v, causal, scale, varlen=varlen)
    wide = (lambda x: x[None]) if varlen else (lambda x: x)
    delta = K.flash_attention_delta(wide(out), wide(do))
    close(delta, R.flash_attention_delta(wide(out), wide(do)), "delta")
    delta = delta[0] if varlen else delta
    plain = K.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, varlen=varlen)
    seq = (lambda x, a, b: x[a:b]) if varlen else (lambda x, a, b: x[:, a:b])   # token rows
    for impl in (K, R):
        buf = torch.randn(*q.shape[:-3], 2 * n, *q.shape[-2:], generator=gen)
        rows, before = seq(buf, n, 2 * n), buf.clone()
        got = impl.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, varlen=varlen,
                                       delta=delta, dq_acc=rows)
        assert got[0].data_ptr() == rows.data_ptr()
        close(rows, seq(before, n, 2 * n) + plain[0], f"{impl.__name__} dq")
        assert torch.equal(seq(buf, 0, n), seq(before, 0, n))
        for name, g, r in zip(("dk", "dv"), got[1:], plain[1:]):
            close(g, r, f"{impl.__name__} {name}")
    with pytest.raises(ValueError, match="delta must be fp32"):
        K.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, varlen=varlen,
                              delta=delta.half())
    with pytest.raises(ValueError, match="dq_acc must be an fp32 tensor shaped like q"):
        K.flash_attention_bwd(do, q, k, v, out, lse, causal, scale, varlen=varlen,
                              dq_acc=torch.zeros(q.shape, dtype=torch.float16))


def test_split_is_what_keeps_fp16_at_fp32_tolerance(gen):
    q, k, v, do = data(32, 32, 2, 2, 16, torch.float16, gen)
    out1, lse = K.flash_attention_fwd(q, k, v, True, 0.25, split=False)
    r_out, _ = R.flash_attention_fwd(q, k, v, True, 0.25)
    with pytest.raises(AssertionError):
        close(out1, r_out, "out (P rounded to fp16 once)")
    out2, _ = K.flash_attention_fwd(q, k, v, True, 0.25, split=True)
    close(out2, r_out, "out (split)")
    # the single rounding is still a 16-bit-accurate result
    assert (out1 - r_out).abs().max() < 4e-3


def test_rejects_unsupported():
    q = torch.zeros(1, 8, 2, 24)
    with pytest.raises(ValueError, match="unsupported"):
        K.flash_attention_fwd(q, q, q, True, 1.0)
    assert not K.supported(q, q, q)
    q = torch.zeros(1, 8, 3, 16)
    k = torch.zeros(1, 8, 2, 16)
    assert not K.supported(q, k, k)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype"):
        K.flash_attention_fwd(q, q, q, True, 1.0, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_dtype"):
        K.flash_attention_bwd(q, q, q, q, q, torch.zeros(1, 2, 8), True, 1.0,
                              grad_dtype=torch.int8)


def test_cp_runner_kernel_path_matches_fp32_copy_path(gen):
    """The CP wiring (merge.Runner with Precision.kernel): rank 1 of a causal p2p ring at cp=2
    (step 0 causal on the local square, step 1 half of q vs the other rank's KV), forward merge
    and backward with the merged (out, lse), 16-bit inputs: the kernel path equals the fp32-copy
    path (the reference backend) to fp32 tolerance, and so does the kernel path's backward with
    one shared delta and fp32 dq (`Runner.shared`: what the ring and all_gather use)."""
    from tritium.attention.cp.merge import OutAcc, Precision, Runner
    from tritium.attention.cp.p2p import schedule

    L, h, h_kv, d = 32, 2, 1, 16
    q, k0, v0, do = data(L, L, h, h_kv, d, torch.float16, gen)
    _, k1, v1, _ = data(L, L, h, h_kv, d, torch.float16, gen)
    kvs = [(k0, v0), (k1, v1)]
    results = {}
    for kernel, share in ((False, False), (True, False), (True, True)):
        p = Precision(exact=True, fp32_accumulation=True, kernel=kernel)
        run = Runner(0.25, 0.0, "torch", p)
        acc = OutAcc(q, d, torch.float32)
        states, blocks = [], [schedule(i, 1, True, L // 2) for i in range(2)]
        for (k, v), blk in zip(kvs, blocks):
            out_i, lse_i, st = run.fwd(p.compute(q), p.compute(k), p.compute(v), blk)
            assert out_i.dtype == torch.float32
            assert (st[0] == "tritium-flash") == kernel
            acc.add(blk.q, out_i, lse_i)
            states.append(st)
        grads = [torch.zeros(q.shape)] + [torch.zeros(k0.shape) for _ in range(4)]
        shared = run.shared(p.compute(do), acc.out, p.compute(q)) if share else None
        assert (shared is not None) == share
        for j, ((k, v), blk, st) in enumerate(zip(kvs, blocks, states)):
            dq_i, dk_i, dv_i = run.bwd(p.compute(do), p.compute(q), p.compute(k), p.compute(v),
                                       acc.out, acc.lse, blk, st, shared)
            assert dq_i.dtype == dk_i.dtype == dv_i.dtype == torch.float32
            if shared is None:
                grads[0][:, blk.q] += dq_i
            grads[1 + 2 * j][:, blk.kv] += dk_i
            grads[2 + 2 * j][:, blk.kv] += dv_i
        if shared is not None:
            grads[0] = shared[1]
        results[kernel, share] = [acc.out, acc.lse, *grads]
    for got in (results[True, False], results[True, True]):
        for name, a, b in zip(("out", "lse", "dq", "dk0", "dv0", "dk1", "dv1"), got,
                              results[False, False]):
            close(a, b, name)


@pytest.mark.parametrize("rank", [0, 1])
def test_cp_forward_merges_in_the_kernel_where_it_runs(rank, gen, monkeypatch):
    """`OutAcc.merge_block` (fp32 partials, speed-mode products): where the kernel's merging
    forward runs (Hopper; stood in for here by its twin, the Gluon kernel is GPU-only), a
    causal p2p ring's step 1 at cp=2 is merged into the running buffers at the block's row
    offset (rank 0: the second half of q; rank 1: all of it) and the last step's rows are
    rounded there, `result` casting only the others; equal to the partial-and-add path. Where
    it does not run, `add` is used, as before."""
    from tritium.attention.cp.merge import OutAcc, Precision, Runner
    from tritium.attention.cp.p2p import schedule

    L, h, d = 32, 2, 16
    q, k0, v0, _ = data(L, L, h, h, d, torch.float16, gen)
    _, k1, v1, _ = data(L, L, h, h, d, torch.float16, gen)
    p = Precision(exact=True, fp32_accumulation=True, kernel=True, split=False)
    calls = []

    def merge_by_twin(q, k, v, causal, scale, out, lse, row0, out16=None):
        calls.append((row0, out16 is not None))
        R.flash_attention_fwd_merge(q, k, v, causal, scale, out, lse, row0, out16)
        return True
    results = {}
    for kernel_merge in (False, True):
        if kernel_merge:
            monkeypatch.setattr(K, "flash_attention_fwd_merge", merge_by_twin)
        run, acc = Runner(0.25, 0.0, "torch", p), OutAcc(q, d, torch.float32)
        for i, (k, v) in enumerate(((k0, v0), (k1, v1))):
            blk = schedule(i, rank, True, L // 2)
            out_i, lse_i, _ = run.fwd(q, k, v, blk, acc, last=i == 1)
            assert (out_i is None) == (kernel_merge and i == 1)
            if out_i is not None:
                acc.add(blk.q, out_i, lse_i)
        results[kernel_merge] = (acc.out, acc.lse, acc.result(q.dtype))
    assert calls == [(0 if rank == 1 else L // 2, True)]
    # the twin's products are fp32, the kernel partial's P is rounded to 16 bits (2^-11)
    for name, a, b in zip(("out", "lse", "result"), results[True], results[False]):
        tol = 1e-5 if name == "lse" else 2e-3
        close(a.float(), b.float(), name, rtol=tol, atol=tol)
