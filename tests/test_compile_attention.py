"""cpu tier: DotProductAttention and MultiheadAttention under torch.compile (reference backend).

  * `torch._dynamo.explain` finds 0 graph breaks for every qkv_format (sbhd, bshd, thd with and
    without max_seqlen), the mask types a Llama / GPT uses (causal, no_mask, padding and
    padding_causal with a mask tensor; also bottom-right, windows, arbitrary), MHA and GQA,
    fp32 / bf16 / fp16, RoPE (one table or a pair), input_layernorm and fuse_qkv_params both
    ways, checkpoint_core_attention.
  * The CUDA backends' rules (cuDNN / flash / efficient), traced on CPU tensors with a Hopper's
    device facts, choose what eager explain() chooses (the kernels are not run; the gpu tier
    tests/gpu/test_gpu_compile_attention.py runs them compiled).
  * RoPE positions built in the graph (thd, context-parallel positions) == the eager ones.
  * `torch.compile(fullgraph=True, backend="aot_eager")` == eager over 3 SGD steps of fresh
    data: outputs, input grads and every parameter grad, bit for bit (fp32 parameters; the
    aot_eager graph runs the same ATen ops in the same order). Where the compiled call cannot
    read max_seqlen from cu_seqlens (thd without max_seqlen) it pads to the token count
    instead, which only adds masked keys: TE's fp32 tolerance then. One case under the default
    inductor backend (fused kernels reorder fp32 sums): fp32 tolerance.
  * No recompilation after the first step (CompileCounterWithBackend.frame_count stays 1);
    a changed batch / sequence length recompiles once with symbolic sizes, then never again.
  * explain() still names the backend and the reasons; an impossible forced backend raises the
    same error compiled as eager.
  * The `tritium::flash_attn_fwd/_bwd` custom ops (CPU twin behind them here): torch.library
    opcheck (schema, fake implementations, autograd registration) and a compiled CP block
    Runner == the twin. The interp tier runs the same ops on the Triton kernel
    (tests/interp/test_flash_attention_ops.py); the context-parallel graph break is checked in
    test_context_parallel.py (needs a process group).
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tritium as te
import tritium.attention as A
from tritium.attention import RotaryPositionEmbedding
from tritium.attention import backends as B
from tritium.attention.dot_product_attention import prepare

from testlib import FP32_TOL

pytestmark = pytest.mark.cpu

S, BATCH, HEADS, GROUPS, D = 8, 2, 4, 2, 8
HIDDEN = HEADS * D
CU = (0, 5, 12)            # thd: two packed sequences of 5 and 7 tokens


def _breaks(fn, *args, **kwargs):
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args, **kwargs)
    return ex.graph_break_count, "\n".join(b.reason for b in ex.break_reasons)


def _padding_mask():
    """[b, 1, 1, s] bool, True = padding: the first sequence ends after 5 tokens."""
    mask = torch.zeros(BATCH, 1, 1, S, dtype=torch.bool)
    mask[0, ..., 5:] = True
    return mask


def _cu():
    return torch.tensor(CU, dtype=torch.int32)


# ------------------------------------------------------------------------ DotProductAttention
DPA_CASES = [(fmt, mask, groups) for fmt in ("sbhd", "bshd")
             for mask in ("causal", "no_mask", "padding", "padding_causal")
             for groups in (HEADS, GROUPS)]


def _dpa_inputs(fmt, mask, groups, randn):
    lead = (CU[-1],) if fmt == "thd" else (S, BATCH) if fmt == "sbhd" else (BATCH, S)
    q = randn(*lead, HEADS, D, requires_grad=True)
    k = randn(*lead, groups, D, requires_grad=True)
    v = randn(*lead, groups, D, requires_grad=True)
    kwargs = {}
    if fmt == "thd":
        cu = _cu()
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    elif mask.startswith("padding"):
        kwargs = dict(attention_mask=_padding_mask())
    return (q, k, v), kwargs


@pytest.mark.parametrize("fmt,mask,groups", DPA_CASES)
def test_dot_product_attention_has_no_graph_break(fmt, mask, groups, randn):
    dpa = A.DotProductAttention(HEADS, D, num_gqa_groups=groups, qkv_format=fmt,
                                attn_mask_type=mask)
    args, kwargs = _dpa_inputs(fmt, mask, groups, randn)
    count, why = _breaks(dpa, *args, **kwargs)
    assert count == 0, why


@pytest.mark.parametrize("mask,window,dtype", [
    ("causal_bottom_right", None, torch.float32), ("causal", (3, 0), torch.float32),
    ("arbitrary", None, torch.float32), ("causal", None, torch.bfloat16),
    ("no_mask", None, torch.float16)])
def test_other_masks_and_dtypes_have_no_graph_break(mask, window, dtype, randn):
    """s_q 6 != s_kv 9: bottom-right diagonal, a sliding window, an arbitrary mask tensor;
    16-bit inputs."""
    q = randn(BATCH, 6, HEADS, D, dtype=dtype)
    k, v = randn(BATCH, 9, GROUPS, D, dtype=dtype), randn(BATCH, 9, GROUPS, D, dtype=dtype)
    kwargs = {"attention_mask": torch.rand(BATCH, 1, 6, 9) > 0.5} if mask == "arbitrary" else {}
    dpa = A.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format="bshd",
                                attn_mask_type=mask, window_size=window)
    count, why = _breaks(dpa, q, k, v, **kwargs)
    assert count == 0, why


@pytest.mark.parametrize("max_seqlen", [7, None], ids=["max_seqlen", "no_max_seqlen"])
@pytest.mark.parametrize("mask", ["padding_causal", "padding"])
def test_thd_has_no_graph_break(mask, max_seqlen, randn):
    """thd: without max_seqlen the eager path reads it from cu_seqlens (a host sync); compiled,
    the token count bounds it instead, and a distinct-but-equal cu_seqlens_kv is not compared."""
    dpa = A.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format="thd",
                                attn_mask_type=mask)
    args, kwargs = _dpa_inputs("thd", mask, GROUPS, randn)
    kwargs["cu_seqlens_kv"] = _cu()   # equal to cu_seqlens_q, another tensor
    count, why = _breaks(dpa, *args, **kwargs, max_seqlen_q=max_seqlen,
                         max_seqlen_kv=max_seqlen)
    assert count == 0, why


# ------------------------------------------------------------------------ MultiheadAttention
def _mha(fmt="sbhd", mask="causal", groups=GROUPS, input_layernorm=True, fuse_qkv_params=False):
    torch.manual_seed(1234)  # same init for the eager and the compiled copy
    return te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, device="cpu",
                                 params_dtype=torch.float32, attention_dropout=0.0,
                                 input_layernorm=input_layernorm, fuse_qkv_params=fuse_qkv_params,
                                 qkv_format=fmt, attn_mask_type=mask)


def _mha_call(fmt, mask, rope, randn):
    """(hidden_states, forward kwargs) for one call."""
    kwargs = {}
    if fmt == "thd":
        x = randn(CU[-1], HIDDEN)
        kwargs = dict(cu_seqlens_q=_cu(), cu_seqlens_kv=_cu(), max_seqlen_q=7, max_seqlen_kv=7)
    else:
        x = randn(S, BATCH, HIDDEN) if fmt == "sbhd" else randn(BATCH, S, HIDDEN)
        if mask.startswith("padding"):
            kwargs["attention_mask"] = _padding_mask()
    if rope:
        kwargs["rotary_pos_emb"] = RotaryPositionEmbedding(D)(S if fmt != "thd" else CU[-1])
    return x, kwargs


MHA_CASES = [  # (fmt, mask, groups, input_layernorm, fuse_qkv_params, rope)
    ("sbhd", "causal", GROUPS, True, False, True),
    ("sbhd", "causal", HEADS, True, True, True),
    ("sbhd", "no_mask", GROUPS, False, True, False),
    ("bshd", "causal", GROUPS, False, False, True),
    ("bshd", "padding_causal", GROUPS, True, True, True),
    ("sbhd", "padding", HEADS, False, False, False),
    ("thd", "padding_causal", GROUPS, True, False, True),
]
MHA_IDS = ["-".join([f, m, "gqa" if g < HEADS else "mha", "ln" if ln else "noln",
                     "fused" if fu else "split", "rope" if r else "norope"])
           for f, m, g, ln, fu, r in MHA_CASES]


@pytest.mark.parametrize("case", MHA_CASES, ids=MHA_IDS)
def test_multihead_attention_has_no_graph_break(case, randn):
    fmt, mask, groups, ln, fuse, rope = case
    mha = _mha(fmt, mask, groups, ln, fuse)
    x, kwargs = _mha_call(fmt, mask, rope, randn)
    count, why = _breaks(mha, x, **kwargs)
    assert count == 0, why


def test_bf16_multihead_attention_with_a_rope_pair_has_no_graph_break(randn):
    torch.manual_seed(5)
    mha = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, device="cpu",
                                params_dtype=torch.bfloat16, input_layernorm=True,
                                attention_dropout=0.0)
    freqs = RotaryPositionEmbedding(D)(S)
    count, why = _breaks(mha, randn(S, BATCH, HIDDEN, dtype=torch.bfloat16),
                         rotary_pos_emb=(freqs, freqs))
    assert count == 0, why


def test_checkpoint_core_attention_has_no_graph_break(randn):
    x, kwargs = _mha_call("sbhd", "causal", True, randn)
    count, why = _breaks(_mha(), x, checkpoint_core_attention=True, **kwargs)
    assert count == 0, why


# ------------------------------------------------------------------------ compiled == eager
def _grads(module, x):
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def _steps(make, call, randn, backend="aot_eager", steps=3, tol=None):
    """Eager and compiled copies of a module, `steps` SGD steps on fresh data: outputs and
    grads equal (bitwise, or within tol) every step, and one compiled frame throughout."""
    torch._dynamo.reset()  # no shape history from other tests (that would make dims dynamic)
    eager, compiled = make(), make()
    counter = CompileCounterWithBackend(backend)
    fn = torch.compile(compiled, fullgraph=True, backend=counter)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(steps):
        x, kwargs = call(randn)
        dy = None
        results = []
        for model, opt in zip((fn, eager), opts):
            xi = x.detach().clone().requires_grad_()
            y = model(xi, **kwargs)
            if dy is None:
                dy = randn(*y.shape)
            y.backward(dy)
            results.append([y] + _grads(eager if model is eager else compiled, xi))
            opt.step()
            opt.zero_grad()
        for i, (got, want) in enumerate(zip(*results)):
            what = f"step {step} {'output' if i == 0 else 'input grad' if i == 1 else 'param grad'}"
            if tol is None:
                assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max()}"
            else:
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")
        assert counter.frame_count == 1, f"step {step}: recompiled ({counter.frame_count} frames)"


@pytest.mark.parametrize("case", [MHA_CASES[0], MHA_CASES[1], MHA_CASES[4], MHA_CASES[6]],
                         ids=[MHA_IDS[0], MHA_IDS[1], MHA_IDS[4], MHA_IDS[6]])
def test_compiled_multihead_attention_equals_eager(case, randn):
    fmt, mask, groups, ln, fuse, rope = case
    _steps(lambda: _mha(fmt, mask, groups, ln, fuse),
           lambda r: _mha_call(fmt, mask, rope, r), randn)


class _Core(torch.nn.Module):
    """DotProductAttention on q/k/v projected from one input (so each step has fresh grads)."""

    def __init__(self, fmt, mask):
        super().__init__()
        torch.manual_seed(99)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * GROUPS) * D)
        self.attn = A.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format=fmt,
                                          attn_mask_type=mask)

    def forward(self, x, **kwargs):
        q, k, v = self.qkv(x).unflatten(-1, (HEADS + 2 * GROUPS, D)).split(
            [HEADS, GROUPS, GROUPS], dim=-2)
        return self.attn(q, k, v, **kwargs)


@pytest.mark.parametrize("fmt,mask,max_seqlen", [
    ("bshd", "no_mask", None), ("sbhd", "padding_causal", None), ("thd", "padding_causal", 7),
    ("thd", "padding", None)])
def test_compiled_dot_product_attention_equals_eager(fmt, mask, max_seqlen, randn):
    def call(r):
        if fmt == "thd":
            return r(CU[-1], HIDDEN), dict(cu_seqlens_q=_cu(), cu_seqlens_kv=_cu(),
                                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        x = r(S, BATCH, HIDDEN) if fmt == "sbhd" else r(BATCH, S, HIDDEN)
        return x, (dict(attention_mask=_padding_mask()) if mask.startswith("padding") else {})
    exact = not (fmt == "thd" and max_seqlen is None)  # compiled pads to the token count
    _steps(lambda: _Core(fmt, mask), call, randn, tol=None if exact else FP32_TOL)


def test_inductor_multihead_attention_equals_eager(randn):
    """The default backend: Llama-style MHA (RMSNorm, GQA, RoPE, fused QKV) at fp32 tolerance."""
    def make():
        torch.manual_seed(7)
        return te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, device="cpu",
                                     params_dtype=torch.float32, attention_dropout=0.0,
                                     input_layernorm=True, normalization="RMSNorm", bias=False,
                                     fuse_qkv_params=True, qkv_weight_interleaved=False)
    _steps(make, lambda r: _mha_call("sbhd", "causal", True, r), randn, backend="inductor",
           tol=FP32_TOL)


def test_changing_lengths_compile_once_more_then_stay(randn):
    """A new sequence length (and batch) recompiles once with symbolic sizes (torch's automatic
    dynamic shapes), still in one graph, then serves further sizes (not 1: torch specializes
    on it) without recompiling; the shape checks of masks and formats hold under symbolic
    sizes (outputs == eager, bitwise)."""
    torch._dynamo.reset()
    eager, compiled = _mha("bshd", "padding_causal"), _mha("bshd", "padding_causal")
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, fullgraph=True, backend=counter)
    freqs = RotaryPositionEmbedding(D)(16)
    for step, (b, s) in enumerate([(2, 8), (3, 12), (2, 6), (4, 16)]):
        x = randn(b, s, HIDDEN)
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[0, ..., s // 2:] = True
        kwargs = dict(attention_mask=mask, rotary_pos_emb=freqs)
        got, want = fn(x, **kwargs), eager(x, **kwargs)
        assert torch.equal(got, want), f"b={b} s={s}: max diff {(got - want).abs().max()}"
        assert counter.frame_count == min(step + 1, 2), f"b={b} s={s}: {counter.frame_count}"


@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 1)])
def test_compiled_rope_positions_equal_eager(fmt, cp_size, cp_rank, randn):
    """RoPE's positions built in the graph (thd: from cu_seqlens on the device; context-parallel
    load-balanced positions too) == the eager host-side ones, bit for bit."""
    from tritium.attention import apply_rotary_pos_emb
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)       # lengths divisible by 2 * cp
    t = randn(24 // cp_size, HEADS, D) if fmt == "thd" else randn(S, BATCH, HEADS, D)
    freqs = RotaryPositionEmbedding(D)(32)
    kwargs = dict(tensor_format=fmt, cp_size=cp_size, cp_rank=cp_rank,
                  cu_seqlens=cu if fmt == "thd" else None)

    def rope(x):
        return apply_rotary_pos_emb(x, freqs, **kwargs)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(rope, fullgraph=True, backend="aot_eager")(t), rope(t))


# ------------------------------------------------------------------------ explain and errors
def test_explain_gives_the_choice_of_a_compiled_call(randn):
    (q, k, v), _ = _dpa_inputs("bshd", "causal", GROUPS, randn)
    dpa = A.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format="bshd")
    fn = torch.compile(dpa, fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(q, k, v), dpa(q, k, v))
    ex = A.explain(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    assert ex.backend == "torch", str(ex)
    assert "needs CUDA tensors" in ex.reasons["flash"] and "needs CUDA" in ex.reasons["cudnn"]


@pytest.fixture
def sm90_facts(monkeypatch):
    """The CUDA backends' rules on CPU tensors: device checks pass, the device facts are a
    Hopper's (sm90, cuDNN 9.10), as in test_attention_api.py (kernels are not run)."""
    monkeypatch.setattr(B, "_cuda_reason", lambda q, name, dtypes, min_cc=(8, 0):
                        None if q.dtype in dtypes else f"{name}: dtype")
    cpu = torch.device("cpu")
    monkeypatch.setitem(B._FACTS, cpu, B.device_facts(cpu)._replace(
        cc=(9, 0), cudnn=True, cudnn_version=91000, flash=True, flash_window=True))
    monkeypatch.setattr(B, "_CACHE", {})   # choices made here must not outlive the test


CHOICES = [  # (attn_mask_type, dropout, window, s_kv, deterministic, backend)
    ("causal", 0.0, None, 8, False, "cudnn"),
    ("causal", 0.0, None, 6, False, "efficient"),         # top-left causal, s_q != s_kv
    ("no_mask", 0.1, None, 8, False, "flash"),            # cuDNN: dropout not k/16
    ("no_mask", 0.125, None, 8, False, "cudnn"),
    ("causal", 0.0, (4, 0), 8, False, "flash"),           # cuDNN: no window
    ("causal", 0.0, (4, 0), 6, False, "efficient"),
    ("no_mask", 0.0, None, 8, True, "flash")]             # cuDNN: not deterministic


@pytest.mark.parametrize("case", CHOICES,
                         ids=lambda c: f"{c[0]}-p{c[1]}-w{c[2]}-kv{c[3]}-det{c[4]}")
def test_traced_choice_of_cuda_backends_is_the_eager_one(sm90_facts, case, randn):
    """The checks of cudnn / flash / efficient (compute capability, cuDNN version, dropout,
    windows, lengths, deterministic mode) trace without a graph break and choose what eager
    explain() chooses."""
    mask, dropout, window, sk, deterministic, backend = case

    def choose(q, k, v):
        qc, kc, vc, args = prepare(q, k, v, qkv_format="bshd", attn_mask_type=mask,
                                   dropout_p=dropout, window_size=window)
        return q + 1.0, B.choose_cached(qc, kc, vc, args).name

    q = randn(2, 8, HEADS, 64, dtype=torch.bfloat16)
    k, v = randn(2, sk, GROUPS, 64, dtype=torch.bfloat16), randn(2, sk, GROUPS, 64,
                                                                  dtype=torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        want = A.explain(q, k, v, qkv_format="bshd", attn_mask_type=mask, dropout_p=dropout,
                         window_size=window).backend
        count, why = _breaks(choose, q, k, v)
        assert count == 0, why
        torch._dynamo.reset()
        assert torch.compile(choose, fullgraph=True, backend="eager")(q, k, v)[1] == want
        assert choose(q, k, v)[1] == want    # the eager cache too (keyed on deterministic)
    finally:
        torch.use_deterministic_algorithms(before)
    assert want == backend


def test_cached_eager_choice_follows_deterministic_mode(sm90_facts, randn):
    q, k, v = (randn(2, 8, HEADS, 64, dtype=torch.bfloat16) for _ in range(3))
    qc, kc, vc, args = prepare(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert B.choose_cached(qc, kc, vc, args).name == "cudnn"
        torch.use_deterministic_algorithms(True)
        assert B.choose_cached(qc, kc, vc, args).name == "flash"
    finally:
        torch.use_deterministic_algorithms(before)


def test_impossible_forced_backend_raises_when_compiled(randn):
    (q, k, v), _ = _dpa_inputs("bshd", "causal", GROUPS, randn)
    dpa = A.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format="bshd",
                                backend="flash")
    with pytest.raises(RuntimeError, match="no attention backend supports this call"):
        dpa(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no attention backend supports this call"):
        torch.compile(dpa, backend="aot_eager")(q, k, v)


# ------------------------------------------------------------------------ flash-attention ops
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_flash_attention_ops_opcheck(causal, randn):
    from tritium.ops import attention  # noqa: F401  (registers the ops)
    q = randn(1, 6, 4, 16, requires_grad=True)
    k, v = randn(1, 9, 2, 16, requires_grad=True), randn(1, 9, 2, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.tritium.flash_attn_fwd.default, (q, k, v, causal, 0.25, True))
    out, lse = torch.ops.tritium.flash_attn_fwd(q, k, v, causal, 0.25)
    args = (randn(*out.shape), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
            causal, 0.25, True)
    torch.library.opcheck(torch.ops.tritium.flash_attn_bwd.default, args)


def test_compiled_cp_block_runner_uses_the_ops(randn):
    """A CP block (merge.Runner on the Triton-kernel path) traced whole: the ops replace the
    launchers, no graph break, results == the twin's."""
    from tritium.attention.cp.merge import ALL, Block, Precision, Runner
    from tritium.ref import flash_attention as R
    runner = Runner(0.3, 0.0, "auto", Precision(exact=True, kernel=True))
    blk = Block(ALL, ALL, True)

    def block(q, k, v, dout):
        out, lse, state = runner.fwd(q, k, v, blk)
        return (out, lse) + tuple(runner.bwd(dout, q, k, v, out, lse, blk, state))

    q, k, v = randn(1, 8, 4, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    dout = randn(1, 8, 4, 16)
    count, why = _breaks(block, q, k, v, dout)
    assert count == 0, why
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v, dout)
    out, lse = R.flash_attention_fwd(q, k, v, True, 0.3)
    want = (out, lse) + R.flash_attention_bwd(dout, q, k, v, out, lse, True, 0.3)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
