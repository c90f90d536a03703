"""Attention backends and the per-call choice between them (with the reason, logged).

Every backend has the same three methods on canonical tensors (see `AttnArgs`):
  check(q, k, v, a) -> None if it can run this call, else the reason it cannot (one line);
  fwd(q, k, v, a)   -> (out, lse, aux): out like q but d_v wide, lse fp32 [b, h, s_q] ("bshd")
                       or [h, t_q] ("thd"), natural log, -inf on rows with no visible key;
                       aux is what backward needs besides (out, lse): dropout RNG state etc.;
  bwd(dout, q, k, v, out, lse, aux, a) -> (dq, dk, dv).
bwd accepts any (out, lse) of the same softmax rows, so a context-parallel ring can run fwd per
KV block, merge outs and lses in fp32, and call bwd per block with the merged pair.

  cudnn      torch.ops.aten._scaled_dot_product_cudnn_attention(+_backward): dense bshd, no/causal
             mask (square only), no window, no padding, head dims <= 128, fp16/bf16, sm80+;
             thd as one dense call per sequence (the reference takes what cuDNN refuses).
             GQA natively where this torch's op takes it (probed once per device), else K/V heads
             are repeated and their gradients summed. q/k/v go in as they lie (sbhd views,
             slices of a fused QKV) where the op takes strided operands (probed once per
             device), so neither they nor sbhd's output are copied.
  flash      torch.ops.aten._flash_attention_forward/_backward (FlashAttention-2 in torch): dense
             and varlen thd (cu_seqlens), GQA, sliding windows, bottom-right alignment (so
             top-left causal only where s_q == s_kv per sequence), fp16/bf16, d % 8 == 0, d <= 256.
  efficient  torch.ops.aten._scaled_dot_product_efficient_attention(+_backward): every mask as
             an additive bias (fp32 too); thd through padding; GQA by repeating K/V.
  triton     tritium's Triton flash attention (kernels/flash_attention.py) in its speed mode (P /
             dS rounded once to the input dtype, as cuDNN; out and grads in the input dtype):
             dense bshd, no mask, causal and sliding windows in either alignment (any s_q, s_kv;
             a window runs only the key blocks it reaches), GQA without repeating K/V, head
             dims 16-128, fp16/bf16, no dropout / padding masks; thd (packed, cu_seqlens; a
             bottom-right diagonal or window only where q / kv lengths match per sequence);
             CUDA (or CPU under TRITON_INTERPRET=1); eager only (torch.compile takes another
             backend).
  torch      `tritium.ref.attention`: explicit fp32 softmax, everything, any device.
"Auto" tries triton, cudnn, flash, efficient, torch on sm90/sm100 (flash, cudnn, efficient,
triton, torch elsewhere: cuDNN is not the faster one below sm90) and takes the first whose check
passes; each rejection reason is kept for `explain()` and for the error when nothing fits.
Auto takes triton only for the (compute capability major, head dim, mask) classes listed in
`MEASURED_FASTER`, where benchmarks/bench_flash_attention.py measured it faster (fwd+bwd) than
the backend auto takes otherwise (on sm90/sm100 it goes first; thd puts flash before cuDNN,
which runs one call per sequence); elsewhere explain() says it was not measured faster, and
backend="triton" forces it. The choice is cached per call signature, so a training step pays a
dict lookup, not the checks.

torch.compile: the checks are plain Python on shapes, dtypes and flags, so Dynamo traces them
(the choice is made once, at trace time, and guarded like any other Python branch); what they
need from the device and the torch build (compute capability, cuDNN version, which ATen ops
exist; the cuDNN probes) comes from `device_facts`, `cudnn_native_gqa` and `cudnn_strided`,
which Dynamo runs eagerly and treats as constants (`torch.compiler.assume_constant_result`).
Under compile the per-signature cache and the debug log are skipped (a dict write and a logger
call inside a traced region are graph breaks); `explain()` gives the same choice and reasons
outside the compiled region.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple, Optional

import torch

from .. import _device
from ..ref import attention as ref_attention
from . import masks as M

logger = logging.getLogger("tritium")
_INF = float("inf")
_HALF = (torch.float16, torch.bfloat16)


class AttnArgs:
    """One attention call, resolved: canonical format, sizes, mask semantics (masks.py)."""
    __slots__ = ("fmt", "batch", "heads", "kv_heads", "d_qk", "d_v", "sq", "sk", "causal",
                 "bottom_right", "left", "right", "scale", "dropout", "q_pad", "kv_pad", "mask",
                 "cu_q", "cu_kv", "same_lengths", "mask_type")

    def __init__(self, **kw):
        for name in self.__slots__:
            setattr(self, name, kw.get(name))

    @property
    def has_window(self) -> bool:
        return self.left >= 0 or (self.right >= 0 and not self.causal)

    def key(self):
        return (self.fmt, self.batch, self.heads, self.kv_heads, self.d_qk, self.d_v, self.sq,
                self.sk, self.causal, self.bottom_right, self.left, self.right, self.dropout,
                self.q_pad is not None, self.mask is not None, self.same_lengths)


class DeviceFacts(NamedTuple):
    """What the checks need from a device and this torch build (constant for a process)."""
    cc: Optional[tuple]         # CUDA compute capability, None off CUDA
    cudnn: bool                 # cuDNN available in this torch build
    cudnn_version: int
    flash: bool                 # aten._flash_attention_forward exists
    flash_window: bool          # ... and takes window_size_left/right
    efficient: bool             # aten._scaled_dot_product_efficient_attention exists


_FACTS: dict = {}


@torch.compiler.assume_constant_result
def device_facts(device: torch.device) -> DeviceFacts:
    """`DeviceFacts` of a device, computed once (Dynamo runs this eagerly, as a constant)."""
    hit = _FACTS.get(device)
    if hit is None:
        aten = torch.ops.aten
        cudnn = torch.backends.cudnn.is_available()
        hit = _FACTS[device] = DeviceFacts(
            cc=(tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda"
                else None),
            cudnn=cudnn, cudnn_version=(torch.backends.cudnn.version() or 0) if cudnn else 0,
            flash=hasattr(aten, "_flash_attention_forward"), flash_window=_flash_has_window(),
            efficient=hasattr(aten, "_scaled_dot_product_efficient_attention"))
    return hit


def _cuda_reason(q: torch.Tensor, name: str, dtypes, min_cc=(8, 0)) -> Optional[str]:
    if q.device.type != "cuda":
        return f"{name}: needs CUDA tensors (inputs are on {q.device.type})"
    if q.dtype not in dtypes:
        kinds = "/".join(str(d).replace("torch.", "") for d in dtypes)
        return f"{name}: {str(q.dtype).replace('torch.', '')} input, needs {kinds}"
    cc = device_facts(q.device).cc
    if cc < min_cc:
        return f"{name}: compute capability {cc[0]}.{cc[1]} < {min_cc[0]}.{min_cc[1]}"
    return None


def _dense_mask(a: AttnArgs, device, q_pad=None, kv_pad=None):
    return M.dense_mask(a.batch, a.sq, a.sk, device, causal=a.causal,
                        bottom_right=a.bottom_right, left=a.left, right=a.right,
                        q_pad=a.q_pad if q_pad is None else q_pad,
                        kv_pad=a.kv_pad if kv_pad is None else kv_pad, arbitrary=a.mask)


class _Padded:
    """thd -> padded bshd and back, for backends without a varlen kernel (exact: padding is
    masked out, padded rows are dropped)."""

    def __init__(self, a: AttnArgs, tq: int, tk: int):
        self.a = a
        self.iq = M.thd_index(a.cu_q, tq)
        self.ik = self.iq if (a.cu_kv is a.cu_q and tk == tq) else M.thd_index(a.cu_kv, tk)
        self.q_pad = M.padding_from_cu_seqlens(a.cu_q, a.batch, a.sq)
        self.kv_pad = M.padding_from_cu_seqlens(a.cu_kv, a.batch, a.sk)

    def q(self, x):
        return M.unpack(x, self.iq, self.a.batch, self.a.sq)

    def kv(self, x):
        return M.unpack(x, self.ik, self.a.batch, self.a.sk)

    def lse_in(self, lse):          # [h, t] -> [b, h, s_q]
        return M.unpack(lse.t(), self.iq, self.a.batch, self.a.sq).transpose(1, 2)

    def lse_out(self, lse):         # [b, h, s_q] -> [h, t]
        return M.pack(lse.transpose(1, 2), self.iq).t().contiguous()


class _Backend:
    name = "?"

    def saved_out(self, out, aux):
        """The out the autograd Function keeps for backward (the returned one by default)."""
        return out

    def auto_reason(self, q, a) -> Optional[str]:
        """Why "auto" should pass over a call this backend supports (None: it may take it)."""
        return None


class TorchBackend(_Backend):
    """The reference. Its autograd path keeps the fp32 out for backward's rowsum(dO * out), so
    16-bit gradients are rounded once; attention_backward uses whatever out it is given."""
    name = "torch"

    def check(self, q, k, v, a) -> Optional[str]:
        return None

    def saved_out(self, out, aux):
        return aux[1]

    def fwd(self, q, k, v, a):
        if a.fmt == "thd":
            pd = _Padded(a, q.shape[0], k.shape[0])
            mask = _dense_mask(a, q.device, pd.q_pad, pd.kv_pad)
            out, lse, keep = ref_attention.attention_fwd(pd.q(q), pd.kv(k), pd.kv(v), mask,
                                                         a.scale, a.dropout, out_dtype=None)
            out = M.pack(out, pd.iq)
            return out.to(q.dtype), pd.lse_out(lse), (keep, out)
        out, lse, keep = ref_attention.attention_fwd(q, k, v, _dense_mask(a, q.device), a.scale,
                                                     a.dropout, out_dtype=None)
        return out.to(q.dtype), lse, (keep, out)

    def bwd(self, dout, q, k, v, out, lse, aux, a):
        keep = aux[0]
        if a.fmt == "thd":
            pd = _Padded(a, q.shape[0], k.shape[0])
            mask = _dense_mask(a, q.device, pd.q_pad, pd.kv_pad)
            dq, dk, dv = ref_attention.attention_bwd(pd.q(dout), pd.q(q), pd.kv(k), pd.kv(v),
                                                     pd.q(out), pd.lse_in(lse), mask, a.scale,
                                                     a.dropout, keep)
            return M.pack(dq, pd.iq), M.pack(dk, pd.ik), M.pack(dv, pd.ik)
        return ref_attention.attention_bwd(dout, q, k, v, out, lse, _dense_mask(a, q.device),
                                           a.scale, a.dropout, keep)


@functools.lru_cache(maxsize=None)
def _flash_has_window() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return False
    return any(arg.name == "window_size_left" for arg in op.default._schema.arguments)


class FlashBackend(_Backend):
    name = "flash"

    def check(self, q, k, v, a) -> Optional[str]:
        reason = _cuda_reason(q, "flash", _HALF)
        if reason:
            return reason
        facts = device_facts(q.device)
        if not facts.flash:
            return "flash: this torch build has no aten._flash_attention_forward"
        if a.d_qk != a.d_v:
            return f"flash: head dims differ (d_qk {a.d_qk}, d_v {a.d_v})"
        if a.d_qk % 8 or a.d_qk > 256:
            return f"flash: head_dim {a.d_qk} unsupported (needs a multiple of 8, <= 256)"
        if a.mask is not None:
            return "flash: arbitrary mask tensors are not supported"
        if a.q_pad is not None:
            return ("flash: padding masks on bshd/sbhd are not supported (pass qkv_format='thd' "
                    "with cu_seqlens for flash varlen)")
        if (a.causal or a.has_window) and not a.bottom_right and not a.same_lengths:
            return ("flash: top-left causal/window with s_q != s_kv (flash aligns the diagonal "
                    "bottom-right)")
        if a.has_window and not facts.flash_window:
            return "flash: this torch's flash op takes no window_size"
        return None

    def _window(self, a):
        if a.has_window:
            return dict(window_size_left=a.left, window_size_right=0 if a.causal else a.right)
        return {}

    def fwd(self, q, k, v, a):
        op = torch.ops.aten._flash_attention_forward
        padded = False      # older torch: varlen lse [b, h, max_s_q], newer [h, t]
        if a.fmt == "thd":
            out, lse, rng, unused, _ = op(q, k, v, a.cu_q, a.cu_kv, a.sq, a.sk, a.dropout,
                                          a.causal, False, scale=a.scale, **self._window(a))
            if lse.dim() == 3:
                padded = True
                lse = M.pack(lse.transpose(1, 2), M.thd_index(a.cu_q, q.shape[0])).t()
        else:
            out, lse, rng, unused, _ = op(q, k, v, None, None, a.sq, a.sk, a.dropout, a.causal,
                                          False, scale=a.scale, **self._window(a))
        # rows with no visible key: flash writes +inf, the convention here is -inf
        lse = lse.masked_fill(lse == _INF, -_INF)
        return out, lse, (rng, unused, padded)

    def bwd(self, dout, q, k, v, out, lse, aux, a):
        rng, unused, padded = aux
        lse = lse.masked_fill(lse == -_INF, _INF)
        if padded:
            lse = M.unpack(lse.t(), M.thd_index(a.cu_q, q.shape[0]), a.batch, a.sq)
            lse = lse.transpose(1, 2)
        lse = lse.contiguous()
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        cu_q, cu_kv = (a.cu_q, a.cu_kv) if a.fmt == "thd" else (None, None)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_kv, a.sq, a.sk, a.dropout, a.causal, rng, unused,
            scale=a.scale, **self._window(a))
        return dq, dk, dv


def _bshd_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _cudnn_strided_ok(x: torch.Tensor) -> bool:
    """Can cuDNN read x as it lies (the ATen op passes its strides to the cuDNN graph)?
    Head dim contiguous, no broadcast (0-stride) dims, every other stride and the offset into
    its storage 16-byte aligned (storages are; the offset, unlike data_ptr(), is known under
    torch.compile too)."""
    size = x.element_size()
    return x.stride(-1) == 1 and x.storage_offset() * size % 16 == 0 and all(
        st * size % 16 == 0 and (st > 0 or n == 1) for st, n in zip(x.stride()[:-1], x.shape))


def _cudnn_operand(x: torch.Tensor, strided: bool) -> torch.Tensor:
    """x for the cuDNN op: as it lies where this torch's cuDNN path takes strided operands
    (sbhd views, q/k/v slices of a fused projection: no copy in, and the output comes back in
    q's memory order, so sbhd's [s, b, h*d] is a view too), else a contiguous bshd copy.
    Under torch.compile always the copy: Dynamo cannot trace storage_offset() inside an
    autograd.Function, and Inductor chooses the layouts there anyway."""
    if strided and not torch.compiler.is_compiling() and _cudnn_strided_ok(x):
        return x
    return _bshd_contiguous(x)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def _sum_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(3)


@torch.compiler.assume_constant_result
def cudnn_native_gqa(device: torch.device) -> bool:
    """`_cudnn_native_gqa` of a CUDA device (a constant for Dynamo, like `device_facts`)."""
    return _cudnn_native_gqa(device.index)


@functools.lru_cache(maxsize=None)
def _cudnn_native_gqa(device_index: int) -> bool:
    """Does this torch's cuDNN op take fewer K/V heads than Q heads (forward and backward)?
    Probed once per device on a tiny problem against the repeated-heads result."""
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, 4, 128, 64, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 128, 64, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, 2, 128, 64, device=dev, generator=g, dtype=torch.bfloat16)
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        r = op(q, k, v, None, True, 0.0, False, False, scale=0.125)
        rr = op(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, True, 0.0, False,
                False, scale=0.125)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            r[0], q, k, v, r[0], r[1], r[6], r[7], None, None, None, 128, 128, 0.0, False,
            scale=0.125)
        ok = (grads[1].shape == k.shape
              and torch.allclose(r[0].float(), rr[0].float(), atol=2e-2, rtol=2e-2))
    except Exception as exc:  # the op refuses GQA: repeat heads instead
        logger.debug("attention: cuDNN GQA probe failed (%s); K/V heads will be repeated", exc)
        return False
    return bool(ok)


@torch.compiler.assume_constant_result
def cudnn_strided(device: torch.device) -> bool:
    """`_cudnn_strided` of a CUDA device (a constant for Dynamo, like `device_facts`)."""
    return _cudnn_strided(device.index)


@functools.lru_cache(maxsize=None)
def _cudnn_strided(device_index: int) -> bool:
    """Does this torch's cuDNN op take q/k/v as strided views (sbhd memory, slices of one fused
    QKV tensor) and give the same forward and gradients as contiguous bshd copies? Probed once
    per device on a tiny problem; False keeps the copies."""
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator(device=dev).manual_seed(0)
        s, b, h, d = 128, 2, 4, 64
        fused = torch.randn(s, b, 3 * h * d, device=dev, generator=g, dtype=torch.bfloat16)
        dout = torch.randn(b, h, s, d, device=dev, generator=g, dtype=torch.bfloat16)
        qkv = [fused[..., i * h * d:(i + 1) * h * d].view(s, b, h, d).permute(1, 2, 0, 3)
               for i in range(3)]
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        results = []
        for q, k, v in (qkv, [x.contiguous() for x in qkv]):
            r = op(q, k, v, None, True, 0.0, True, False, scale=0.125)
            grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, r[0], r[1], r[6], r[7], None, None, None, s, s, 0.0, True,
                scale=0.125)
            results.append((r[0], *grads[:3]))
        ok = all(a.shape == c.shape and torch.allclose(a.float(), c.float(), atol=2e-2,
                                                       rtol=2e-2)
                 for a, c in zip(*results))
    except Exception as exc:  # the op refuses these strides: copy to contiguous bshd instead
        logger.debug("attention: cuDNN strided-operand probe failed (%s); q/k/v are copied", exc)
        return False
    return bool(ok)


class CudnnBackend(_Backend):
    name = "cudnn"

    def check(self, q, k, v, a) -> Optional[str]:
        reason = _cuda_reason(q, "cudnn", _HALF)
        if reason:
            return reason
        facts = device_facts(q.device)
        if not facts.cudnn:
            return "cudnn: cuDNN is not available in this torch build"
        if a.mask is not None:
            return "cudnn: arbitrary mask tensors are not supported"
        if a.q_pad is not None:
            return "cudnn: padding masks are not supported"
        if a.has_window:
            return f"cudnn: sliding window {(a.left, a.right)} is not supported"
        if a.causal and a.sq != a.sk and a.fmt != "thd":  # thd: per sequence (_per_sequence)
            return f"cudnn: causal with s_q {a.sq} != s_kv {a.sk} is not supported"
        if max(a.d_qk, a.d_v) > 128 or a.d_qk % 8 or a.d_v % 8:
            return (f"cudnn: head dims ({a.d_qk}, {a.d_v}) unsupported (multiples of 8, "
                    "<= 128)")
        if a.sk == 1 and a.fmt != "thd":
            return "cudnn: s_kv == 1 is not supported"
        if max(a.batch, a.heads) > 65535:
            return "cudnn: batch or heads > 65535"
        if a.dropout > 0:
            if a.dropout * 16 != math.floor(a.dropout * 16):
                return f"cudnn: dropout {a.dropout} is not a multiple of 1/16"
            ver = facts.cudnn_version
            if 91100 < ver < 91400:
                return f"cudnn: cuDNN {ver} has no SDPA dropout (9.11-9.13)"
        if torch.are_deterministic_algorithms_enabled():
            return "cudnn: not deterministic and torch.use_deterministic_algorithms is on"
        return None

    def _inputs(self, q, k, v, a):
        groups = a.heads // a.kv_heads
        if groups > 1 and cudnn_native_gqa(q.device):
            groups = 1
        strided = cudnn_strided(q.device)
        q, k, v = (_cudnn_operand(x, strided) for x in (q, k, v))
        return q, _repeat_kv(k, groups), _repeat_kv(v, groups), groups

    def fwd(self, q, k, v, a):
        if a.fmt == "thd":
            return self._thd_fwd(q, k, v, a)
        q, k, v, _ = self._inputs(q, k, v, a)
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, a.dropout,
            a.causal, False, scale=a.scale)
        out, lse = r[0].transpose(1, 2), r[1]
        return out, lse.reshape(a.batch, a.heads, a.sq), (r[6], r[7], lse.dim())

    def bwd(self, dout, q, k, v, out, lse, aux, a):
        if a.fmt == "thd":
            return self._thd_bwd(dout, q, k, v, out, lse, aux, a)
        seed, offset, lse_dim = aux
        q, k, v, groups = self._inputs(q, k, v, a)
        strided = cudnn_strided(q.device)  # the op lays dout out like out where they differ
        out, dout = _cudnn_operand(out, strided), _cudnn_operand(dout, strided)
        lse = lse.reshape((a.batch, a.heads, a.sq) + ((1,) if lse_dim == 4 else ())).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse, seed, offset, None, None, None, a.sq, a.sk, a.dropout,
            a.causal, scale=a.scale)
        return (dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), groups),
                _sum_groups(dv.transpose(1, 2), groups))


    # thd: cuDNN has no varlen entry in ATen, so each packed sequence is one dense [1, s, h, d]
    # call (exact: no padding exists), with the reference taking the sequences cuDNN refuses
    # (s_kv == 1, causal with s_q != s_kv). The lengths are read on the host: one sync per call.
    def _sequences(self, a):
        cq, ck = a.cu_q.tolist(), a.cu_kv.tolist()
        for i in range(a.batch):
            nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            sub = AttnArgs(**{n: getattr(a, n) for n in AttnArgs.__slots__})
            sub.fmt, sub.batch, sub.sq, sub.sk = "bshd", 1, nq, nk
            sub.q_pad = sub.kv_pad = sub.cu_q = sub.cu_kv = None
            yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), sub

    def _thd_fwd(self, q, k, v, a):
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = q.new_full((a.heads, q.shape[0]), -_INF, dtype=torch.float32)
        per_seq = []
        for qs, ks, sub in self._sequences(a):
            if sub.sq == 0 or sub.sk == 0:
                per_seq.append(None)
                continue
            one = (q[qs][None], k[ks][None], v[ks][None])
            backend = self if self.check(*one, sub) is None else BACKENDS["torch"]
            o, l, aux = backend.fwd(*one, sub)
            out[qs], lse[:, qs] = o[0], l[0]
            per_seq.append((backend, aux))
        return out, lse, per_seq

    def _thd_bwd(self, dout, q, k, v, out, lse, per_seq, a):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (qs, ks, sub), entry in zip(self._sequences(a), per_seq):
            if entry is None:
                continue
            backend, aux = entry
            o = backend.saved_out(out[qs][None], aux)
            g = backend.bwd(dout[qs][None], q[qs][None], k[ks][None], v[ks][None], o,
                            lse[:, qs][None], aux, sub)
            dq[qs], dk[ks], dv[ks] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


class EfficientBackend(_Backend):
    """Mem-efficient (CUTLASS) kernels; masks other than plain top-left causal become an additive
    bias (0 / dtype min; rows with no visible key are zeroed afterwards)."""
    name = "efficient"

    def check(self, q, k, v, a) -> Optional[str]:
        reason = _cuda_reason(q, "efficient", _HALF + (torch.float32,))
        if reason:
            return reason
        if not device_facts(q.device).efficient:
            return "efficient: this torch build has no mem-efficient attention op"
        align = 8 if q.dtype in _HALF else 4
        if a.d_qk % align or a.d_v % align:
            return f"efficient: head dims ({a.d_qk}, {a.d_v}) not multiples of {align}"
        return None

    def _plan(self, q, a, pd):
        plain_causal = (a.causal and not a.bottom_right and not a.has_window and a.mask is None
                        and a.q_pad is None and pd is None)
        if plain_causal or not (a.causal or a.has_window or a.mask is not None
                                or a.q_pad is not None or pd is not None):
            return plain_causal, None, None
        mask = _dense_mask(a, q.device, *((pd.q_pad, pd.kv_pad) if pd else (None, None)))
        mask = mask.expand(a.batch, a.heads, a.sq, a.sk)
        width = -(-a.sk // 16) * 16          # the kernel wants an aligned bias row stride
        bias = torch.zeros(a.batch, a.heads, a.sq, width, dtype=q.dtype, device=q.device)
        bias = bias[..., :a.sk]
        bias.masked_fill_(mask, torch.finfo(q.dtype).min)
        return False, bias, mask.all(-1)     # empty rows [b, h, s_q]

    def _dense(self, q, k, v, a, pd):
        groups = a.heads // a.kv_heads
        return q, _repeat_kv(k, groups), _repeat_kv(v, groups), groups

    def fwd(self, q, k, v, a):
        pd = _Padded(a, q.shape[0], k.shape[0]) if a.fmt == "thd" else None
        if pd:
            q, k, v = pd.q(q), pd.kv(k), pd.kv(v)
        causal, bias, empty = self._plan(q, a, pd)
        qd, kd, vd, _ = self._dense(q, k, v, a, pd)
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2), bias, True, a.dropout,
            causal, scale=a.scale)
        out, lse = out.transpose(1, 2), lse[..., :a.sq]
        if empty is not None:
            out = out.masked_fill(empty.transpose(1, 2)[..., None], 0.0)
            lse = lse.masked_fill(empty, -_INF)
        if pd:
            return M.pack(out, pd.iq), pd.lse_out(lse), (seed, offset)
        return out, lse.contiguous(), (seed, offset)

    def bwd(self, dout, q, k, v, out, lse, aux, a):
        seed, offset = aux
        pd = _Padded(a, q.shape[0], k.shape[0]) if a.fmt == "thd" else None
        if pd:
            q, k, v, dout, out, lse = (pd.q(q), pd.kv(k), pd.kv(v), pd.q(dout), pd.q(out),
                                       pd.lse_in(lse))
        causal, bias, empty = self._plan(q, a, pd)
        qd, kd, vd, groups = self._dense(q, k, v, a, pd)
        if empty is not None:
            dout = dout.masked_fill(empty.transpose(1, 2)[..., None], 0.0)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        lse = torch.nn.functional.pad(lse, (0, -(-a.sq // 32) * 32 - a.sq)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2), qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2),
            bias, out.transpose(1, 2), lse, seed, offset, a.dropout, [True, True, True, False],
            causal, scale=a.scale)
        dq = dq.transpose(1, 2)
        dk = _sum_groups(dk.transpose(1, 2), groups)
        dv = _sum_groups(dv.transpose(1, 2), groups)
        if pd:
            return M.pack(dq, pd.iq), M.pack(dk, pd.ik), M.pack(dv, pd.ik)
        return dq, dk, dv


# (compute capability major, head dim, mask class) where the triton backend measured faster,
# fwd+bwd, than the backend auto takes otherwise (benchmarks/bench_flash_attention.py). The mask
# classes: "causal" and "no_mask" (dense, against cuDNN at B4 H32 S4096 bf16, MHA and GQA-8: not
# faster yet, 0.83-0.86x on an H100), "window" (a band: sliding window or causal off the
# top-left corner; against flash, the only other backend that takes a window) and "thd" (packed
# sequences; against flash varlen), which run other paths of the kernel and are measured on their
# own (--window / --varlen). H100 80GB HBM3, 2026-11-28, 076d41a: window 4096 at B1 H32 KV8
# S16384 D128 7.74 ms vs flash 11.37 (1.47x); thd 16 sequences of 512..4096 tokens H32 KV8 D128
# causal 11.42 ms vs flash varlen 14.06 (1.23x; cuDNN one call per sequence 13.26).
MEASURED_FASTER: frozenset = frozenset({(9, 128, "window"), (9, 128, "thd")})


class TritonBackend(_Backend):
    """tritium's Triton flash attention, speed mode (see the module note)."""
    name = "triton"

    def check(self, q, k, v, a) -> Optional[str]:
        if torch.compiler.is_compiling():  # first: nothing below is traced
            return "triton: eager only (under torch.compile another backend runs)"
        return self.check_call(q, k, v, a)

    @staticmethod
    def check_call(q, k, v, a) -> Optional[str]:
        """What the kernel takes (device, dtype, masks), whether traced or not."""
        if not _device.use_triton(q):
            return ("triton: needs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1) and "
                    "an importable triton")
        if q.dtype not in _HALF:
            return f"triton: {str(q.dtype).replace('torch.', '')} input, needs float16/bfloat16"
        if a.fmt == "thd" and (a.causal or a.has_window) and a.bottom_right \
                and not a.same_lengths:
            return ("triton: thd with a bottom-right causal diagonal or window and q / kv "
                    "lengths that differ per sequence is not supported")
        if a.mask is not None or a.q_pad is not None:
            return ("triton: arbitrary and padding masks are not supported (packed sequences: "
                    "qkv_format='thd' with cu_seqlens)")
        if a.dropout > 0:
            return "triton: dropout is not supported"
        if a.d_qk != a.d_v or a.d_qk not in (16, 32, 64, 128):
            return f"triton: head dims ({a.d_qk}, {a.d_v}) unsupported (equal, 16/32/64/128)"
        from ..kernels import flash_attention as FA
        if torch.are_deterministic_algorithms_enabled() and not FA.deterministic(q, split=False):
            return ("triton: its dq sums by atomic adds here and "
                    "torch.use_deterministic_algorithms is on")
        return None

    def auto_reason(self, q, a) -> Optional[str]:
        cc = device_facts(q.device).cc
        kind = ("thd" if a.fmt == "thd" else "window" if self.mask(a)[1] is not None
                else "causal" if a.causal else "no_mask")
        key = (cc[0] if cc else None, a.d_qk, kind)
        if key in MEASURED_FASTER:
            return None
        return (f"triton: supported, but auto takes it only where measured faster than cuDNN "
                f"({key} is not in backends.MEASURED_FASTER); backend='triton' forces it")

    @staticmethod
    def mask(a) -> tuple:
        """(causal, band) for the kernel: a sliding window or a causal diagonal off the top-left
        corner becomes a band (lo, hi) on j - i (masks.py: diagonal offset o, window
        (o - left, o + right); causal is right = 0), which carries the causal edge itself;
        else plain top-left causal or no mask."""
        # thd: per sequence, where check() allows a band only with equal q / kv lengths
        o = a.sk - a.sq if a.bottom_right and a.fmt != "thd" else 0
        if not a.has_window and not (a.causal and o):
            return a.causal, None
        return False, (o - a.left if a.left >= 0 else None,
                       o + a.right if a.right >= 0 else None)

    def fwd(self, q, k, v, a):
        from ..kernels import flash_attention as FA
        causal, band = self.mask(a)
        out, lse = FA.flash_attention_fwd(q, k, v, causal, a.scale, split=False,
                                          out_dtype=q.dtype, band=band, varlen=self.varlen(a))
        return out, lse, None

    def bwd(self, dout, q, k, v, out, lse, aux, a):
        from ..kernels import flash_attention as FA
        causal, band = self.mask(a)
        return FA.flash_attention_bwd(dout, q, k, v, out, lse, causal, a.scale, split=False,
                                      grad_dtype=q.dtype, band=band, varlen=self.varlen(a))

    @staticmethod
    def varlen(a):
        """thd: (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) for the kernel."""
        return (a.cu_q, a.cu_kv, a.sq, a.sk) if a.fmt == "thd" else None


BACKENDS = {b.name: b for b in (TritonBackend(), CudnnBackend(), FlashBackend(),
                                EfficientBackend(), TorchBackend())}
ALIASES = {"math": "torch", "ref": "torch", "fused": "cudnn"}


def _order(q: torch.Tensor, fmt: Optional[str] = None) -> tuple[str, ...]:
    """On sm90/sm100: triton (taken only where `MEASURED_FASTER` lists the call's class), then
    cuDNN (fastest there, BASELINE.md), except for thd, where flash has a native varlen kernel and
    cuDNN runs one call per sequence (a host cost that grows with the number of sequences)."""
    cc = device_facts(q.device).cc
    if cc is not None and cc[0] in (9, 10):
        if fmt == "thd":
            return ("triton", "flash", "cudnn", "efficient", "torch")
        return ("triton", "cudnn", "flash", "efficient", "torch")
    return ("flash", "cudnn", "efficient", "triton", "torch")


def resolve_name(backend: Optional[str]) -> str:
    name = ALIASES.get(backend or "auto", backend or "auto")
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use 'auto' or one of "
                         f"{tuple(BACKENDS)} (aliases {tuple(ALIASES)})")
    return name


def choose(q, k, v, a: AttnArgs, backend: str = "auto"):
    """-> (backend object, reasons {name: why not or 'selected ...'}). Raises when none fits."""
    reasons: dict[str, str] = {}
    names = _order(q, a.fmt) if backend == "auto" else (backend,)
    chosen = None
    for name in names:
        why = BACKENDS[name].check(q, k, v, a)
        if why is None and backend == "auto":
            why = BACKENDS[name].auto_reason(q, a)
        if why is None and chosen is None:
            chosen = BACKENDS[name]
            reasons[name] = ("selected: first of " + ", ".join(names) + " that supports this call"
                             if backend == "auto" else "selected: forced by backend=")
        else:
            reasons[name] = why or "not tried: an earlier backend was selected"
    if backend != "auto":
        for name in _order(q, a.fmt):
            if name not in reasons:
                reasons[name] = "not tried: backend forced to " + backend
    if chosen is None:
        lines = "\n  ".join(reason_line(n, r) for n, r in reasons.items())
        raise RuntimeError(f"DotProductAttention: no attention backend supports this call:\n"
                           f"  {lines}")
    return chosen, reasons


def format_out(out: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """A backend's out ([b, s, h, d] bshd, [t, h, d] thd) in the caller's format: [b, s, h*d],
    [s, b, h*d] (a view where the memory is [s, b, h, d] already, else a copy), [t, h*d]."""
    h, d = out.shape[-2], out.shape[-1]
    if qkv_format == "sbhd":
        out = out.transpose(0, 1)
    return out.reshape(*out.shape[:-2], h * d)


def unformat_grad(dout: torch.Tensor, qkv_format: str, shape) -> torch.Tensor:
    """The inverse of `format_out` for a gradient: back to the backend's `shape`."""
    if qkv_format == "sbhd":
        b, s, h, d = shape
        return dout.reshape(s, b, h, d).transpose(0, 1)
    return dout.reshape(shape)


def reason_line(name: str, reason: str) -> str:
    return reason if reason.startswith(name + ":") else f"{name}: {reason}"


_CACHE: dict = {}


def choose_cached(q, k, v, a: AttnArgs, backend: str = "auto"):
    """The chosen backend object; eager calls look it up by call signature (and log a new
    choice at DEBUG level), compiled ones make it at trace time (see the module note)."""
    if torch.compiler.is_compiling():
        return choose(q, k, v, a, backend)[0]
    key = (backend, q.device, q.dtype, q.requires_grad, a.key(),
           torch.are_deterministic_algorithms_enabled())  # cudnn's check reads it
    hit = _CACHE.get(key)
    if hit is None:
        hit = choose(q, k, v, a, backend)
        if len(_CACHE) > 4096:
            _CACHE.clear()
        _CACHE[key] = hit
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("attention: %s backend (%s); %s", hit[0].name, a.mask_type,
                         "; ".join(reason_line(n, r) for n, r in hit[1].items()))
    return hit[0]


__all__ = ["AttnArgs", "BACKENDS", "DeviceFacts", "choose", "choose_cached", "device_facts",
           "format_out", "resolve_name", "unformat_grad"]
