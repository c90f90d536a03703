"""`apply_rotary_pos_emb`: TE's rotary position embedding with autograd, kernel or twin per call.

Semantics (TE's): t is sbhd [s, b, h, d], bshd [b, s, h, d] or thd [t, h, d] (packed sequences
given by cu_seqlens [n + 1]; each sequence restarts at position 0). freqs is [s_max, 1, 1, R]
(what `RotaryPositionEmbedding` returns; [s_max, R] is accepted too), any float dtype, used in
fp32. The first R features of every head rotate, out = t * cos + rotate_half(t) * sin, the other
d - R pass through. Non-interleaved rotate_half pairs feature i with i + R/2 (GPT-NeoX / HF
Llama); interleaved pairs 2i with 2i + 1 (GPT-J). Math in fp32, one rounding to t's dtype.

Positions. Token i of a sequence of (local) length L sits at position i, plus start_positions[b]
when given (per sequence, inference). With context parallelism (cp_size > 1, TE's load
balancing) each rank holds chunks r and 2cp-1-r of 2cp equal chunks of every sequence, so its
local token i sits at r*L/2 + i (first half) or (2cp-1-r)*L/2 + i - L/2 (second half); for thd,
cu_seqlens is the global (padded) one, as in TE, and the local sequences are its lengths / cp.

Numerics and dispatch. This layer turns freqs into fp32 tables cos = torch.cos(freqs),
sin = torch.sin(freqs) for the rows that are used, and builds an int32 row index per token; the
Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1) and its PyTorch twin both take those, so
they agree bit for bit (`tritium.ref.rope` writes down the arithmetic). `fused` is accepted for
TE compatibility and changes nothing: tritium has one implementation, with the fused numerics
(TE's fused=False path instead multiplies by cos/sin rounded to t's dtype). Non-contiguous t (q/k
views of a fused QKV output) is read through its strides, without a copy; the result is a new
contiguous tensor. No gradient flows to freqs (as in TE). thd and start_positions read
cu_seqlens / start_positions on the host once per call (a sync, as TE's unfused path does) to
check that freqs is long enough.

torch.compile: everything here traces without a graph break for sbhd / bshd / thd without
start_positions. Under compile the positions of dense formats are built in the graph on the
device (no lru_cache, no host-to-device copy), the cos/sin tables are not reused across calls
(no Python-side cache), and thd positions come from cu_seqlens on the device
(`_thd_positions_traced`, no host read); the freqs-length check of thd, which needs that
read, is then skipped (a too-short freqs fails in the gather instead).

Every argument after tensor_format is keyword-only: TE has reordered them between releases
(start_positions, interleaved, fused), so a positional call is ambiguous.
"""
from __future__ import annotations

from typing import Optional

import functools
import weakref

import torch
from torch.autograd.function import once_differentiable

from .. import _device
from ..ops import rope as ops_rope
from ..ref import rope as ref_rope
from ._apply import fast_apply

FORMATS = ("sbhd", "bshd", "thd")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(t: torch.Tensor):
    if torch.compiler.is_compiling():
        return ops_rope
    if _device.use_triton(t):
        return _device.kernel_module("rope")
    return ref_rope


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                interleaved: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin, pos)
        ctx.interleaved = interleaved
        return _impl(x).rope_fwd(x, cos, sin, pos, interleaved)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        cos, sin, pos = ctx.saved_tensors
        return _impl(dy).rope_bwd(dy, cos, sin, pos, ctx.interleaved), None, None, None, None


_apply_rope = fast_apply(_RoPE)


def _cp_positions(length, i: torch.Tensor, cp_size: int, cp_rank: int):
    """Global position of local token i of a local sequence of `length` tokens."""
    if cp_size == 1:
        return i
    half = length // 2
    return torch.where(i < half, cp_rank * half + i, (2 * cp_size - 1 - cp_rank) * half + i - half)


@functools.lru_cache(maxsize=16)
def _dense_positions(s: int, cp_size: int, cp_rank: int, dev: torch.device) -> torch.Tensor:
    """int32 [s, 1]: the position of each local token of an sbhd/bshd sequence (cached: it only
    depends on these four values)."""
    i = torch.arange(s, dtype=torch.int32)
    return _cp_positions(s, i, cp_size, cp_rank).to(torch.int32).to(dev)[:, None]


def _check_freqs(freqs, t, d: int) -> torch.Tensor:
    if not isinstance(freqs, torch.Tensor):
        raise TypeError("freqs must be a tensor [s_max, 1, 1, rot_dim], got "
                        f"{type(freqs).__name__}")
    if not freqs.is_floating_point():
        raise TypeError(f"freqs must be a floating-point tensor (angles in radians), got "
                        f"{freqs.dtype}; RotaryPositionEmbedding returns float32 freqs")
    if freqs.dim() == 4 and freqs.shape[1] == freqs.shape[2] == 1:
        freqs = freqs.reshape(freqs.shape[0], freqs.shape[3])
    elif freqs.dim() != 2:
        raise ValueError(f"freqs must be [s_max, 1, 1, rot_dim] (or [s_max, rot_dim]), got shape "
                         f"{tuple(freqs.shape)}; one set of angles per position, shared by all "
                         "batch entries and heads")
    if freqs.device != t.device:
        raise ValueError(f"freqs is on {freqs.device} but t is on {t.device}; move it with "
                         "freqs.to(t.device)")
    rot = freqs.shape[1]
    if rot > d:
        raise ValueError(f"freqs has rot_dim {rot} > head dim {d} of t: rot_dim must be <= d "
                         "(build freqs with RotaryPositionEmbedding(d) or a smaller "
                         "rotary_percent)")
    if rot % 2 or rot == 0:
        raise ValueError(f"freqs' rot_dim (its last dim) must be even and > 0, got {rot}: "
                         "features rotate in pairs")
    return freqs


def _positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank):
    """(x4 view of t, int32 pos [N1, N2] on t's device, number of table rows used or None)."""
    dev = t.device
    if tensor_format != "thd":
        s_dim = 0 if tensor_format == "sbhd" else 1
        s, b = t.shape[s_dim], t.shape[1 - s_dim]
        if cp_size > 1 and s % 2:
            raise ValueError(f"with cp_size={cp_size} the local sequence length must be even (two "
                             f"chunks per rank), got {s}")
        if start_positions is None:
            if torch.compiler.is_compiling():  # built in the graph, on the device
                i = torch.arange(s, dtype=torch.int32, device=dev)
                pos = _cp_positions(s, i, cp_size, cp_rank).to(torch.int32)[:, None]
            else:
                pos = _dense_positions(s, cp_size, cp_rank, dev)
            pos = pos.expand(s, b)
            return t, (pos if s_dim == 0 else pos.t()), s * cp_size
        start = _check_start(start_positions, b, dev, "batch size")
        pos = (torch.arange(s, device=dev)[:, None] + start[None, :]).to(torch.int32)
        rows = s + int(start.max().item()) if b else s
        return t, (pos if s_dim == 0 else pos.t()), rows
    if cu_seqlens is None:
        raise ValueError("tensor_format='thd' needs cu_seqlens (int tensor [n + 1], the "
                         "cumulative sequence lengths starting at 0)")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1D integer tensor [n + 1] (cumulative sequence "
                         f"lengths, starting at 0), got {cu_seqlens!r:.80}")
    if torch.compiler.is_compiling() and start_positions is None:
        pos = _thd_positions_traced(cu_seqlens, t.shape[0], cp_size, cp_rank)
        return t.unsqueeze(1), pos.to(dev), None  # None: every row of freqs
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or (lengths < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu.tolist()[:8]}")
    if cp_size > 1 and (lengths % (2 * cp_size)).any():
        raise ValueError(f"with cp_size={cp_size} every sequence length in cu_seqlens (pass "
                         f"cu_seqlens_padded) must be divisible by 2*cp_size={2 * cp_size}")
    local = lengths // cp_size
    total = int(local.sum())
    if total != t.shape[0]:
        raise ValueError(f"cu_seqlens covers {total} local tokens (cu_seqlens[-1] // cp_size) but "
                         f"t has {t.shape[0]}: they must match")
    seq = torch.repeat_interleave(torch.arange(local.numel()), local)
    i = torch.arange(total) - (torch.cumsum(local, 0) - local)[seq]
    pos = _cp_positions(local[seq], i, cp_size, cp_rank)
    rows = int(lengths.max()) if lengths.numel() else 0
    if start_positions is not None:
        start = _check_start(start_positions, local.numel(), "cpu", "number of sequences")
        pos = pos + start[seq]
        rows = int((lengths + start).max()) if lengths.numel() else 0
    return t.unsqueeze(1), pos.to(torch.int32).to(dev)[:, None], rows


def _thd_positions_traced(cu_seqlens: torch.Tensor, total: int, cp_size: int, cp_rank: int):
    """int32 [total, 1] positions of thd tokens, computed on cu_seqlens' device (no host read)."""
    local = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64) // cp_size
    ends = torch.cumsum(local, 0)
    i = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, i, right=True).clamp_(max=local.numel() - 1)
    pos = _cp_positions(local[seq], i - (ends - local)[seq], cp_size, cp_rank)
    return pos.to(torch.int32)[:, None]


def _check_start(start_positions, n: int, dev, what: str) -> torch.Tensor:
    if not isinstance(start_positions, torch.Tensor) or start_positions.is_floating_point() \
            or tuple(start_positions.shape) != (n,):
        raise ValueError(f"start_positions must be an integer tensor [{n}] (one offset per "
                         f"sequence, {what} {n}), got {start_positions!r:.80}")
    start = start_positions.to(dev, torch.int64)
    if n and int(start.min().item()) < 0:
        raise ValueError("start_positions must be >= 0")
    return start


_last_tables: list = [None]  # (weakref to freqs, its version, rows, cos, sin)


def _tables(freqs: torch.Tensor, f2: torch.Tensor, rows: int):
    """fp32 cos and sin of freqs' first `rows` positions, contiguous [rows, rot_dim]. The last
    result is kept for the same, unmodified freqs tensor (q and k of a layer share it), except
    under torch.compile (a Python-side cache in a traced region is a graph break)."""
    if torch.compiler.is_compiling():
        return _cos_sin(f2, rows)
    try:
        version = freqs._version
    except RuntimeError:  # inference tensors have no version counter: no reuse
        version = None
    hit = _last_tables[0]
    if version is not None and hit is not None and hit[0]() is freqs and hit[1] == version \
            and hit[2] == rows:
        return hit[3], hit[4]
    cos, sin = _cos_sin(f2, rows)
    if version is not None:
        _last_tables[0] = (weakref.ref(freqs), version, rows, cos, sin)
    return cos, sin


def _cos_sin(f2: torch.Tensor, rows: int):
    angles = f2[:rows].detach().float()
    return torch.cos(angles).contiguous(), torch.sin(angles).contiguous()


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", *,
                         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
                         fused: bool = True, cu_seqlens: Optional[torch.Tensor] = None,
                         cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Rotate the first rot_dim features of every head of t by the angles in freqs (TE's
    `apply_rotary_pos_emb`; see the module docstring). Returns a new tensor shaped like t."""
    del fused  # one implementation, fused numerics (module docstring)
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format must be one of {', '.join(FORMATS)}, got "
                         f"{tensor_format!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a tensor, got {type(t).__name__}")
    ndim = 3 if tensor_format == "thd" else 4
    if t.dim() != ndim:
        raise ValueError(f"tensor_format={tensor_format!r} needs t with {ndim} dims "
                         f"[{', '.join(tensor_format)}], got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"t must be float32, bfloat16 or float16, got {t.dtype}; cast it first "
                        "(e.g. t.float())")
    if cu_seqlens is not None and tensor_format != "thd":
        raise ValueError(f"cu_seqlens is only used with tensor_format='thd', got "
                         f"tensor_format={tensor_format!r}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("start_positions (inference) cannot be combined with cp_size > 1")
    f2 = _check_freqs(freqs, t, t.shape[-1])
    x4, pos, rows = _positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    if rows is None:    # thd under compile: the lengths were not read on the host
        rows = f2.shape[0]
    if rows > f2.shape[0]:
        raise ValueError(f"freqs covers {f2.shape[0]} positions but this call needs {rows} "
                         f"(sequence length{' x cp_size' if cp_size > 1 else ''}"
                         f"{' + start_positions' if start_positions is not None else ''}); "
                         "build freqs with RotaryPositionEmbedding(...)(max_seq_len) for a longer "
                         "max_seq_len")
    cos, sin = _tables(freqs, f2, rows)
    y = _apply_rope(x4, cos, sin, pos, bool(interleaved))
    return y.squeeze(1) if tensor_format == "thd" else y


__all__ = ["FORMATS", "apply_rotary_pos_emb"]
