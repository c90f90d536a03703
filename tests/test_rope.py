"""cpu tier: `RotaryPositionEmbedding` and `apply_rotary_pos_emb` (the ref path) against a textbook
RoPE written here.

The oracle is the complex-number form in float64: each rotated pair (x_a, x_b) is the complex
number x_a + i x_b, multiplied by exp(i theta) with theta the pair's angle; the pairs are the
two halves (x_j, x_{j + R/2}) non-interleaved and (x_{2j}, x_{2j+1}) interleaved. Its gradient
comes from autograd. It reads the angles from the fp32 freqs that tritium gets, so the only
differences left are tritium's fp32 arithmetic: cos/sin rounded to fp32, two rounded products and
a rounded sum. Hence, per element, with scale = |x_d| + |x_partner(d)| (of dy for the gradient):
  fp32:   |got - oracle| <= 5e-7 * scale      (~4 fp32 ulps of the inputs)
  16-bit: |got - oracle| <= ulp/2 of the dtype + 5e-7 * scale (the fp32 value rounded once)
and features past rot_dim are the input, bit for bit. The module's freqs are checked against
float64 angles p / base^(2j/R) to a few fp32 ulps, and its inv_freq against TE's fp32 formula
bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tritium.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

pytestmark = pytest.mark.cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANT = {torch.bfloat16: 7, torch.float16: 10}
FP32_REL = 5e-7


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _, e = torch.frexp(t.double().abs())
    tiny = torch.finfo(dtype).tiny * 2.0 ** -MANT[dtype]
    return torch.clamp(torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 1 - MANT[dtype]),
                       min=tiny)


def half_angles(freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[s, R/2] float64 angle of each pair, read from fp32 freqs [s, 1, 1, R]."""
    f = freqs.reshape(freqs.shape[0], -1).double()
    return f[:, 0::2] if interleaved else f[:, : f.shape[1] // 2]


def textbook(x: torch.Tensor, theta: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., R] (float64) by theta [..., R/2] (broadcast) as complex multiplication."""
    r = x.shape[-1]
    if interleaved:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], r // 2, 2).contiguous())
    else:
        z = torch.complex(x[..., : r // 2], x[..., r // 2:])
    w = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        return torch.view_as_real(w).flatten(-2)
    return torch.cat([w.real, w.imag], dim=-1)


def partner_abs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """|x_p(d)| for every d of x [..., R]."""
    a = x.abs()
    if interleaved:
        return a.reshape(*a.shape[:-1], -1, 2).flip(-1).flatten(-2)
    return a.roll(a.shape[-1] // 2, dims=-1)


def oracle(t, theta, dy, rot, interleaved):
    """float64 forward and input gradient of the textbook RoPE on the first rot features of t;
    theta [..., R/2] broadcasts against t[..., :rot]."""
    x = t.detach().double().requires_grad_(True)
    y = torch.cat([textbook(x[..., :rot], theta, interleaved), x[..., rot:]], dim=-1)
    y.backward(dy.double())
    return y.detach(), x.grad


def assert_rope_close(got, want, src, rot, interleaved, what):
    """got vs the float64 oracle (see the module docstring); src is the input whose pairs set
    the error scale (t for the output, dy for the gradient)."""
    assert got.shape == want.shape and got.dtype == src.dtype, what
    s = src.double()[..., :rot]
    scale = s.abs() + partner_abs(s, interleaved)
    g, w = got.double()[..., :rot], want[..., :rot]
    bound = FP32_REL * scale
    if got.dtype != torch.float32:
        bound = bound + 0.5 * ulp(torch.maximum(g.abs(), w.abs()), got.dtype)
    err = (g - w).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {g.numel()} off; worst excess "
                           f"{(err - bound).max().item():.3g}")
    assert torch.equal(got[..., rot:], src[..., rot:]) if what.startswith("fwd") else True


def run(t, freqs, dy, **kw):
    x = t.detach().clone().requires_grad_(True)
    y = apply_rotary_pos_emb(x, freqs, **kw)
    y.backward(dy)
    return y.detach(), x.grad


# ---------------------------------------------------------------------------------- the module

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_module_freqs(percent, interleaved):
    dim, base, s, offset = 64, 10000.0, 300, 7
    m = RotaryPositionEmbedding(dim, rotary_percent=percent, interleaved=interleaved,
                                rotary_base=base)
    rot = int(dim * percent)
    freqs = m(s, offset=offset)
    assert freqs.shape == (s, 1, 1, rot) and freqs.dtype == torch.float32
    # TE's fp32 formula for inv_freq, bit for bit
    te_inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    assert torch.equal(m.inv_freq.cpu(), te_inv)
    assert "inv_freq" in m.state_dict()
    inv64 = base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = (torch.arange(s, dtype=torch.float64) + offset)[:, None] * inv64[None, :]
    want = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat([ang, ang], dim=-1)
    torch.testing.assert_close(freqs.reshape(s, rot).double().cpu(), want, rtol=4e-6, atol=0)


def test_module_interpolation():
    m = RotaryPositionEmbedding(16, seq_len_interpolation_factor=4,
                                pretrained_max_position_embeddings=100)
    plain = RotaryPositionEmbedding(16)
    pos = torch.arange(40, dtype=torch.float32)
    inv = plain.inv_freq.cpu()
    fixed = torch.outer(pos * (1 / 4), inv)  # 40 <= 100 * 4: fixed linear scaling
    assert torch.equal(m(40).reshape(40, 16)[:, :8].cpu(), fixed)
    pos = torch.arange(500, dtype=torch.float32)
    dyn = torch.outer(pos * (1 / (500 / 100)), inv)  # 500 > 400: dynamic scaling
    assert torch.equal(m(500).reshape(500, 16)[:, :8].cpu(), dyn)


def test_module_stays_fp32_after_bf16_cast():
    m = RotaryPositionEmbedding(32).to(torch.bfloat16)
    assert m(10).dtype == torch.float32


# ----------------------------------------------------------------------- apply_rotary_pos_emb

def _freqs(d, percent, interleaved, s):
    return RotaryPositionEmbedding(d, rotary_percent=percent, interleaved=interleaved)(s).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_matches_textbook(fmt, interleaved, percent, dtype, randn):
    s, b, h, d = 37, 3, 4, 32
    shape = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    t, dy = randn(*shape, scale=2.0, dtype=dtype), randn(*shape, dtype=dtype)
    freqs = _freqs(d, percent, interleaved, s + 5)  # longer than needed: only s rows are used
    rot = freqs.shape[-1]
    theta = half_angles(freqs, interleaved)[:s]
    theta = theta[:, None, None, :] if fmt == "sbhd" else theta[None, :, None, :]
    y, dx = run(t, freqs, dy, tensor_format=fmt, interleaved=interleaved)
    want_y, want_dx = oracle(t, theta, dy, rot, interleaved)
    assert_rope_close(y, want_y, t, rot, interleaved, "fwd")
    assert_rope_close(dx, want_dx, dy, rot, interleaved, "bwd")
    assert torch.equal(dx[..., rot:], dy[..., rot:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_equals_padded(interleaved, dtype, randn):
    """Packed sequences restart at position 0: thd == bshd on the padded batch, bit for bit,
    and both match the textbook."""
    lengths, h, d = [5, 1, 9, 4], 3, 16
    b, s = len(lengths), max(lengths)
    padded, dpad = randn(b, s, h, d, dtype=dtype), randn(b, s, h, d, dtype=dtype)
    packed = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    dpacked = torch.cat([dpad[i, :n] for i, n in enumerate(lengths)])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    freqs = _freqs(d, 0.5, interleaved, s)
    rot = freqs.shape[-1]
    y, dx = run(packed, freqs, dpacked, tensor_format="thd", cu_seqlens=cu,
                interleaved=interleaved)
    yp, dxp = run(padded, freqs, dpad, tensor_format="bshd", interleaved=interleaved)
    assert torch.equal(y, torch.cat([yp[i, :n] for i, n in enumerate(lengths)]))
    assert torch.equal(dx, torch.cat([dxp[i, :n] for i, n in enumerate(lengths)]))
    theta = torch.cat([half_angles(freqs, interleaved)[:n] for n in lengths])[:, None, :]
    want_y, want_dx = oracle(packed, theta, dpacked, rot, interleaved)
    assert_rope_close(y, want_y, packed, rot, interleaved, "fwd")
    assert_rope_close(dx, want_dx, dpacked, rot, interleaved, "bwd")


def test_hf_llama_convention(randn):
    """HF Llama: q [b, h, s, d], cos/sin [s, d] from cat(freqs, freqs), q * cos +
    rotate_half(q) * sin with rotate_half(x) = cat(-x2, x1). tritium's non-interleaved bshd on
    the transposed view gives the same, at fp32 tolerance."""
    b, h, s, d, base = 2, 4, 50, 64, 500000.0
    q = randn(b, h, s, d)
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(torch.arange(s).float(), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = d // 2
    rotate_half = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    hf = q * cos + rotate_half * sin
    freqs = RotaryPositionEmbedding(d, rotary_base=base)(s).cpu()
    ours = apply_rotary_pos_emb(q.transpose(1, 2), freqs, "bshd").transpose(1, 2)
    torch.testing.assert_close(ours, hf, rtol=1.3e-6, atol=1e-5)


def test_strided_views_of_fused_qkv(randn):
    """q and k as views of one [s, b, h, 3d] projection output: no copy needed, same bits as
    on contiguous copies, forward and backward."""
    s, b, h, d = 11, 2, 3, 16
    qkv = randn(s, b, h, 3 * d, dtype=torch.bfloat16)
    freqs = _freqs(d, 1.0, False, s)
    for part in range(2):
        view = qkv[..., part * d:(part + 1) * d]
        assert not view.is_contiguous()
        dy = randn(s, b, h, d, dtype=torch.bfloat16)
        y, dx = run(view, freqs, dy)
        y2, dx2 = run(view.contiguous(), freqs, dy)
        assert torch.equal(y, y2) and torch.equal(dx, dx2) and y.is_contiguous()


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_context_parallel_chunks(fmt, cp_size, randn):
    """Rank r holds chunks r and 2cp-1-r of every sequence: its result equals those chunks of
    the full-sequence result, bit for bit."""
    h, d = 2, 8
    lengths = [4 * cp_size, 2 * cp_size] if fmt == "thd" else [6 * cp_size]
    freqs = _freqs(d, 1.0, False, max(lengths))
    seqs = [randn(n, 1, h, d) for n in lengths]
    full = [apply_rotary_pos_emb(x, freqs, "sbhd") for x in seqs]

    def local(x, r):
        c = x.shape[0] // (2 * cp_size)
        return torch.cat([x[r * c:(r + 1) * c], x[(2 * cp_size - 1 - r) * c:(2 * cp_size - r) * c]])
    cu = torch.tensor([0] + lengths).cumsum(0)
    for r in range(cp_size):
        if fmt == "sbhd":
            got = apply_rotary_pos_emb(local(seqs[0], r), freqs, "sbhd", cp_size=cp_size,
                                       cp_rank=r)
            assert torch.equal(got, local(full[0], r))
        else:
            packed = torch.cat([local(x, r)[:, 0] for x in seqs])
            got = apply_rotary_pos_emb(packed, freqs, "thd", cu_seqlens=cu, cp_size=cp_size,
                                       cp_rank=r)
            assert torch.equal(got, torch.cat([local(y, r)[:, 0] for y in full]))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_start_positions(fmt, randn):
    s, b, h, d = 6, 3, 2, 8
    start = torch.tensor([0, 5, 2])
    freqs = _freqs(d, 1.0, True, s + 5)
    x = randn(b, s, h, d)
    # sequence i starts at position start[i]: the same as freqs shifted by start[i]
    want = torch.stack([apply_rotary_pos_emb(x[i:i + 1], freqs[int(start[i]):], "bshd",
                                             interleaved=True)[0] for i in range(b)])
    if fmt == "bshd":
        got = apply_rotary_pos_emb(x, freqs, "bshd", start_positions=start, interleaved=True)
    elif fmt == "sbhd":
        got = apply_rotary_pos_emb(x.transpose(0, 1), freqs, "sbhd", start_positions=start,
                                   interleaved=True).transpose(0, 1)
    else:
        cu = torch.arange(b + 1) * s
        got = apply_rotary_pos_emb(x.reshape(b * s, h, d), freqs, "thd", cu_seqlens=cu,
                                   start_positions=start, interleaved=True).reshape(b, s, h, d)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------- errors

def test_errors():
    t = torch.randn(8, 2, 3, 16)
    f = _freqs(16, 1.0, False, 8)
    with pytest.raises(ValueError, match="tensor_format must be one of"):
        apply_rotary_pos_emb(t, f, "sbdh")
    with pytest.raises(ValueError, match="freqs covers 4 positions but this call needs 8"):
        apply_rotary_pos_emb(t, f[:4])
    with pytest.raises(ValueError, match="rot_dim 32 > head dim 16"):
        apply_rotary_pos_emb(t, _freqs(32, 1.0, False, 8))
    with pytest.raises(ValueError, match="must be even"):
        apply_rotary_pos_emb(t, f[..., :5])
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        apply_rotary_pos_emb(t[:, 0], f, "thd")
    with pytest.raises(ValueError, match="cu_seqlens covers 7 local tokens"):
        apply_rotary_pos_emb(t[:, 0], f, "thd", cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="cu_seqlens is only used"):
        apply_rotary_pos_emb(t, f, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="t must be float32, bfloat16 or float16"):
        apply_rotary_pos_emb(t.double(), f)
    with pytest.raises(TypeError, match="freqs must be a floating-point"):
        apply_rotary_pos_emb(t, f.int())
    with pytest.raises(ValueError, match=r"needs t with 4 dims"):
        apply_rotary_pos_emb(t[0], f)
    with pytest.raises(ValueError, match=r"freqs must be \[s_max, 1, 1, rot_dim\]"):
        apply_rotary_pos_emb(t, f.reshape(8, 1, 16))
    with pytest.raises(ValueError, match="cp_rank must be"):
        apply_rotary_pos_emb(t, f, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="local sequence length must be even"):
        apply_rotary_pos_emb(t[:7], f, cp_size=2)
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size=4"):
        apply_rotary_pos_emb(t[:, 0], f, "thd", cu_seqlens=torch.tensor([0, 6, 16]), cp_size=2)
    with pytest.raises(ValueError, match="start_positions must be an integer tensor"):
        apply_rotary_pos_emb(t, f, start_positions=torch.tensor([1]))
    with pytest.raises(TypeError):
        apply_rotary_pos_emb(t, f, "sbhd", None, True)  # keyword-only past tensor_format
    with pytest.raises(ValueError, match="even and >= 2"):
        RotaryPositionEmbedding(10, rotary_percent=0.5)
    assert apply_rotary_pos_emb(t[:0], f).shape == (0, 2, 3, 16)
