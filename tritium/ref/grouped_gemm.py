"""Pure-PyTorch twins of `tritium.kernels.grouped_gemm`: the grouped FP8 cast and the grouped
FP8 GEMMs of GroupedLinear (the CPU path and the test oracle).

Layout (shared with the kernels). `offsets` is an int32 [2, G+1] tensor: row 0 the cumulative
row counts of the G groups (group g owns rows offsets[0, g] : offsets[0, g+1] of a [M, K]
tensor, m_g may be 0), row 1 the same with every m_g rounded up to 16 (the "padded" offsets).
A group's transpose is stored on its own, as a row-major [K, pm_g] block (pm_g = m_g rounded up
to 16, the extra columns left unwritten and never read) at element K * offsets[1, g] of one flat
buffer: the wgrad GEMM then reads each group's K-major operand with 16-byte-aligned rows. For G
equal groups of N rows (stacked weights, N a multiple of 16) that buffer is exactly [G, K, N].

Numerics: each group's cast is `tritium.ref.cast.cast_transpose` with that group's scale and
amax slot (scale in fp32, clamp, round to nearest even; amax max-accumulated; scale_inv exact
1/scale). The GEMMs multiply exact fp8 values in fp32 per group, scale by the group's
a_scale_inv * b_scale_inv, add the group's bias and round once, as `tritium.ref.gemm` does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .cast import amax_into, cast_transpose, current_scale


def _host_offsets(m_splits: Sequence[int]) -> tuple:
    """The offsets of `m_splits` as Python lists: (real, padded to 16), G+1 each."""
    real, padded = [0], [0]
    for m in m_splits:
        real.append(real[-1] + m)
        padded.append(padded[-1] + -(-m // 16) * 16)
    return real, padded


def make_offsets(m_splits: Sequence[int], device) -> torch.Tensor:
    """The int32 [2, G+1] offsets of `m_splits` (real and padded to 16), see the docstring."""
    host = torch.tensor(list(_host_offsets(m_splits)), dtype=torch.int32)
    if torch.device(device).type != "cuda":
        return host.to(device)
    # from pinned memory without blocking: a plain copy from pageable memory would wait for
    # the stream (a host sync in every GroupedLinear forward)
    return host.pin_memory().to(device, non_blocking=True)


def _splits(offsets: torch.Tensor, m_splits=None):
    """(row start, row end, padded start, padded end) of every group: from `m_splits` when the
    caller has the row counts on the host, else read back from `offsets` (on a GPU a sync,
    under torch.compile a graph break)."""
    o = _host_offsets(m_splits) if m_splits is not None else offsets.tolist()
    return [(o[0][g], o[0][g + 1], o[1][g], o[1][g + 1]) for g in range(len(o[0]) - 1)]


def grouped_amax_into(x: torch.Tensor, offsets: torch.Tensor, amax: torch.Tensor, *,
                      m_splits=None) -> None:
    """amax[g] = max(amax[g], max|x[rows of g]|) for every group (amax: [G], any stride);
    m_splits as in grouped_cast_transpose."""
    for g, (r0, r1, _, _) in enumerate(_splits(offsets, m_splits)):
        amax_into(x[r0:r1], amax[g:g + 1])


def grouped_cast_transpose(x: torch.Tensor, offsets: torch.Tensor, scale: Optional[torch.Tensor],
                           amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
                           write_data: bool = True, write_transpose: bool = False,
                           current: Optional[tuple] = None, m_splits=None):
    """Cast the rows of each group of x [M, K] with that group's scale.

    scale / amax: [G] fp32 (any stride: e.g. every other slot of a forward scaling state); amax
    None records nothing. current=(amax_epsilon, power_2_scale): scale is None and amax must
    already hold each group's max|x| (see grouped_amax_into); it is not updated.
    m_splits: the groups' row counts when the caller has them on the host (then nothing is read
    back from the device).
    Returns (data [M, K] or None, data_t flat [K * padded M] or None, scale_inv [G] fp32).
    """
    m, k = x.shape
    splits = _splits(offsets, m_splits)
    data = torch.empty(m, k, dtype=fp8_dtype, device=x.device) if write_data else None
    data_t = (torch.empty(k * splits[-1][3] if splits else 0, dtype=fp8_dtype, device=x.device)
              if write_transpose else None)
    scale_inv = torch.empty(len(splits), dtype=torch.float32, device=x.device)
    for g, (r0, r1, p0, p1) in enumerate(splits):
        if current is not None:
            s = current_scale(amax[g:g + 1], fp8_dtype, *current)
        else:
            s = scale[g:g + 1]
        if r1 == r0:  # an empty group: only its scale_inv (and nothing recorded)
            scale_inv[g:g + 1] = torch.ones_like(s.float()) / s.float()
            continue
        a = None if current is not None or amax is None else amax[g:g + 1]
        d, t, si = cast_transpose(x[r0:r1], s, a, fp8_dtype, write_transpose=write_transpose)
        if write_data:
            data[r0:r1] = d
        if write_transpose:
            block = data_t[k * p0:k * p1].view(k, p1 - p0)
            block[:, :r1 - r0] = t
        scale_inv[g:g + 1] = si
    return data, data_t, scale_inv


def grouped_fp8_gemm_tn(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                        b_scale_inv: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None, fast_accum: bool = False, *,
                        m_splits=None) -> torch.Tensor:
    """out[rows of g] = (a[rows of g] @ b[g].T) * a_scale_inv[g] * b_scale_inv[g] + bias[g].

    a [M, K] fp8 (rows grouped by `offsets` row 0), b [G, N, K] fp8, scale_invs [G] fp32,
    bias [G, N] or None; m_splits as in grouped_cast_transpose. Returns [M, N] of out_dtype
    (fprop and dgrad of GroupedLinear)."""
    m = a.shape[0]
    n = b.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    for g, (r0, r1, _, _) in enumerate(_splits(offsets, m_splits)):
        if r1 == r0:
            continue
        res = (a[r0:r1].float() @ b[g].float().t()) * (a_scale_inv[g] * b_scale_inv[g])
        if bias is not None:
            res = res + bias[g].float()
        out[r0:r1] = res.to(out_dtype)
    return out


def grouped_fp8_gemm_wgrad(a_t: torch.Tensor, b_t: torch.Tensor, a_scale_inv: torch.Tensor,
                           b_scale_inv: torch.Tensor, offsets: torch.Tensor, n: int, k: int,
                           out_dtype: torch.dtype, *, m_splits=None) -> torch.Tensor:
    """out[g] = (A_g @ B_g.T) * a_scale_inv[g] * b_scale_inv[g] with A_g [N, m_g] and B_g
    [K, m_g] the groups' transposed blocks of a_t and b_t (flat, see the docstring): the
    reduction runs over each group's rows. Returns [G, N, K] (an empty group gives zeros);
    m_splits as in grouped_cast_transpose."""
    splits = _splits(offsets, m_splits)
    out = torch.empty(len(splits), n, k, dtype=out_dtype, device=a_t.device)
    for g, (r0, r1, p0, p1) in enumerate(splits):
        ag = a_t[n * p0:n * p1].view(n, p1 - p0)[:, :r1 - r0].float()
        bg = b_t[k * p0:k * p1].view(k, p1 - p0)[:, :r1 - r0].float()
        out[g] = ((ag @ bg.t()) * (a_scale_inv[g] * b_scale_inv[g])).to(out_dtype)
    return out


__all__ = ["make_offsets", "grouped_amax_into", "grouped_cast_transpose", "grouped_fp8_gemm_tn",
           "grouped_fp8_gemm_wgrad"]
