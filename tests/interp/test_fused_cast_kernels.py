"""The fused FP8-cast kernels (`kernels.norm_cast`, `kernels.act_cast`) under the Triton
interpreter, bit for bit.

What is exact, and checked as integer bits (fp8 data, transpose, amax, scale_inv, the
high-precision outputs, mean/rstd):
  * fused kernel == the unfused kernel chain it replaces (norm / activation kernel, then
    `kernels.cast.cast_transpose`, pad to 16): the property the modules rely on (fused == unfused);
  * the cast half == the twin's cast (`ref.cast.cast_transpose`) of the same high-precision values.
End to end against the twins (`ref.norm.*_fwd_fp8`, `ref.activation.activation_*_fp8`) the
high-precision values themselves are only within a few fp32 ulps (row sums in another order;
numpy vs torch exp, see test_norm_kernels.py / test_activation_kernels.py), so there the fp8
bytes must agree wherever the high-precision values do.

Shapes are tiny and odd: rows 1, 5, 17, 33 (interpreter tiles: norm 2-row steps in 8-row
programs, activation 8 x 16 tiles; so row tiles, column tiles and the 16-row zero padding are
all crossed), hidden 48, 100 and F 8, 24. Scales send ~10% of values past fp8 max; the amax slot
starts below or above the data's amax, or is None (a recompute: nothing recorded).
"""
from __future__ import annotations

import pytest
import torch

from tritium.fp8.formats import fp8_max
from tritium.kernels import act_cast as kac
from tritium.kernels import activation as kact
from tritium.kernels import cast as kcast
from tritium.kernels import norm as knorm
from tritium.kernels import norm_cast as knc
from tritium.ref import activation as ract
from tritium.ref import cast as rcast
from tritium.ref import norm as rnorm

from ._helpers import assert_same_bits

pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _scale(y: torch.Tensor, fp8_dtype) -> torch.Tensor:
    q = y.float().abs().flatten().quantile(0.9) if y.numel() > 1 else y.float().abs().max()
    return (fp8_max(fp8_dtype) / q.clamp_min(1e-3) * 1.1).float().reshape(1)


def _amax(kind: str):
    return {"low": torch.tensor([1e-3]), "high": torch.tensor([1e4]), "none": None}[kind]


def _clone(t):
    return None if t is None else t.clone()


def _check_cast_half(hp, data, data_t, scale_inv, scale, fp8_dtype, what):
    """The fp8 outputs == the twin's cast of the same high-precision values."""
    rd, rdt, rsi = rcast.cast_transpose(hp, scale, None, fp8_dtype, pad_rows_to=16,
                                        write_transpose=data_t is not None)
    assert_same_bits(data, rd, f"{what}: data vs ref cast")
    assert_same_bits(data_t, rdt, f"{what}: data_t vs ref cast")
    assert_same_bits(scale_inv, rsi, f"{what}: scale_inv vs ref cast")


def _assert_fp8_agrees_where_hp_agrees(data, want_data, hp, want_hp, what):
    ints = {2: torch.int16, 4: torch.int32}
    same = (hp.contiguous().view(-1).view(ints[hp.element_size()])
            == want_hp.contiguous().view(-1).view(ints[want_hp.element_size()]))
    rows = hp.shape[0]
    g = data[:rows].reshape(-1).view(torch.uint8)[same]
    w = want_data[:rows].reshape(-1).view(torch.uint8)[same]
    assert torch.equal(g, w), f"{what}: fp8 differs where the high-precision values agree"


F32, BF16, F16 = DTYPES
# (norm, rows, hidden, dtype, amax slot start)
NORM_CASES = [("layernorm", 1, 48, F32, "low"), ("layernorm", 5, 100, BF16, "high"),
              ("layernorm", 17, 48, F16, "none"), ("layernorm", 33, 100, F32, "low"),
              ("rmsnorm", 1, 100, BF16, "low"), ("rmsnorm", 5, 48, F32, "none"),
              ("rmsnorm", 17, 100, BF16, "high"), ("rmsnorm", 33, 48, F16, "low")]


@pytest.mark.parametrize("norm,rows,hidden,dtype,amax_kind", NORM_CASES, ids=str)
def test_norm_cast(norm, rows, hidden, dtype, amax_kind, gen):
    x = (torch.randn(rows, hidden, generator=gen) * 2 + 0.5).to(dtype)
    w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    b = (torch.randn(hidden, generator=gen) * 0.5).to(dtype)
    zc = rows == 5  # zero-centered gamma in some cases
    write_t, write_hp = rows != 1, rows != 17
    args = (x, w, b, 1e-5, zc) if norm == "layernorm" else (x, w, 1e-5, zc)
    y_plain, *stats = getattr(knorm, f"{norm}_fwd")(*args)
    scale, amax0 = _scale(y_plain, E4M3), _amax(amax_kind)

    amax = _clone(amax0)
    y, data, data_t, si, *kstats = getattr(knc, f"{norm}_fwd_fp8")(
        *args, scale, amax, E4M3, write_transpose=write_t, write_hp=write_hp)
    # the unfused kernel chain
    amax_u = _clone(amax0)
    ud, udt, usi = kcast.cast_transpose(y_plain, scale, amax_u, E4M3, pad_rows_to=16,
                                        write_transpose=write_t)
    assert_same_bits(y, y_plain if write_hp else None, "y")
    for name, g, want in zip(("mean", "rstd") if norm == "layernorm" else ("rstd",), kstats,
                             stats):
        assert_same_bits(g, want, name)
    assert_same_bits(data, ud, "data")
    assert_same_bits(data_t, udt, "data_t")
    assert_same_bits(si, usi, "scale_inv")
    assert_same_bits(amax, amax_u, "amax")
    _check_cast_half(y_plain, data, data_t, si, scale, E4M3, norm)
    # the twin, end to end
    ry, rd, rdt, rsi, *_ = getattr(rnorm, f"{norm}_fwd_fp8")(
        *args, scale, _clone(amax0), E4M3, write_transpose=write_t, write_hp=True)
    assert rd.shape == data.shape and (rdt is None) == (data_t is None)
    _assert_fp8_agrees_where_hp_agrees(data, rd, y_plain, ry, norm)


def test_norm_cast_special_values(gen):
    x = torch.randn(9, 48, generator=gen)
    x[3, 5] = float("nan")
    x[6, 7] = float("inf")
    w, b = torch.ones(48), torch.zeros(48)
    scale, amax = torch.tensor([2.0]), torch.zeros(1)
    y, data, data_t, si, *_ = knc.layernorm_fwd_fp8(x, w, b, 1e-5, False, scale, amax, E5M2,
                                                    write_transpose=True, write_hp=True)
    amax_u = torch.zeros(1)
    ud, udt, _ = kcast.cast_transpose(knorm.layernorm_fwd(x, w, b, 1e-5, False)[0], scale, amax_u,
                                      E5M2, pad_rows_to=16, write_transpose=True)
    assert torch.isnan(amax).all() and torch.isnan(amax_u).all()
    assert_same_bits(data, ud, "data", nan_as_nan=True)
    assert_same_bits(data_t, udt, "data_t", nan_as_nan=True)


# (kind, rows, F, dtype, amax slot start / backward fp8 dtype)
FWD_CASES = [("swiglu", 33, 24, BF16, "low"), ("swiglu", 5, 8, F32, "none"),
             ("geglu", 17, 8, F16, "low"), ("glu", 1, 24, F32, "low"),
             ("gelu", 17, 24, BF16, "none"), ("srelu", 5, 24, F16, "low"),
             ("qgelu", 33, 8, F32, "low")]
BWD_CASES = [("swiglu", 33, 24, BF16, E5M2), ("swiglu", 17, 8, F32, E4M3),
             ("geglu", 5, 24, F16, E5M2), ("reglu", 1, 8, BF16, E5M2),
             ("glu", 17, 24, F32, E5M2), ("gelu", 33, 8, F16, E5M2),
             ("srelu", 5, 8, BF16, E4M3), ("silu", 17, 24, F32, E5M2)]


@pytest.mark.parametrize("kind,rows,f,dtype,amax_kind", FWD_CASES, ids=str)
def test_activation_cast_fwd(kind, rows, f, dtype, amax_kind, gen):
    gated = kind in kact.GATED
    x = (torch.randn(rows, 2 * f if gated else f, generator=gen) * 2).to(dtype)
    y_plain = kact.activation_fwd(x, kind)
    scale, amax0 = _scale(y_plain, E4M3), _amax(amax_kind)
    write_data, write_t = (True, rows != 1) if rows != 5 else (False, True)
    amax, amax_u = _clone(amax0), _clone(amax0)
    data, data_t, si = kac.activation_fwd_fp8(x, kind, scale, amax, E4M3, write_data=write_data,
                                              write_transpose=write_t)
    ud, udt, usi = kcast.cast_transpose(y_plain, scale, amax_u, E4M3, pad_rows_to=16,
                                        write_data=write_data, write_transpose=write_t)
    assert_same_bits(data, ud, "data")
    assert_same_bits(data_t, udt, "data_t")
    assert_same_bits(si, usi, "scale_inv")
    assert_same_bits(amax, amax_u, "amax")
    if write_data:
        _check_cast_half(y_plain, data, data_t, si, scale, E4M3, kind)
        rd, _, _ = ract.activation_fwd_fp8(x, kind, scale, None, E4M3)
        _assert_fp8_agrees_where_hp_agrees(data, rd, y_plain, ract.activation_fwd(x, kind), kind)


@pytest.mark.parametrize("kind,rows,f,dtype,fp8_dtype", BWD_CASES, ids=str)
def test_activation_cast_bwd(kind, rows, f, dtype, fp8_dtype, gen):
    gated = kind in kact.GATED
    x = (torch.randn(rows, 2 * f if gated else f, generator=gen) * 2).to(dtype)
    dy = torch.randn(rows, f, generator=gen).to(dtype)
    dx_plain = kact.activation_bwd(dy, x, kind)
    scale = _scale(dx_plain, fp8_dtype)
    write_hp = rows != 17
    write_data, write_t = (True, True) if rows != 5 else (False, True)
    amax, amax_u = torch.tensor([1e-3]), torch.tensor([1e-3])
    dx, data, data_t, si = kac.activation_bwd_fp8(dy, x, kind, scale, amax, fp8_dtype,
                                                  write_data=write_data, write_transpose=write_t,
                                                  write_hp=write_hp)
    ud, udt, usi = kcast.cast_transpose(dx_plain, scale, amax_u, fp8_dtype, pad_rows_to=16,
                                        write_data=write_data, write_transpose=write_t)
    assert_same_bits(dx, dx_plain if write_hp else None, "dx")
    assert_same_bits(data, ud, "data")
    assert_same_bits(data_t, udt, "data_t")
    assert_same_bits(si, usi, "scale_inv")
    assert_same_bits(amax, amax_u, "amax")
    if write_data:
        _check_cast_half(dx_plain, data, data_t, si, scale, fp8_dtype, kind)
        _, rd, _, _ = ract.activation_bwd_fp8(dy, x, kind, scale, None, fp8_dtype)
        _assert_fp8_agrees_where_hp_agrees(data, rd, dx_plain, ract.activation_bwd(dy, x, kind),
                                           kind)


def test_transposes_only_record_amax(gen):
    """Neither data nor hp written: the amax still comes from the transposed tiles."""
    x = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
    dy = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
    amax = torch.zeros(1)
    _, data, data_t, _ = kac.activation_bwd_fp8(dy, x, "swiglu", torch.tensor([4.0]), amax, E5M2,
                                                write_data=False, write_transpose=True)
    want = kact.activation_bwd(dy, x, "swiglu").float().abs().max().reshape(1)
    assert data is None and data_t.shape == (16, 16)
    assert_same_bits(amax, want, "amax")


@pytest.mark.parametrize("module", ["mlp", "linear"])
def test_modules_through_the_kernels(module):
    """LayerNormMLP / LayerNormLinear with the Triton kernels (norm, activation, casts): fused
    == unfused, bit for bit, over two steps (outputs, grads, FP8 states; see
    tests/test_fused_casts.py)."""
    import tritium as te
    from test_fused_casts import _compare

    if module == "mlp":
        m = te.LayerNormMLP(32, 48, normalization="RMSNorm", activation="swiglu", bias=True,
                            params_dtype=torch.bfloat16, device="cpu")
    else:
        m = te.LayerNormLinear(32, 48, return_layernorm_output=True,
                               params_dtype=torch.bfloat16, device="cpu")
    _compare(m, steps=2, shape=(3, 7, 32), dtype=torch.bfloat16)
