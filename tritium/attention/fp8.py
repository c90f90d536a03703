"""FP8 attention (TE's `fp8_dpa`, `fp8_mha`): E4M3 Q, K, V and P in the forward, a 16-bit
backward; under fp8_mha an E4M3 output for the output projection (`FP8Attention`).

Inside `fp8_autocast(recipe=DelayedScaling(fp8_dpa=True))` (or Float8CurrentScaling) a
DotProductAttention call quantizes q, k, v to E4M3 with one scale per tensor:
  * delayed scaling: the module owns a `ScalingState` of 3 slots (q, k, v) - one more set of
    slots beside its GEMMs' - whose scales come from the amax history; each call max-records
    its amaxes in row 0 and the state updates when the outermost autocast exits, like every
    module's forward state (registered with the region without claiming its backward update);
    under `tritium.distributed.checkpoint` the recompute reads the forward's frozen scales and
    records nothing (fp8/recompute.py);
  * current scaling: the scale of this call's amax (recipe's amax_epsilon / power_2_scale).
The forward then runs on the E4M3 tensors (`FP8_BACKENDS`): "triton_fp8", the Triton flash
kernel's FP8 forward (kernels/flash_attention.py), wherever the bf16 Triton backend could run
the call and the head dim is 64 or 128; "torch_fp8", the emulation in ref/attention.py
(exact row max, dense masks, thd through padding), everywhere else. P is quantized with the
fixed scale 448 (ref/attention.py says why). out is in the input dtype, lse fp32.

Backward: in the input dtype from the dequantized q, k, v (x8 * descale rounded to the input
dtype: the values the forward used, to that rounding), the forward's out and lse, through the
bf16 flash backward (triton_fp8) or the reference backward (torch_fp8). TE's FP8 backward also
quantizes dO and dS; this one does not (accuracy first; the speed target is the forward). The
gradient reaching the unquantized q, k, v is the one at the quantized point (straight through).
Calibration (`fp8_autocast(enabled=False, calibrating=True)`) records the amaxes under delayed
scaling (the output's too under fp8_mha) and runs the 16-bit attention. Under torch.compile
triton_fp8 runs through the custom ops of ops/attention.py (no band there: windows take the
emulation). Not here: FP8 attention with dropout, context parallelism.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fp8 import cast, recompute
from ..fp8.autocast import current as current_autocast
from ..fp8.formats import E4M3
from ..fp8.recipe import DelayedScaling, Float8CurrentScaling, recipe_from_dict
from ..fp8.scaling import ScalingState
from ..fp8.tensor import Float8Tensor
from ..functional.fused_cast import carrier_outputs, from_carrier
from ..ref import attention as ref_attention
from . import backends as B
from . import masks as M


class FP8AttnPlan:
    """One call's FP8 settings: the recipe, where the q/k/v scales come from, and under
    fp8_mha (`fp8_output`) where the output's scale comes from (`out_scales`: the O state or
    its frozen copy; None under current scaling)."""
    __slots__ = ("recipe", "scales", "calibrating", "fp8_output", "out_scales")

    def __init__(self, recipe, scales, calibrating: bool, fp8_output: bool = False,
                 out_scales=None):
        self.recipe, self.scales, self.calibrating = recipe, scales, calibrating
        self.fp8_output, self.out_scales = fp8_output, out_scales


def active() -> bool:
    """Is FP8 attention on here (an fp8_autocast, enabled or calibrating, with fp8_dpa=True or
    fp8_mha=True: TE runs FP8 attention under either)?"""
    state = current_autocast()
    return (state is not None and (state.enabled or state.calibrating)
            and (bool(getattr(state.recipe, "fp8_dpa", False))
                 or bool(getattr(state.recipe, "fp8_mha", False))))


def plan_for(owner: torch.nn.Module, device: torch.device) -> Optional[FP8AttnPlan]:
    """The FP8 plan of `owner`'s call now (None: no fp8_autocast with fp8_dpa=True). Makes or
    resizes the owner's delayed-scaling state and registers it with the autocast region."""
    if not active():
        return None
    state = current_autocast()
    recipe = state.recipe
    # fp8_mha: the output in FP8 too (not while calibrating: 16-bit attention)
    fp8_output = bool(recipe.fp8_mha) and state.enabled
    if isinstance(recipe, Float8CurrentScaling):
        return None if not state.enabled else FP8AttnPlan(recipe, None, False, fp8_output)
    assert isinstance(recipe, DelayedScaling)  # the recipes refuse fp8_dpa elsewhere
    scope = recompute.current()
    scales = _live_state(owner, "fp8_attn_state", SLOTS, recipe, device, state, scope)
    out_scales = None
    if recipe.fp8_mha:   # calibration records the output's amax too
        out_scales = _live_state(owner, "fp8_out_state", 1, recipe, device, state, scope)
    return FP8AttnPlan(recipe, scales, not state.enabled, fp8_output, out_scales)


def _live_state(owner, attr: str, slots: int, recipe: DelayedScaling, device, state, scope):
    """owner's state `attr` made, moved or resized for this call and registered with the
    autocast region -> the scales the call reads (frozen ones in a recompute)."""
    st = getattr(owner, attr, None)
    if st is None:
        st = _new(owner, attr, slots, recipe, device)
    elif st.scale.device != device:   # e.g. loaded on the CPU: keep its values
        moved = ScalingState(slots, E4M3, st.recipe, device)
        moved.amax_history.copy_(st.amax_history)
        moved.scale.copy_(st.scale)
        st = moved
        setattr(owner, attr, st)
    if st.amax_history.shape[0] != recipe.amax_history_len:
        st.resize_history(recipe.amax_history_len)
    st.recipe = recipe
    if scope is None or not scope.recomputing:
        state.region.register_forward(st, recipe, state.group)
    return st if scope is None else scope.forward_scales(st)


SLOTS = 3   # q, k, v; the output's scale (fp8_mha) is a state of its own, `fp8_out_state`


def _new(owner, attr: str, slots: int, recipe: DelayedScaling, device) -> ScalingState:
    st = ScalingState(slots, E4M3, recipe, device)
    setattr(owner, attr, st)
    return st


def new_state(owner: torch.nn.Module, recipe: DelayedScaling, device) -> ScalingState:
    """A fresh q/k/v state for owner."""
    return _new(owner, "fp8_attn_state", SLOTS, recipe, device)


def prepare(owner: torch.nn.Module, recipe, device) -> None:
    """The states owner's first FP8 attention call under `recipe` would make, made now where
    missing (before torch.compile, or as the template a distributed checkpoint loads into)."""
    if not isinstance(recipe, DelayedScaling) or not (recipe.fp8_dpa or recipe.fp8_mha):
        return
    if getattr(owner, "fp8_attn_state", None) is None:
        new_state(owner, recipe, device)
    if recipe.fp8_mha and getattr(owner, "fp8_out_state", None) is None:
        _new(owner, "fp8_out_state", 1, recipe, device)


def extra_state(owner: torch.nn.Module) -> Optional[dict]:
    """owner's FP8 attention state as tensors and plain values (None: it has none); the
    output's state (fp8_mha) under `o_scale` / `o_amax_history` where the module has one."""
    st = getattr(owner, "fp8_attn_state", None)
    if st is None:
        return None
    values = {"version": 1, "recipe": st.recipe.to_dict(),
              "qkv_scale": st.scale.detach().clone(),
              "qkv_amax_history": st.amax_history.detach().clone()}
    out_st = getattr(owner, "fp8_out_state", None)
    if out_st is not None:
        values["o_scale"] = out_st.scale.detach().clone()
        values["o_amax_history"] = out_st.amax_history.detach().clone()
    return values


def check_extra_state(values, where: str):
    """Validate a saved FP8 attention state -> (recipe, scale, amax_history), or None for
    None. Errors name `where` (the module) and the fix."""
    if values is None:
        return None
    fix = ("load the checkpoint into the module it was saved from (a DotProductAttention "
           "trained under DelayedScaling(fp8_dpa=True)), or drop this _extra_state entry to "
           "start the FP8 attention state fresh")
    if not isinstance(values, dict) or values.get("version") != 1 or "recipe" not in values:
        got = (f"version {values.get('version')!r}" if isinstance(values, dict)
               else type(values).__name__)
        raise ValueError(f"{where}: FP8 attention extra_state must be None or a dict with version "
                         f"1 and a recipe (as written by get_extra_state), got {got}; {fix}")
    try:
        recipe = recipe_from_dict(values["recipe"])
    except ValueError as exc:
        raise ValueError(f"{where}: FP8 attention extra_state recipe: {exc}; {fix}") from None
    if not isinstance(recipe, DelayedScaling):
        raise ValueError(f"{where}: FP8 attention extra_state holds a {type(recipe).__name__} "
                         f"recipe; only DelayedScaling keeps a state; {fix}")
    scale, hist = values.get("qkv_scale"), values.get("qkv_amax_history")
    if not (isinstance(scale, torch.Tensor) and isinstance(hist, torch.Tensor)):
        raise ValueError(f"{where}: FP8 attention extra_state lacks qkv_scale / "
                         f"qkv_amax_history tensors; {fix}")
    n = scale.shape[0] if scale.dim() == 1 else None
    if n != SLOTS or hist.dim() != 2 or hist.shape[1] != SLOTS:
        raise ValueError(f"{where}: FP8 attention extra_state has scale {tuple(scale.shape)} and "
                         f"amax_history {tuple(hist.shape)}: expected {SLOTS} slots (q, k, v); "
                         f"{fix}")
    if hist.shape[0] != recipe.amax_history_len:
        raise ValueError(f"{where}: FP8 attention extra_state amax_history has {hist.shape[0]} "
                         f"rows, its recipe's amax_history_len is {recipe.amax_history_len}; "
                         f"{fix}")
    if scale.dtype != torch.float32 or hist.dtype != torch.float32:
        raise ValueError(f"{where}: FP8 attention extra_state tensors must be float32, got "
                         f"{scale.dtype} and {hist.dtype}; {fix}")
    out = None
    if "o_scale" in values or "o_amax_history" in values:   # the output's state (fp8_mha)
        o_scale, o_hist = values.get("o_scale"), values.get("o_amax_history")
        if not (isinstance(o_scale, torch.Tensor) and isinstance(o_hist, torch.Tensor)
                and tuple(o_scale.shape) == (1,) and tuple(o_hist.shape) == (hist.shape[0], 1)
                and o_scale.dtype == torch.float32 and o_hist.dtype == torch.float32):
            raise ValueError(f"{where}: FP8 attention extra_state o_scale / o_amax_history must "
                             f"be float32 tensors of shapes (1,) and ({hist.shape[0]}, 1) (the "
                             f"output's state under fp8_mha), got {_shape(o_scale)} and "
                             f"{_shape(o_hist)}; {fix}")
        out = (o_scale, o_hist)
    return recipe, scale, hist, out


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def check_saved_entry(state_dict: dict, prefix: str) -> None:
    """Check the saved state of the DotProductAttention at `prefix` ("name.") in a state dict,
    if there is one (a load pre-hook: it runs before anything loads)."""
    key = prefix + "_extra_state"
    if key in state_dict:
        check_extra_state(state_dict[key], f"DotProductAttention {prefix[:-1] or '(root)'!r}")


def load_extra_state(owner: torch.nn.Module, values, where: str) -> None:
    """Set owner's FP8 attention state from `values` (validated first: a bad one changes
    nothing). In place when the shapes match (the state's tensors keep their addresses)."""
    staged = check_extra_state(values, where)
    if staged is None:
        owner.fp8_attn_state = owner.fp8_out_state = None
        return
    recipe, scale, hist, out = staged
    _load_state(owner, "fp8_attn_state", SLOTS, recipe, scale, hist)
    if out is None:
        owner.fp8_out_state = None
    else:
        _load_state(owner, "fp8_out_state", 1, recipe, *out)


def _load_state(owner, attr: str, slots: int, recipe, scale, hist) -> None:
    st = getattr(owner, attr, None)
    if st is None or st.amax_history.shape != hist.shape:
        device = scale.device if st is None else st.scale.device
        st = _new(owner, attr, slots, recipe, device)
    st.recipe = recipe
    with torch.no_grad():
        st.scale.copy_(scale)
        st.amax_history.copy_(hist)


def record_amaxes(plan: FP8AttnPlan, q, k, v) -> None:
    """Calibration: max-record the amaxes of q, k, v (delayed scaling) and nothing else."""
    with torch.no_grad():
        for i, x in enumerate((q, k, v)):
            slot = plan.scales.amax_slot(i)
            if slot is not None:
                cast.amax_into(x, slot)


def record_out_amax(plan: FP8AttnPlan, out: torch.Tensor) -> None:
    """Calibration under fp8_mha: max-record the (16-bit) attention output's amax."""
    slot = plan.out_scales.amax_slot(0)
    if slot is not None:
        with torch.no_grad():
            cast.amax_into(out, slot)


def _seq_rows(x: torch.Tensor):
    """x (bshd, thd, or the bshd view of sbhd memory) as a 2D view whose rows run over the
    tokens (bshd: [b * s, h * d]; thd: [t, h * d]; sbhd: [s, b * h * d]; no copy where x is one
    of these), the map of a result of that shape back to x's shape, and (4D) the map of its
    [cols, rows] transpose to a bshd-shaped, sequence-contiguous view (the FP8 kernel's V)."""
    if x.is_contiguous():
        shape = x.shape
        b, s, h, d = shape if x.dim() == 4 else (1, *shape)
        return (x.view(-1, h * d), lambda y: y.view(shape),
                lambda t: t.as_strided((b, s, h, d), (s, 1, d * b * s, b * s)))
    if x.dim() == 4 and x.transpose(0, 1).is_contiguous():
        b, s, h, d = x.shape
        return (x.transpose(0, 1).reshape(s, b * h * d),
                lambda y: y.view(s, b, h, d).transpose(0, 1),
                lambda t: t.as_strided((b, s, h, d), (h * d * s, 1, d * s, s)))
    return _seq_rows(x.contiguous())


def quantize(plan: FP8AttnPlan, q, k, v, v_keys_contiguous: bool = False):
    """-> (q8, k8, v8 E4M3 shaped like q, k, v (bshd), descale fp32 [3], v8 sequence-
    contiguous or None). One fused cast per tensor (the GEMMs' cast kernel, or its twin):
    delayed scaling reads the state's scale and max-records the amax; current scaling measures
    the amax first. v_keys_contiguous: V's cast also writes its transpose, which is V with the
    keys contiguous (the FP8 kernel's P @ V operand), in the same pass."""
    out, descale, v_t = [], [], None
    current = None
    if plan.scales is None:
        current = (float(plan.recipe.amax_epsilon), plan.recipe.power_2_scale)
    with torch.no_grad():
        for i, x in enumerate((q, k, v)):
            rows, back, back_t = _seq_rows(x)
            if current is None:
                scale, amax = plan.scales.scale_slot(i), plan.scales.amax_slot(i)
            else:
                scale = amax = None
            transpose = v_keys_contiguous and i == 2
            data, data_t, scale_inv = cast.quantize_2d(rows, E4M3, scale=scale, amax=amax,
                                                       current=current, pad_rows_to=1,
                                                       write_transpose=transpose)
            out.append(back(data))
            descale.append(scale_inv.reshape(1))
            if transpose:
                v_t = back_t(data_t)
    return (*out, torch.cat(descale), v_t)


def dequantize(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * descale).to(dtype)


class TritonFP8Backend:
    """The Triton flash kernel's FP8 forward; the bf16 Triton flash backward."""
    name = "triton_fp8"
    keys_contiguous_v = True   # its P @ V reads V with the keys contiguous (quantize's v8_t)

    def check(self, q, k, v, a) -> Optional[str]:
        why = B.TritonBackend.check_call(q, k, v, a)
        if why is not None:
            return "triton_fp8: " + why.split(": ", 1)[-1]
        if a.d_qk not in (64, 128):
            return f"triton_fp8: head dim {a.d_qk} unsupported (the FP8 kernel takes 64, 128)"
        if a.fmt == "thd":
            return "triton_fp8: packed sequences (thd) are not in the FP8 forward"
        if torch.compiler.is_compiling() and B.TritonBackend.mask(a)[1] is not None:
            return ("triton_fp8: under torch.compile no sliding window or bottom-right causal "
                    "(its custom ops take top-left causal or no mask)")
        return None

    def fwd(self, q8, k8, v8, descale, a, dtype, fp8_out=None):
        """-> (out or None, lse, out saved for backward[, out8 with fp8_out: the kernel's
        epilogue writes it]). Under torch.compile through the custom op (ops/attention.py)."""
        from ..kernels import flash_attention as FA
        causal, band = B.TritonBackend.mask(a)
        if torch.compiler.is_compiling():
            from ..ops import attention as ops
            o8 = fp8_out or (None, None, False, True)
            out, lse, out8 = ops.flash_attn_fp8_fwd(q8, k8, v8, descale, causal, a.scale, dtype,
                                                    *o8)
            out = out if o8[3] else None
            return (out, lse, out) if fp8_out is None else (out, lse, out, out8)
        if fp8_out is None:
            out, lse = FA.flash_attention_fp8_fwd(q8, k8, v8, descale, causal, a.scale,
                                                  out_dtype=dtype, band=band)
            return out, lse, out
        out, lse, out8 = FA.flash_attention_fp8_fwd(
            q8, k8, v8, descale, causal, a.scale, out_dtype=dtype, band=band,
            fp8_out=FA.FP8Out(*fp8_out))
        return out, lse, out, out8

    def bwd(self, dout, q, k, v, out, lse, a):
        if torch.compiler.is_compiling():
            from ..ops import attention as ops
            grads = ops.flash_attn_bwd(dout, q, k, v, out, lse, B.TritonBackend.mask(a)[0],
                                       a.scale, False)
            return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
        return B.BACKENDS["triton"].bwd(dout, q, k, v, out, lse, None, a)


class TorchFP8Backend:
    """The emulation (ref/attention.py): every mask and format; reference backward."""
    name = "torch_fp8"
    keys_contiguous_v = False

    def check(self, q, k, v, a) -> Optional[str]:
        return None

    def fwd(self, q8, k8, v8, descale, a, dtype, fp8_out=None):
        if a.fmt == "thd":
            pd = B._Padded(a, q8.shape[0], k8.shape[0])
            mask = B._dense_mask(a, q8.device, pd.q_pad, pd.kv_pad)
            out, lse = ref_attention.attention_fp8_fwd(pd.q(q8), pd.kv(k8), pd.kv(v8), descale,
                                                       mask, a.scale)
            out, lse = M.pack(out, pd.iq), pd.lse_out(lse)
        else:
            out, lse = ref_attention.attention_fp8_fwd(q8, k8, v8, descale,
                                                       B._dense_mask(a, q8.device), a.scale)
        if fp8_out is None:
            return out.to(dtype), lse, out
        scale, amax, seq_first, keep_hp = fp8_out
        out8 = ref_attention.quantize_out(out, scale, amax, seq_first)
        return (out.to(dtype) if keep_hp else None), lse, out, out8

    def bwd(self, dout, q, k, v, out, lse, a):
        return B.BACKENDS["torch"].bwd(dout, q, k, v, out, lse, (None, out), a)


FP8_BACKENDS = {b.name: b for b in (TritonFP8Backend(), TorchFP8Backend())}
_FORCED = {"triton": "triton_fp8", "torch": "torch_fp8"}


def choose(q, k, v, a: B.AttnArgs, backend: str = "auto"):
    """-> (FP8 backend, reasons {name: why not or 'selected ...'}); refuses what FP8 attention
    cannot do with an error naming the fix."""
    if a.dropout > 0:
        raise NotImplementedError(
            f"DotProductAttention: attention dropout {a.dropout} is not supported with "
            "fp8_dpa=True; set attention_dropout=0.0 (or call model.eval()) or leave fp8_dpa off")
    if backend != "auto" and backend not in _FORCED:
        raise ValueError(f"DotProductAttention: backend={backend!r} has no FP8 attention; use "
                         "'auto', 'triton' or 'torch' with fp8_dpa=True, or leave fp8_dpa off")
    names = tuple(FP8_BACKENDS) if backend == "auto" else (_FORCED[backend],)
    reasons, chosen = {}, None
    for name in names:
        why = FP8_BACKENDS[name].check(q, k, v, a)
        if why is None and chosen is None:
            chosen = FP8_BACKENDS[name]
            reasons[name] = ("selected: forced by backend=" if backend != "auto" else
                             "selected: first of " + ", ".join(names) + " that supports this call"
                             + (" (FP8 emulation in PyTorch)" if name == "torch_fp8" else ""))
        else:
            reasons[name] = why or "not tried: an earlier backend was selected"
    if chosen is None:
        raise RuntimeError("DotProductAttention: no FP8 attention backend supports this call:\n  "
                           + "\n  ".join(B.reason_line(n, r) for n, r in reasons.items()))
    return chosen, reasons


class FP8Attention(torch.autograd.Function):
    """forward: quantize, FP8 forward; backward: 16-bit, from the dequantized inputs.

    Under fp8_mha (plan.fp8_output) the output leaves as a Float8Tensor in the caller's
    format (`fmt`: [b, s, h * d], [s, b, h * d] or [t, h * d]; nominal dtype q's), which the
    output projection's Linear takes as its fp8 input without a cast. Delayed scaling: the
    kernel's epilogue writes it at the O state's scale and max-records its amax (one pass; the
    emulation quantizes the same fp32 out); current scaling: the 16-bit out is measured, then
    cast. The backward receives the 16-bit gradient of that output and reads the 16-bit out,
    written beside the E4M3 one whenever a backward follows (accuracy first: the E4M3 out feeds
    only the projection's GEMMs)."""

    @staticmethod
    def forward(ctx, q, k, v, args, backend, plan, fmt, keep_hp):
        q8, k8, v8, descale, v8_t = quantize(plan, q, k, v, backend.keys_contiguous_v)
        v_in = v8 if v8_t is None else v8_t
        ctx.args, ctx.backend, ctx.dtype = args, backend, q.dtype
        ctx.fmt = fmt if plan.fp8_output else None
        if not plan.fp8_output:
            out, lse, saved = backend.fwd(q8, k8, v_in, descale, args, q.dtype)
            ctx.save_for_backward(q8, k8, v8, descale, saved, lse)
            ctx.mark_non_differentiable(lse)
            return out, lse
        if plan.out_scales is not None:   # delayed: the scale is known, one fused pass
            scale = plan.out_scales.scale_slot(0)
            spec = (scale, plan.out_scales.amax_slot(0), fmt == "sbhd", keep_hp)
            out, lse, saved, out8 = backend.fwd(q8, k8, v_in, descale, args, q.dtype, spec)
            out8 = B.format_out(out8, fmt)
            scale_inv = torch.reciprocal(scale)
        else:                             # current: measure the 16-bit out, then cast it
            out, lse, saved = backend.fwd(q8, k8, v_in, descale, args, q.dtype)
            rows = B.format_out(out, fmt)
            data, _, scale_inv = cast.quantize_2d(
                rows.reshape(-1, rows.shape[-1]), E4M3, scale=None, amax=None, pad_rows_to=1,
                current=(float(plan.recipe.amax_epsilon), plan.recipe.power_2_scale))
            out8 = data.view(rows.shape)
        ctx.save_for_backward(q8, k8, v8, descale, saved if keep_hp else None, lse)
        ctx.mark_non_differentiable(lse)
        scale_inv = scale_inv.reshape(1)
        if torch.compiler.is_compiling():   # plain tensors out; `apply` makes the Float8Tensor
            data = out8.reshape(-1, out8.shape[-1])
            return (*carrier_outputs(ctx, out8.shape, q.dtype, data, None, scale_inv), lse)
        return Float8Tensor(out8, scale_inv, E4M3, q.dtype), lse

    @staticmethod
    def backward(ctx, dout, *_not_differentiable):
        q8, k8, v8, descale, out, lse = ctx.saved_tensors
        if ctx.fmt is not None:   # the gradient of the formatted FP8 output
            dout = B.unformat_grad(dout, ctx.fmt, out.shape)
        q, k, v = (dequantize(x, descale[i], ctx.dtype) for i, x in enumerate((q8, k8, v8)))
        dq, dk, dv = ctx.backend.bwd(dout, q, k, v, out, lse, ctx.args)
        return dq, dk, dv, None, None, None, None, None


def apply(q, k, v, args, backend, plan: FP8AttnPlan, fmt: str):
    """FP8Attention -> (out, lse): under fp8_mha out is the Float8Tensor (in `fmt`), also
    under torch.compile, where the Function returns a carrier and the fp8 pieces instead
    (functional/fused_cast.py) and the projection's Linear takes the carrier's gradient path.
    keep_hp: the 16-bit out is written beside the E4M3 one only where a backward may follow."""
    keep_hp = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    res = FP8Attention.apply(q, k, v, args, backend, plan, fmt, keep_hp)
    if len(res) == 2:
        return res
    return from_carrier(res[:4], E4M3, res[0].shape), res[4]


__all__ = ["FP8AttnPlan", "FP8Attention", "FP8_BACKENDS", "apply", "choose", "plan_for", "active",
           "quantize", "dequantize", "record_amaxes", "record_out_amax", "new_state", "prepare",
           "extra_state", "check_extra_state", "check_saved_entry", "load_extra_state"]
