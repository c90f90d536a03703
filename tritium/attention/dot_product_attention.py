"""te.DotProductAttention and its functional forms.

    DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups=None,
                        attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                        window_size=None, softmax_scale=None, layer_number=None,
                        attention_type="self", cp_group=None, cp_global_ranks=None,
                        cp_stream=None, cp_comm_type="p2p", backend="auto")
    forward(query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
            cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
            attn_mask_type=None, window_size=None, core_attention_bias_type="no_bias", ...)

Formats (TE's): sbhd q [s, b, h, d] -> out [s, b, h*d_v]; bshd [b, s, h, d] -> [b, s, h*d_v];
thd [t, h, d] with cu_seqlens_q/kv (int32 [b+1]) -> [t, h*d_v]. Mask semantics: masks.py.

Layers: `prepare()` checks the arguments (every error names the argument and the fix) and turns
sbhd into a bshd view (no copy), giving canonical tensors and an `AttnArgs`; a backend
(backends.py) is chosen per call, cached by call signature; `_Attention` (autograd Function)
runs its fwd/bwd and returns (out, lse). `attention_forward` / `attention_backward` expose the
same fwd/bwd pair without autograd, for a context-parallel ring (fp32 lse, any (out, lse) pair
in backward). The module owns no parameters: forward is one functional call.
Context parallelism: with a cp_group of more than one rank, forward runs
`attention.cp.context_parallel_attention` (the ring or all_gather strategy; inputs are the local
load-balanced part of the sequence); attributes cp_mode / cp_fp32_accumulation pick precision.
FP8 attention (recipe fp8_dpa=True inside fp8_autocast): the module makes an FP8 plan
(attention/fp8.py: q/k/v scales, its delayed-scaling state) and the call runs an FP8 backend
(`triton_fp8` or the emulation `torch_fp8`), chosen and explained like the others. The
delayed-scaling state is the module's `_extra_state` in state_dict() (None without one); a
state dict without that entry (written before it existed) loads with strict=True: a load
pre-hook fills in None, and checks a saved state under the module's name before any change.
Not supported (clear errors): core attention bias / ALiBi, inference KV caches, fp8_mha, FP8
attention with dropout or context parallelism.
torch.compile: every format and mask traces without a graph break (backends.py says how the
choice does); thd without max_seqlen_q/kv bounds them by the token count when compiling (the
eager path reads cu_seqlens on the host). CP is one graph break (cp/__init__.py).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _env
from ..functional._apply import fast_apply
from . import backends as B
from . import fp8 as F
from . import masks as M

_FORMATS = ("sbhd", "bshd", "thd")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def env_backend() -> Optional[str]:
    """TRITIUM_ATTN_BACKEND, read through tritium._env (the one place env vars are read)."""
    fn = getattr(_env, "attn_backend", None)
    return fn() if fn is not None else None


def _fail(where, msg, exc=ValueError):
    raise exc(f"{where}: {msg}")


def _check_qkv(q, k, v, fmt, where):
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, torch.Tensor):
            _fail(where, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if not (q.dtype == k.dtype == v.dtype):
        _fail(where, f"query/key/value dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast "
              "them to one dtype", TypeError)
    if q.dtype not in _FLOAT:
        _fail(where, f"dtype {q.dtype} is not supported; use bfloat16, float16 or float32",
              TypeError)
    if not (q.device == k.device == v.device):
        _fail(where, f"query/key/value are on different devices ({q.device}, {k.device}, "
              f"{v.device})")
    ndim = 3 if fmt == "thd" else 4
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if t.dim() != ndim:
            _fail(where, f"{name} has shape {tuple(t.shape)}; qkv_format={fmt!r} needs "
                  f"{ndim} dims [{', '.join(fmt)}]")


def _cu(cu, name, batch, device, where):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        _fail(where, f"{name} must be a 1-D torch.int32 tensor of cumulative sequence lengths "
              f"[batch + 1], got {getattr(cu, 'dtype', type(cu).__name__)} "
              f"{tuple(getattr(cu, 'shape', ()))}")
    if batch is not None and cu.numel() != batch + 1:
        _fail(where, f"{name} has {cu.numel()} entries; batch {batch} needs {batch + 1}")
    if cu.numel() < 2:
        _fail(where, f"{name} needs at least 2 entries ([0, len_0, ...])")
    if cu.device != device:
        _fail(where, f"{name} is on {cu.device} but the inputs are on {device}")
    return cu if cu.is_contiguous() else cu.contiguous()


def _max_seqlen(cu, given, tokens: int) -> int:
    """max_seqlen_q/kv of a thd call: the given one, else read from cu_seqlens (a host sync);
    under torch.compile, where that read is a graph break, the token count bounds it."""
    if given is not None:
        return int(given)
    if torch.compiler.is_compiling():
        return tokens
    return int((cu[1:] - cu[:-1]).max())


def _arbitrary(mask, batch, heads, sq, sk, where):
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        _fail(where, "attn_mask_type='arbitrary' needs attention_mask, a bool tensor (True = "
              f"masked out) broadcastable to [b, h, s_q, s_kv] = [{batch}, {heads}, {sq}, {sk}]",
              TypeError)
    want = (batch, heads, sq, sk)
    if mask.dim() != 4 or any(m != 1 and m != w for m, w in zip(mask.shape, want)):
        _fail(where, f"attention_mask has shape {tuple(mask.shape)}; an arbitrary mask must "
              f"broadcast to [b, h, s_q, s_kv] = {list(want)}")
    return mask


def prepare(q, k, v, *, qkv_format="sbhd", attn_mask_type="causal", attention_mask=None,
            window_size=None, softmax_scale=None, dropout_p=0.0, cu_seqlens_q=None,
            cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
            where="DotProductAttention"):
    """Check one call and resolve it: -> (q, k, v canonical ("bshd" views or "thd"), AttnArgs)."""
    if qkv_format not in _FORMATS:
        _fail(where, f"qkv_format={qkv_format!r} is not one of {_FORMATS}")
    _check_qkv(q, k, v, qkv_format, where)
    mask_type = M.parse_mask_type(attn_mask_type)
    if qkv_format == "sbhd":
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    heads, kv_heads, d_qk, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-1] != d_qk:
        _fail(where, f"query head dim {d_qk} != key head dim {k.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        _fail(where, f"key {tuple(k.shape)} and value {tuple(v.shape)} must agree in all but "
              "the head dim")
    if kv_heads < 1 or heads % kv_heads:
        _fail(where, f"{heads} query heads are not a multiple of {kv_heads} key/value heads "
              "(GQA needs num_attention_heads % num_gqa_groups == 0)")
    if not 0.0 <= float(dropout_p) < 1.0:
        _fail(where, f"attention dropout {dropout_p} must be in [0, 1)")
    scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    left, right = M.normalize_window(window_size, mask_type)
    causal, br = M.is_causal(mask_type), M.bottom_right(mask_type)
    q_pad = kv_pad = arbitrary = cu_q = cu_kv = None
    if qkv_format == "thd":
        if mask_type == "arbitrary":
            _fail(where, "attn_mask_type='arbitrary' is not supported with qkv_format='thd'; "
                  "pad to bshd")
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            _fail(where, "qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (int32 "
                  "[batch + 1], cumulative lengths starting at 0)")
        cu_q = _cu(cu_seqlens_q, "cu_seqlens_q", None, q.device, where)
        batch = cu_q.numel() - 1
        cu_kv = cu_q if cu_seqlens_kv is cu_seqlens_q else _cu(cu_seqlens_kv, "cu_seqlens_kv",
                                                                batch, q.device, where)
        sq = _max_seqlen(cu_q, max_seqlen_q, q.shape[0])
        sk = (sq if cu_kv is cu_q and max_seqlen_kv is None else
              _max_seqlen(cu_kv, max_seqlen_kv, k.shape[0]))
        same = cu_kv is cu_q
        if (causal or left >= 0 or right >= 0) and not br and not same \
                and not torch.compiler.is_compiling():
            same = bool(torch.equal(cu_q, cu_kv))
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if k.shape[0] != batch:
            _fail(where, f"query batch {batch} != key/value batch {k.shape[0]}")
        same = sq == sk
        if M.is_padding(mask_type):
            if attention_mask is not None:
                q_pad, kv_pad = M.padding_from_mask(attention_mask, batch, sq, sk,
                                                    self_attention=True)
            elif cu_seqlens_q is not None and cu_seqlens_kv is not None:
                q_pad = M.padding_from_cu_seqlens(_cu(cu_seqlens_q, "cu_seqlens_q", batch,
                                                      q.device, where), batch, sq)
                kv_pad = M.padding_from_cu_seqlens(_cu(cu_seqlens_kv, "cu_seqlens_kv", batch,
                                                       q.device, where), batch, sk)
            else:
                _fail(where, f"attn_mask_type={mask_type!r} needs attention_mask "
                      f"([b, 1, 1, s] bool, or a (q, kv) pair) or cu_seqlens_q/cu_seqlens_kv")
            same = same and q_pad is kv_pad
        elif mask_type == "arbitrary":
            arbitrary = _arbitrary(attention_mask, batch, heads, sq, sk, where)
        elif attention_mask is not None:
            _fail(where, f"attention_mask is only used by padding and arbitrary mask types; "
                  f"attn_mask_type={mask_type!r} takes None")
    args = B.AttnArgs(fmt="thd" if qkv_format == "thd" else "bshd", batch=batch, heads=heads,
                      kv_heads=kv_heads, d_qk=d_qk, d_v=d_v, sq=sq, sk=sk, causal=causal,
                      bottom_right=br, left=left, right=right, scale=scale,
                      dropout=float(dropout_p), q_pad=q_pad, kv_pad=kv_pad, mask=arbitrary,
                      cu_q=cu_q, cu_kv=cu_kv, same_lengths=same, mask_type=mask_type)
    return q, k, v, args


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, args, backend):
        out, lse, aux = backend.fwd(q, k, v, args)
        ctx.save_for_backward(q, k, v, backend.saved_out(out, aux), lse)
        ctx.args, ctx.backend, ctx.aux = args, backend, aux
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.bwd(dout, q, k, v, out, lse, ctx.aux, ctx.args)
        return dq, dk, dv, None, None


_apply_attention = fast_apply(_Attention)


def _backend_name(backend):
    forced = env_backend()
    return B.resolve_name(forced if (backend in (None, "auto") and forced) else backend)


def dot_product_attention(query_layer, key_layer, value_layer, *, qkv_format="sbhd",
                          attn_mask_type="causal", attention_mask=None, window_size=None,
                          softmax_scale=None, dropout_p=0.0, cu_seqlens_q=None,
                          cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                          backend="auto", return_lse=False, fp8=None):
    """Attention with TE's formats and masks -> out ([s,b,h*d] / [b,s,h*d] / [t,h*d]), or
    (out, lse) with return_lse (lse fp32 [b, h, s_q], or [h, t] for thd; not differentiable).
    fp8: an `attention.fp8.FP8AttnPlan` (what DotProductAttention passes under fp8_dpa)."""
    q, k, v, args = prepare(query_layer, key_layer, value_layer, qkv_format=qkv_format,
                            attn_mask_type=attn_mask_type, attention_mask=attention_mask,
                            window_size=window_size, softmax_scale=softmax_scale,
                            dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                            max_seqlen_kv=max_seqlen_kv)
    if fp8 is not None and fp8.calibrating:
        F.record_amaxes(fp8, q, k, v)
    if fp8 is not None and not fp8.calibrating:
        be = _choose_fp8_cached(q, k, v, args, _backend_name(backend))
        out, lse = F.apply(q, k, v, args, be, fp8, qkv_format)
    else:
        be = B.choose_cached(q, k, v, args, _backend_name(backend))
        out, lse = _apply_attention(q, k, v, args, be)
        if fp8 is not None and fp8.out_scales is not None:   # calibrating under fp8_mha
            F.record_out_amax(fp8, out)
    if not (fp8 is not None and fp8.fp8_output):   # fp8_mha's output comes formatted
        out = B.format_out(out, qkv_format)
    return (out, lse) if return_lse else out


_FP8_CACHE: dict = {}


def _choose_fp8_cached(q, k, v, args, backend):
    key = (backend, q.device, q.dtype, args.key(), torch.are_deterministic_algorithms_enabled(),
           _env.force_ref())
    hit = _FP8_CACHE.get(key)
    if hit is None:
        if len(_FP8_CACHE) > 4096:
            _FP8_CACHE.clear()
        hit = _FP8_CACHE[key] = F.choose(q, k, v, args, backend)[0]
    return hit


def attention_forward(q, k, v, args: B.AttnArgs, backend="auto"):
    """No-autograd forward on canonical tensors (from `prepare`) -> (out, lse fp32, state).
    out is [b, s_q, h, d_v] ("bshd") or [t, h, d_v] ("thd"); pass state to attention_backward."""
    be = B.choose_cached(q, k, v, args, _backend_name(backend))
    out, lse, aux = be.fwd(q, k, v, args)
    return out, lse, (be, aux)


def attention_backward(dout, q, k, v, out, lse, state, args: B.AttnArgs):
    """(dq, dk, dv) for dout of `out`; (out, lse) may be any pair for the same softmax rows,
    e.g. a context-parallel ring's merged ones."""
    be, aux = state
    return be.bwd(dout, q, k, v, out, lse, aux, args)


class Explanation:
    """Which backend would run a call and why each other one would not."""

    def __init__(self, backend: Optional[str], reasons: dict, args: Optional[B.AttnArgs],
                 error: Optional[str] = None):
        self.backend, self.reasons, self.args, self.error = backend, reasons, args, error

    def __str__(self) -> str:
        a = self.args
        head = (f"attention call: {a.fmt} b={a.batch} h={a.heads} h_kv={a.kv_heads} "
                f"s_q={a.sq} s_kv={a.sk} d=({a.d_qk}, {a.d_v}) mask={a.mask_type} "
                f"window=({a.left}, {a.right}) dropout={a.dropout}" if a else "attention call")
        lines = [head, f"backend: {self.backend or 'none'}"]
        lines += ["  " + B.reason_line(n, r) for n, r in self.reasons.items()]
        return "\n".join(lines)

    __repr__ = __str__


def explain(query_layer, key_layer, value_layer, backend="auto", fp8_dpa=False,
            **kwargs) -> Explanation:
    """Explanation of the backend choice for `dot_product_attention(q, k, v, **kwargs)`.
    print() it, or read .backend (None when nothing fits) and .reasons {name: reason}.
    fp8_dpa=True: the choice of an FP8 call (fp8_autocast with recipe fp8_dpa=True)."""
    kwargs.pop("return_lse", None)
    kwargs.pop("fp8", None)
    q, k, v, args = prepare(query_layer, key_layer, value_layer, **kwargs)
    if fp8_dpa:
        try:
            be, reasons = F.choose(q, k, v, args, _backend_name(backend))
            return Explanation(be.name, reasons, args)
        except RuntimeError as exc:
            reasons = {n: b.check(q, k, v, args) or "supported, but not the forced one"
                       for n, b in F.FP8_BACKENDS.items()}
            return Explanation(None, reasons, args, str(exc))
    try:
        be, reasons = B.choose(q, k, v, args, _backend_name(backend))
        return Explanation(be.name, reasons, args)
    except RuntimeError as exc:
        reasons = {n: B.BACKENDS[n].check(q, k, v, args) or "supported, but not the forced one"
                   for n in B._order(q)}
        return Explanation(None, reasons, args, str(exc))


class DotProductAttention(torch.nn.Module):
    """TE's DotProductAttention: softmax(scale * q k^T + mask) v per head, with GQA/MQA."""

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None,
                 softmax_scale: Optional[float] = None, layer_number: Optional[int] = None,
                 attention_type: str = "self", cp_group=None, cp_global_ranks=None,
                 cp_stream=None, cp_comm_type: str = "p2p", backend: str = "auto"):
        super().__init__()
        cls = "DotProductAttention"
        if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
            _fail(cls, f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
        dims = kv_channels if isinstance(kv_channels, (tuple, list)) else (kv_channels,) * 2
        if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
            _fail(cls, f"kv_channels must be a positive int or a pair (d_qk, d_v), "
                  f"got {kv_channels!r}")
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(groups, int) or groups < 1 or num_attention_heads % groups:
            _fail(cls, f"num_attention_heads={num_attention_heads} must be divisible by "
                  f"num_gqa_groups={num_gqa_groups!r}")
        if not 0.0 <= float(attention_dropout) < 1.0:
            _fail(cls, f"attention_dropout must be in [0, 1), got {attention_dropout}")
        if qkv_format not in _FORMATS:
            _fail(cls, f"qkv_format={qkv_format!r} is not one of {_FORMATS}")
        if attention_type not in ("self", "cross"):
            _fail(cls, f"attention_type={attention_type!r} must be 'self' or 'cross'")
        self.attn_mask_type = M.parse_mask_type(attn_mask_type)
        M.normalize_window(window_size, self.attn_mask_type)
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.kv_channels = tuple(dims)
        self.hidden_size_per_attention_head = dims[0]
        self.attention_dropout = float(attention_dropout)
        self.qkv_format, self.window_size = qkv_format, window_size
        self.softmax_scale = (1.0 / math.sqrt(dims[0]) if softmax_scale is None
                              else float(softmax_scale))
        self.layer_number, self.attention_type = layer_number, attention_type
        self.backend = B.resolve_name(backend)
        self.fp8_attn_state = None   # q/k/v delayed-scaling state under fp8_dpa (fp8.py)
        self.fp8_out_state = None    # the output's, under fp8_mha
        self.register_load_state_dict_pre_hook(_extra_state_pre_hook)
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        if cp_comm_type not in ("p2p", "all_gather"):
            _fail("DotProductAttention", f"cp_comm_type={cp_comm_type!r} must be 'p2p' or "
                  "'all_gather'")
        from .cp.layout import resolve_group
        size, rank, _ = resolve_group(cp_group, cp_global_ranks, "DotProductAttention")
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type
        self.cp_size, self.cp_rank = size, rank
        # attention/cp precision knobs (merge.py): fp32 merge/accumulation, and "auto" |
        # "exact" (fp32 partials) | "fast" (fused 16-bit blocks); plain attributes, set freely
        if not hasattr(self, "cp_mode"):
            self.cp_mode, self.cp_fp32_accumulation = "auto", True

    def _cp_size(self) -> int:
        return self.cp_size

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill=True, inference_params=None, **_unused):
        cls = "DotProductAttention.forward"
        if core_attention_bias_type != "no_bias" or core_attention_bias is not None:
            _fail(cls, f"core_attention_bias_type={core_attention_bias_type!r}: attention bias "
                  "is not supported (only 'no_bias')", NotImplementedError)
        if alibi_slopes is not None:
            _fail(cls, "alibi_slopes: ALiBi is not supported", NotImplementedError)
        if inference_params is not None:
            _fail(cls, "inference_params: KV caching is not supported", NotImplementedError)
        fmt = qkv_format or self.qkv_format
        for name, t, heads, dim in (("query_layer", query_layer, self.num_attention_heads,
                                     self.kv_channels[0]),
                                    ("key_layer", key_layer, self.num_gqa_groups,
                                     self.kv_channels[0]),
                                    ("value_layer", value_layer, self.num_gqa_groups,
                                     self.kv_channels[1])):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) != (heads,
                                                                                         dim):
                _fail(cls, f"{name} has shape {tuple(t.shape)}; its last two dims must be "
                      f"[heads, head_dim] = [{heads}, {dim}] (num_attention_heads / "
                      "num_gqa_groups, kv_channels)")
        fp8 = None
        if F.active():  # refusals first: nothing is recorded or created before them
            dropout = self.attention_dropout if self.training else 0.0
            if self._cp_size() > 1:
                _fail(cls, "FP8 attention (recipe fp8_dpa=True) is not supported with context "
                      "parallelism (cp_group of more than one rank); leave fp8_dpa off in the "
                      "recipe of this module's fp8_autocast", NotImplementedError)
            if dropout > 0:
                _fail(cls, f"attention_dropout={dropout} is not supported with FP8 attention "
                      "(recipe fp8_dpa=True); set attention_dropout=0.0 (or call eval()) or "
                      "leave fp8_dpa off", NotImplementedError)
            if isinstance(query_layer, torch.Tensor):
                fp8 = F.plan_for(self, query_layer.device)
        if self._cp_size() > 1:
            from .cp import context_parallel_attention
            return context_parallel_attention(
                query_layer, key_layer, value_layer, self.cp_group, self.cp_global_ranks,
                cp_comm_type=self.cp_comm_type, qkv_format=fmt,
                attn_mask_type=attn_mask_type or self.attn_mask_type,
                attention_mask=attention_mask,
                window_size=self.window_size if window_size is None else window_size,
                softmax_scale=self.softmax_scale,
                dropout_p=self.attention_dropout if self.training else 0.0,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, backend=self.backend,
                mode=self.cp_mode, fp32_accumulation=self.cp_fp32_accumulation)
        return dot_product_attention(
            query_layer, key_layer, value_layer, qkv_format=fmt,
            attn_mask_type=attn_mask_type or self.attn_mask_type, attention_mask=attention_mask,
            window_size=self.window_size if window_size is None else window_size,
            softmax_scale=self.softmax_scale,
            dropout_p=self.attention_dropout if self.training else 0.0,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv, backend=self.backend, fp8=fp8)

    def get_extra_state(self):
        return F.extra_state(self)

    def set_extra_state(self, state) -> None:
        F.load_extra_state(self, state, "DotProductAttention")

    def extra_repr(self) -> str:
        return (f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, "
                f"kv_channels={self.kv_channels}, qkv_format={self.qkv_format}, "
                f"attn_mask_type={self.attn_mask_type}, window_size={self.window_size}, "
                f"dropout={self.attention_dropout}, backend={self.backend}")


def _extra_state_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs) -> None:
    """A missing `_extra_state` (a checkpoint from before it was saved) reads as None; a present
    one is checked here, where the module's name is known, before anything loads into it."""
    if prefix + "_extra_state" not in state_dict:
        state_dict[prefix + "_extra_state"] = None
    F.check_saved_entry(state_dict, prefix)


__all__ = ["DotProductAttention", "dot_product_attention", "attention_forward",
           "attention_backward", "prepare", "explain", "Explanation", "env_backend"]
