"""make_graphed_callables: CUDA graphs of forward and backward that keep FP8 state right.

What. TE's `make_graphed_callables(modules, sample_args, ...)` for one callable or a tuple of
them. Each callable is warmed up on a side stream, then all forwards are captured in order and
all backwards in reverse order into one memory pool, and replayed through an autograd Function.
An nn.Module comes back as itself with its forward replaced (as in torch and TE); a plain
callable comes back as a new function. The structure follows torch.cuda.make_graphed_callables.

A graphed callable behaves like `with fp8_autocast(enabled, calibrating, recipe, group):
callable(...)` run eagerly, which is what it was captured under:
  * amaxes are recorded inside the graph (the casts write device memory);
  * at replay it registers its modules' scaling states with the active FP8 region (the user's
    outer fp8_autocast, or a region of its own when there is none, updated right after the
    replay as an outermost autocast would be), so forward scales update at the outer exit;
  * the backward scale update runs after the backward graph's replay when this callable holds
    the region's first FP8 module (eagerly that module's backward runs the update, and nothing
    after it in a sequential backward touches backward scales).
The capture runs under a region of its own whose updates are no-ops, so no scale update is
baked into a graph or run twice. Warm-up changes nothing the user sees: FP8 states, main_grad
buffers and the RNG state are restored after it.

FP8 weight caching (`fp8_weight_caching=True`): the callable's weight caches get one int32
device flag (`WeightCache.skip`); the captured weight casts write into the caches' persistent
buffers and return at once on the device while the flag is 1. `graphed(..., is_first_microbatch=)`
writes the flag before the replay (None or True: 0, False: 1). Without caching the keyword is
accepted and ignored (every replay casts the weights). Float8BlockScaling's weight cast is
flagged the same way; MXFP8BlockScaling (emulated) has no flagged cast and re-quantizes the
weights at every replay (the same bits: its scales are current and weights do not change
between the micro-batches of a step).

Grads. Param grads leave the backward graph as the autograd Function's outputs, so autograd's
AccumulateGrad adds them into `param.grad` exactly as an eager backward does; `param.grad` is
created (zeros) before capture where it is missing and the graph never holds it, so it can't
be replaced behind the graph's back. `fuse_wgrad_accumulation` adds into `param.main_grad`
inside the backward graph: main_grad must exist before the call and never be replaced (checked
at each replay).

Without CUDA (sample tensors on the CPU): an eager fallback, with one warning per call: the
callables run eagerly under the same fp8_autocast, with is_first_microbatch and weight caching
through the same device flag, so CPU code paths work unchanged.

FP8 params (modules built under fp8_model_init): their fp8 data feeds the GEMMs directly and
the optimizer rewrites it in place (data, scale_inv, transpose), so the graph reads the new
weights at every replay with no cast; their grads are plain tensors like any other.

TE's pipeline keywords (TE / Megatron's interleaved schedule; see `tritium/_graph_order.py`):
  * `_order`: the order of the forward (+c) and backward (-c) passes of model chunks c = 1..C
    over the microbatches, e.g. [1, 2, 1, 2, -2, -1, -2, -1] for 2 chunks x 2 microbatches.
    `modules` are all layers, chunk after chunk (`_num_layers_per_chunk`, default equal
    chunks); `sample_args` has one entry per (chunk, microbatch, layer), chunk-major. Each entry
    gets its own graphs, captured in `_order`'s order (a chunk's forward runs its layers in
    order, its backward in reverse), and the result is one replay function per entry (modules
    keep their own forward, as in TE).
  * `_reuse_graph_input_output_buffers` (with `_order` only, as TE): consecutive backward
    captures share one set of static grad-output buffers (all layers must produce outputs of
    one shape and dtype; checked), which the framework fills before each backward replay.
  * `pool`: the memory pool handle for every capture (default: a new one).
  * `capture_time_hooks`: per callable, None or a dict of "forward_pre_hooks", "forward_hooks",
    "backward_pre_hooks", "backward_hooks" (each {id: hook}, torch's module hook signatures).
    They run around each warm-up and capture of that callable, OUTSIDE the capture: never
    recorded, never replayed (for framework bookkeeping such as FSDP pre/post steps). A hook
    must return None.
  * `clone_param_grads_on_return` (also `_clone_param_grads_on_return`; default True, TE
    2.19): the backward replay hands autograd clones of the params' static grad buffers, so no
    tensor hook or later reader sees a buffer that the next replay overwrites. False returns
    the static buffers themselves (saves a copy; hooks then see the same tensor every replay).

Not done: non-tensor outputs; TE's `_num_layers_per_chunk` with uneven chunks is supported,
its input/output-buffer aliasing between consecutive layers (newer TE) is not.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from . import _graph_order
from .fp8.autocast import AutocastState, FP8Region, current as current_autocast, fp8_autocast
from .fp8.autocast import _is_process_group, _state as _autocast_stack
from .fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from .fp8.tensor import Float8Tensor
from .attention import fp8 as attn_fp8
from .attention.dot_product_attention import DotProductAttention
from .modules.base import FP8Module

_NEW_NAMES = {"enabled": "fp8_enabled", "calibrating": "fp8_calibrating",
              "recipe": "fp8_recipe", "amax_reduction_group": "fp8_group",
              "cache_quantized_params": "fp8_weight_caching"}
_GRAPHED = "_tritium_graphed"


@dataclasses.dataclass(frozen=True)
class _FP8Config:
    enabled: bool
    calibrating: bool
    recipe: Any
    group: Any
    weight_caching: bool

    @property
    def active(self) -> bool:
        return self.enabled or self.calibrating

    def autocast(self):
        return fp8_autocast(enabled=self.enabled, calibrating=self.calibrating,
                            fp8_recipe=self.recipe, fp8_group=self.group)


class _CaptureRegion(FP8Region):
    """The region the warm-up and the captures run in: it records who registers, in order,
    and its updates do nothing (they belong to the user's region at replay)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def register(self, fwd, bwd, recipe, group, again: bool = False) -> bool:
        first = super().register(fwd, bwd, recipe, group, again)
        if not any(c[0] is fwd and c[1] is bwd for c in self.calls):
            self.calls.append((fwd, bwd, recipe, group, False))
        return first

    def register_forward(self, fwd, recipe, group) -> None:
        """FP8 attention's forward-only states: replayed with register_forward."""
        super().register_forward(fwd, recipe, group)
        if not any(c[0] is fwd and c[4] for c in self.calls):
            self.calls.append((fwd, None, recipe, group, True))

    def forward_done(self) -> None:
        pass

    def backward_done(self) -> None:
        pass


class _captured_autocast:
    """Push an autocast state with a _CaptureRegion (never an outermost fp8_autocast: its exit
    would update scales) for the callable's warm-up and capture."""

    def __init__(self, cfg: _FP8Config):
        self.cfg, self.region = cfg, _CaptureRegion()

    def __enter__(self):
        cfg = self.cfg
        _autocast_stack.stack.append(AutocastState(
            cfg.enabled, cfg.calibrating, cfg.recipe or DelayedScaling(), cfg.group, self.region))
        return self.region

    def __exit__(self, *exc):
        _autocast_stack.stack.pop()


class _CudaOps:
    """The CUDA calls graphing makes, in one place (the cpu tests swap in an eager emulation
    to check the replay logic without a GPU)."""

    @staticmethod
    def wants_graph(device_types: set) -> bool:
        return device_types == {"cuda"}

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()

    @staticmethod
    def side_stream():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(side)

    @staticmethod
    def get_rng_state():
        return torch.get_rng_state(), torch.cuda.get_rng_state()

    @staticmethod
    def set_rng_state(state) -> None:
        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1])

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def new_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    @contextlib.contextmanager
    def capture(graph, pool):
        # No garbage collection while capturing: torch.cuda.graph collects once before the
        # capture begins, but a collection triggered inside it can run destructors of objects
        # unrelated to the capture whose CUDA calls invalidate it (seen in the gpu tier: which
        # test failed moved with the GC's timing, and disappeared with the GC off).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                yield
        finally:
            if was_enabled:
                gc.enable()


_cuda = _CudaOps()


# ------------------------------------------------------------------ arguments and checks
_GRAPH_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)


def _config(fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group, fp8_weight_caching,
            te_names: dict) -> _FP8Config:
    values = dict(fp8_enabled=fp8_enabled, fp8_calibrating=fp8_calibrating,
                  fp8_recipe=fp8_recipe, fp8_group=fp8_group,
                  fp8_weight_caching=fp8_weight_caching)
    defaults = dict(fp8_enabled=False, fp8_calibrating=False, fp8_recipe=None, fp8_group=None,
                    fp8_weight_caching=False)
    for new, value in te_names.items():
        if new not in _NEW_NAMES:
            raise TypeError(f"make_graphed_callables() got an unexpected keyword argument {new!r}")
        old = _NEW_NAMES[new]
        if values[old] is not defaults[old] and values[old] != value:
            raise TypeError(f"make_graphed_callables: {old}={values[old]!r} and {new}={value!r} "
                            "name the same setting; pass one of them")
        values[old] = value
    enabled, calibrating = bool(values["fp8_enabled"]), bool(values["fp8_calibrating"])
    recipe, group = values["fp8_recipe"], values["fp8_group"]
    caching = bool(values["fp8_weight_caching"])
    if not (enabled or calibrating):
        given = [k for k in ("fp8_recipe", "fp8_group") if values[k] is not None]
        given += ["fp8_weight_caching"] if caching else []
        if given:
            raise ValueError(f"make_graphed_callables: {', '.join(given)} given but FP8 is off; "
                             "pass fp8_enabled=True (or fp8_calibrating=True), or drop them")
    if recipe is None and (enabled or calibrating):
        recipe = DelayedScaling()
    if recipe is not None and not isinstance(recipe, _GRAPH_RECIPES):
        raise TypeError("make_graphed_callables: fp8_recipe must be recipe.DelayedScaling, "
                        "Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling, got "
                        f"{type(recipe).__name__}")
    if group is not None and not _is_process_group(group):
        raise TypeError("make_graphed_callables: fp8_group must be a torch.distributed "
                        f"ProcessGroup (or None for the default group), got {type(group).__name__}")
    if caching and not enabled:
        raise ValueError("make_graphed_callables: fp8_weight_caching=True caches FP8 weights and "
                         "needs fp8_enabled=True")
    return _FP8Config(enabled, calibrating, recipe, group, caching)


def _as_tuples(modules, sample_args, sample_kwargs):
    """(callables, per-callable args, per-callable kwargs, one?)"""
    one = not isinstance(modules, (tuple, list))
    if one:
        if isinstance(sample_args, torch.Tensor):
            sample_args = (sample_args,)
        if not isinstance(sample_args, (tuple, list)):
            raise TypeError("make_graphed_callables: sample_args must be a tuple of the "
                            f"callable's positional arguments, got {type(sample_args).__name__}")
        if sample_kwargs is not None and not isinstance(sample_kwargs, dict):
            raise TypeError("make_graphed_callables: sample_kwargs must be a dict for one "
                            f"callable, got {type(sample_kwargs).__name__}")
        return (modules,), (tuple(sample_args),), (dict(sample_kwargs or {}),), True
    modules = tuple(modules)
    if not modules:
        raise ValueError("make_graphed_callables: no callables given")
    if not isinstance(sample_args, (tuple, list)) or len(sample_args) != len(modules) or \
            not all(isinstance(a, (tuple, list)) for a in sample_args):
        raise TypeError(f"make_graphed_callables: {len(modules)} callables need sample_args as a "
                        f"tuple of {len(modules)} tuples (one per callable)")
    if sample_kwargs is None:
        sample_kwargs = ({},) * len(modules)
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != len(modules) or \
            not all(isinstance(k, dict) for k in sample_kwargs):
        raise TypeError(f"make_graphed_callables: sample_kwargs must be a tuple of "
                        f"{len(modules)} dicts (one per callable) or None")
    return modules, tuple(tuple(a) for a in sample_args), tuple(dict(k) for k in
                                                                 sample_kwargs), False


def _check_global_hooks() -> None:
    from torch.nn.modules import module as nn_module
    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    active = [n for n in names if getattr(nn_module, n, None)]
    if active:
        raise ValueError(f"make_graphed_callables: global module hooks are registered "
                         f"({', '.join(active)}); a graph would run them once, at capture. "
                         "Remove them first")


def _check_module(m: torch.nn.Module, where: str) -> None:
    if getattr(m, _GRAPHED, False):
        raise ValueError(f"{where} was already passed to make_graphed_callables: its forward is "
                         "a graph now; graph a fresh module")
    for name, sub in m.named_modules():
        hooks = [h for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                             "_backward_pre_hooks") if getattr(sub, h, None)]
        if hooks:
            raise ValueError(f"{where}: module {name or type(m).__name__!r} has hooks "
                             f"({', '.join(hooks)}); a graph would run them once, at capture. "
                             "Remove them first (hooks may be registered after graphing)")
        if sub.training != m.training:
            raise ValueError(f"{where}: modules in mixed train/eval mode ({name!r} is "
                             f"{'training' if sub.training else 'eval'}, the module is "
                             f"{'training' if m.training else 'eval'}); call .train() or "
                             ".eval() on the whole module first")
    for name, p in m.named_parameters():
        if p._backward_hooks:
            raise ValueError(f"{where}: parameter {name!r} has tensor hooks (register_hook); "
                             "a graph would run them once, at capture. Remove them first")
    for name, b in m.named_buffers():
        if b.requires_grad:
            raise ValueError(f"{where}: buffer {name!r} requires grad; only parameters may be "
                             "trainable in a graphed module")


def _flatten(args: tuple, kwargs: dict, where: str):
    """Leaves of (args, kwargs) and their structure. Positional leaves must be tensors; keyword
    leaves may also be constants (baked into the graph, checked equal at each replay)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    n_args = len(pytree.tree_leaves(args))
    for i, leaf in enumerate(leaves):
        if i < n_args and not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where}: sample_args may hold tensors only (nested in tuples, "
                            f"lists or dicts); positional leaf {i} is a {type(leaf).__name__}. "
                            "Pass constants in sample_kwargs or bake them into the callable")
        if isinstance(leaf, Float8Tensor):
            raise TypeError(f"{where}: Float8Tensor arguments are not supported")
    return leaves, spec


def _devices(callables, leaves_per) -> set:
    devs = set()
    for c, leaves in zip(callables, leaves_per):
        devs.update(t.device.type for t in leaves if isinstance(t, torch.Tensor))
        if isinstance(c, torch.nn.Module):
            devs.update(p.device.type for p in c.parameters())
    return devs


def _fp8_modules(c) -> list:
    return [m for m in c.modules() if isinstance(m, FP8Module)] if isinstance(
        c, torch.nn.Module) else []


def _attention_modules(c) -> list:
    """c's DotProductAttentions: their FP8 attention states (fp8_dpa / fp8_mha) are made
    before warm-up and restored after it, like the GEMM modules' states."""
    return [m for m in c.modules() if isinstance(m, DotProductAttention)] if isinstance(
        c, torch.nn.Module) else []


# ------------------------------------------------------------------ one captured callable
class _Callable:
    """Everything one graphed callable replays with (static buffers, graphs, FP8 bookkeeping)."""

    hooks: Optional[dict] = None     # capture_time_hooks of its callable
    clone_grads: bool = True         # clone_param_grads_on_return

    def __init__(self, func, args, kwargs, cfg: _FP8Config, index: int):
        self.func, self.cfg, self.index = func, cfg, index
        self.where = f"callable {index} ({type(func).__name__})"
        self.is_module = isinstance(func, torch.nn.Module)
        self.orig_forward = func.forward if self.is_module else func
        self.leaves, self.spec = _flatten(args, kwargs, self.where)
        self.tensor_pos = [i for i, t in enumerate(self.leaves) if isinstance(t, torch.Tensor)]
        self.inputs = [self.leaves[i] for i in self.tensor_pos]
        self.meta = [(t.shape, t.dtype, t.requires_grad, t.device.type) for t in self.inputs]
        self.params = tuple(func.parameters()) if self.is_module else ()
        self.surface = tuple(self.inputs) + self.params
        self.training = func.training if self.is_module else None
        self.fp8_modules = _fp8_modules(func)
        self.attention_modules = _attention_modules(func)
        self.flag: Optional[torch.Tensor] = None
        self.main_grads = [(p, p.main_grad) for p in self.params
                           if getattr(p, "main_grad", None) is not None]
        self.registrations: list[tuple] = []
        self.metas: list[tuple] = []
        self.keep: list = []

    def call(self, leaves=None):
        args, kwargs = pytree.tree_unflatten(self.leaves if leaves is None else leaves, self.spec)
        return self.func(*args, **kwargs)

    def run_hooks(self, kind: str, *args) -> None:
        """capture_time_hooks of `kind` (outside any capture); each must return None."""
        for key, hook in (self.hooks or {}).get(kind, {}).items():
            if hook(self.func, *args) is not None:
                raise ValueError(f"capture_time_hooks: {kind}[{key!r}] of {self.where} returned a "
                                 "value; capture-time hooks may not replace arguments, outputs or "
                                 "grads (return None)")

    def set_flag(self, is_first_microbatch) -> None:
        if self.flag is not None:
            self.flag.fill_(0 if is_first_microbatch is None or is_first_microbatch else 1)

    def caches(self) -> list:
        return [c for m in self.fp8_modules for c in m._weight_caches]

    def install_flag(self) -> None:
        """One int32 device flag shared by every weight cache of this callable's modules."""
        caches = self.caches()
        if not caches:
            return
        if any(c.skip is not None for c in caches):
            raise ValueError(f"{self.where}: a module in it is already graphed with "
                             "fp8_weight_caching; graph each module once")
        device = self.params[0].device if self.params else self.inputs[0].device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        for c in caches:
            c.skip = self.flag

    # -- what warm-up may change and must give back
    def snapshot(self) -> list:
        saved = []
        states = [s for m in self.fp8_modules for s in (m.fp8_meta.fwd, m.fp8_meta.bwd)]
        states += [s for m in self.attention_modules for s in (m.fp8_attn_state, m.fp8_out_state)]
        for state in states:
            if state is not None:
                saved += [(state.scale, state.scale.clone()),
                          (state.amax_history, state.amax_history.clone())]
        saved += [(g, g.clone()) for _, g in self.main_grads]
        return saved


def _restore(saved: list) -> None:
    with torch.no_grad():
        for dst, src in saved:
            dst.copy_(src)


class _Graphed(torch.autograd.Function):
    """Replays one callable's forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, cap: _Callable, bwd_region, *inputs):
        for static, given in zip(cap.inputs, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        cap.fwd_graph.replay()
        ctx.cap, ctx.bwd_region = cap, bwd_region
        outs = tuple(o.detach() for o in cap.outputs)
        ctx.mark_non_differentiable(*(o for o, g in zip(outs, cap.grad_outputs) if g is None))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        cap = ctx.cap
        for static, g in zip(cap.grad_outputs, grads):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
        cap.bwd_graph.replay()
        if ctx.bwd_region is not None:
            ctx.bwd_region.backward_done()
        # The static grads themselves, never a detached alias: autograd may take a returned
        # tensor it holds the only reference to as `param.grad` (AccumulateGrad "steals" it),
        # and the next replay would overwrite that .grad. `cap.grad_refs` holds a second
        # reference, so autograd always adds (or copies) instead. clone_param_grads_on_return
        # hands out clones of the params' grads (tensor hooks never see a static buffer).
        if cap.clone_grads:
            n = len(cap.inputs)
            return (None, None) + cap.grad_inputs[:n] + tuple(
                None if g is None else g.clone() for g in cap.grad_inputs[n:])
        return (None, None) + cap.grad_inputs


def _replay(cap: _Callable, args, kwargs, is_first_microbatch):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != cap.spec:
        raise TypeError(f"graphed {cap.where}: called with arguments shaped {spec}, captured "
                        f"with {cap.spec} (pass the same positional/keyword arguments as "
                        "sample_args/sample_kwargs; is_first_microbatch only as a keyword)")
    inputs = [leaves[i] for i in cap.tensor_pos]
    for i, (t, (shape, dtype, req, dev)) in enumerate(zip(inputs, cap.meta)):
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or \
                t.requires_grad != req or t.device.type != dev:
            got = (f"{t.dtype}{tuple(t.shape)} requires_grad={t.requires_grad} on {t.device}"
                   if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"graphed {cap.where}: tensor argument {i} is {got}; the graph was "
                             f"captured for {dtype}{tuple(shape)} requires_grad={req} on {dev}")
    for i, leaf in enumerate(leaves):
        if not isinstance(cap.leaves[i], torch.Tensor) and (
                isinstance(leaf, torch.Tensor) or leaf != cap.leaves[i]):
            raise ValueError(f"graphed {cap.where}: argument {i} is {leaf!r} but was captured "
                             f"as {cap.leaves[i]!r}; constants are baked into the graph")
    for p, g in cap.main_grads:
        if p.main_grad is not g:
            raise RuntimeError(f"graphed {cap.where}: a param's main_grad was replaced after "
                               "capture; the backward graph keeps adding into the old one. "
                               "Zero main_grad in place (main_grad.zero_()) instead")
    for m, fwd, bwd in cap.metas:
        if m.fp8_meta.fwd is not fwd or m.fp8_meta.bwd is not bwd:
            raise RuntimeError(f"graphed {cap.where}: the FP8 state of a {type(m).__name__} was "
                               "replaced after capture (a recipe with another format or "
                               "history length?); the graph still uses the old one: re-capture")
    cap.set_flag(is_first_microbatch)
    region, own, bwd_region = None, False, None
    if cap.registrations:
        outer = current_autocast()
        region, own = (FP8Region(), True) if outer is None else (outer.region, False)
        firsts = []   # did the modules' registrations make this the region's first?
        for fwd, bwd, rec, group, forward_only in cap.registrations:
            if forward_only:
                region.register_forward(fwd, rec, group)
            else:
                firsts.append(region.register(fwd, bwd, rec, group))
        bwd_region = region if firsts and firsts[0] else None
    out = _Graphed.apply(cap, bwd_region, *inputs, *cap.params)
    if own and torch.is_grad_enabled():
        region.forward_done()
    return pytree.tree_unflatten(list(out), cap.out_spec)


def _eager(cap: _Callable, forward, args, kwargs, is_first_microbatch):
    """What the graph replays, run eagerly (the CPU fallback; a module in the other mode)."""
    cap.set_flag(is_first_microbatch)
    with cap.cfg.autocast():
        return forward(*args, **kwargs)


def _wrap(cap: _Callable, graphed: bool, replace_forward: bool = True):
    """The callable handed back: a function, or the module with its forward replaced (a module
    in the other train/eval mode than captured runs its own forward, eagerly). With `_order`
    a module has several graphs: each comes back as a function and the module keeps its
    forward."""
    orig = cap.orig_forward

    def call(*args, is_first_microbatch=None, **kwargs):
        if graphed and (not cap.is_module or cap.func.training == cap.training):
            return _replay(cap, args, kwargs, is_first_microbatch)
        return _eager(cap, orig, args, kwargs, is_first_microbatch)
    if not cap.is_module or not replace_forward:
        return call
    cap.func.forward = call
    setattr(cap.func, _GRAPHED, True)
    return cap.func


# ------------------------------------------------------------------ warm-up and capture
def _warmup(caps, num_warmup_iters: int, allow_unused_input: bool) -> None:
    for cap in caps:
        for _ in range(num_warmup_iters):
            cap.set_flag(True)
            args = pytree.tree_unflatten(cap.leaves, cap.spec)[0]
            cap.run_hooks("forward_pre_hooks", args)
            with _captured_autocast(cap.cfg):
                out = cap.call()
            cap.run_hooks("forward_hooks", args, out)
            outs = pytree.tree_leaves(out)
            for i, o in enumerate(outs):
                if not isinstance(o, torch.Tensor):
                    raise TypeError(f"make_graphed_callables: {cap.where} returned a "
                                    f"{type(o).__name__} (output leaf {i}); graphed callables "
                                    "must return tensors (nested in tuples/lists/dicts)")
            need = [o for o in outs if o.requires_grad]
            wrt = [t for t in cap.surface if t.requires_grad]
            if not need or not wrt:
                del out
                continue
            grad_out = tuple(torch.ones_like(o) for o in need)
            cap.run_hooks("backward_pre_hooks", grad_out)
            grads = torch.autograd.grad(need, wrt, grad_out, allow_unused=True)
            cap.run_hooks("backward_hooks", tuple(grads[:len(cap.inputs)]), grad_out)
            _check_unused(cap, wrt, grads, allow_unused_input)
            cap.has_grad = {id(t) for t, g in zip(wrt, grads) if g is not None}
            del outs, need, grads


def _check_unused(cap, wrt, grads, allow_unused_input) -> None:
    if allow_unused_input:
        return
    names = {id(p): n for n, p in cap.func.named_parameters()} if cap.is_module else {}
    for t, g in zip(wrt, grads):
        if g is not None or getattr(t, "main_grad", None) is not None:
            continue  # main_grad params get their gradient inside the backward
        what = f"parameter {names[id(t)]!r}" if id(t) in names else "a sample argument"
        raise ValueError(f"make_graphed_callables: {what} of {cap.where} requires grad but the "
                         "outputs do not depend on it; pass allow_unused_input=True or set "
                         "requires_grad=False")


def _capture(caps, pool, retain_graph: bool, sequence=None, reuse_buffers: bool = False) -> None:
    """Capture every forward and backward into one pool, in `sequence` (("fwd" | "bwd", cap)
    steps; default: the forwards in order, then the backwards in reverse, as they replay)."""
    if sequence is None:
        sequence = [("fwd", c) for c in caps] + [("bwd", c) for c in reversed(caps)]
    shared = None
    for step, cap in sequence:
        if step == "fwd":
            _capture_forward(cap, pool)
        else:
            shared = _capture_backward(cap, pool, retain_graph, shared if reuse_buffers else None)


def _capture_forward(cap, pool) -> None:
    cap.fwd_graph = _cuda.new_graph()
    args = pytree.tree_unflatten(cap.leaves, cap.spec)[0]
    cap.run_hooks("forward_pre_hooks", args)
    with _captured_autocast(cap.cfg) as region:
        with _cuda.capture(cap.fwd_graph, pool):
            out = cap.call()
    cap.run_hooks("forward_hooks", args, out)
    cap.registrations = region.calls
    leaves, cap.out_spec = pytree.tree_flatten(out)
    cap.outputs = tuple(leaves)


def _capture_backward(cap, pool, retain_graph: bool, shared: Optional[tuple]) -> tuple:
    """Capture cap's backward; returns its static grad-output buffers (shared by the next
    capture with _reuse_graph_input_output_buffers, after a shape check)."""
    cap.bwd_graph = _cuda.new_graph()
    want = [(o.shape, o.dtype) if o.requires_grad else None for o in cap.outputs]
    if shared is not None:
        have = [None if g is None else (g.shape, g.dtype) for g in shared]
        if have != want:
            raise ValueError(f"make_graphed_callables(_reuse_graph_input_output_buffers=True): "
                             f"{cap.where} has outputs {want}, the previous backward {have}; "
                             "reuse needs every callable's outputs in one shape and dtype")
        cap.grad_outputs = shared
    else:
        cap.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                                 for o in cap.outputs)
    need = [o for o in cap.outputs if o.requires_grad]
    wrt = [t for t in cap.surface if t.requires_grad]
    grads = [None] * len(wrt)
    grad_out = tuple(g for g in cap.grad_outputs if g is not None)
    cap.run_hooks("backward_pre_hooks", grad_out)
    if need and wrt:
        with _cuda.capture(cap.bwd_graph, pool):
            grads = torch.autograd.grad(need, wrt, grad_out, allow_unused=True,
                                        retain_graph=retain_graph)
    it = iter(grads)
    cap.grad_inputs = tuple(next(it) if t.requires_grad else None for t in cap.surface)
    cap.grad_refs = [g for g in cap.grad_inputs if g is not None]
    cap.run_hooks("backward_hooks", cap.grad_inputs[:len(cap.inputs)], grad_out)
    return cap.grad_outputs


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, sample_kwargs=None,
                           fp8_enabled: bool = False, fp8_calibrating: bool = False,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching: bool = False,
                           _order=None, _num_layers_per_chunk=None, pool=None,
                           retain_graph_in_backward: bool = False,
                           _reuse_graph_input_output_buffers: bool = False,
                           clone_param_grads_on_return: Optional[bool] = None,
                           capture_time_hooks=None, **te_names):
    """CUDA-graph `modules` (one callable, or a tuple of them with a tuple of sample_args
    tuples) for training with FP8; see the module docstring for the contract."""
    clone = te_names.pop("_clone_param_grads_on_return", None)
    if clone is not None and clone_param_grads_on_return is not None and \
            bool(clone) != bool(clone_param_grads_on_return):
        raise TypeError("make_graphed_callables: clone_param_grads_on_return and "
                        "_clone_param_grads_on_return name the same setting; pass one of them")
    clone = True if clone is None and clone_param_grads_on_return is None else \
        bool(clone_param_grads_on_return if clone is None else clone)
    cfg = _config(fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group, fp8_weight_caching,
                  te_names)
    if _reuse_graph_input_output_buffers and _order is None:
        raise ValueError("make_graphed_callables(_reuse_graph_input_output_buffers=True) needs "
                         "_order (TE: buffer reuse follows the pipeline schedule)")
    if _num_layers_per_chunk is not None and _order is None:
        raise ValueError("make_graphed_callables: _num_layers_per_chunk needs _order")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError("make_graphed_callables: num_warmup_iters must be an int >= 1 (kernels "
                         f"must compile before capture), got {num_warmup_iters!r}")
    if _order is not None:
        if not isinstance(modules, (tuple, list)):
            modules = (modules,)
        layout = _graph_order.Layout(_order, _num_layers_per_chunk, len(modules))
        callables, args_per, kwargs_per, one = _as_tuples(
            layout.per_entry(tuple(modules)), sample_args, sample_kwargs)
        hooks = _graph_order.hooks_per_callable(capture_time_hooks, len(modules))
        hooks = layout.per_entry(tuple(hooks))
        modules_once = tuple(modules)
    else:
        callables, args_per, kwargs_per, one = _as_tuples(modules, sample_args, sample_kwargs)
        hooks = _graph_order.hooks_per_callable(capture_time_hooks, len(callables))
        modules_once, layout = callables, None
    _check_global_hooks()
    seen = set()
    for i, c in enumerate(modules_once):
        if not callable(c):
            raise TypeError(f"make_graphed_callables: callable {i} is a {type(c).__name__}")
        if id(c) in seen:
            raise ValueError(f"make_graphed_callables: callable {i} appears twice")
        seen.add(id(c))
        if isinstance(c, torch.nn.Module):
            _check_module(c, f"callable {i} ({type(c).__name__})")
    modes = {c.training for c in callables if isinstance(c, torch.nn.Module)}
    if len(modes) > 1:
        raise ValueError("make_graphed_callables: modules in mixed train/eval mode; put them all "
                         "in one mode first")
    for kw in kwargs_per:
        kw.pop("is_first_microbatch", None)  # a replay argument, handled by the device flag
    caps = [_Callable(c, a, k, cfg, i)
            for i, (c, a, k) in enumerate(zip(callables, args_per, kwargs_per))]
    for cap, h in zip(caps, hooks):
        cap.hooks, cap.clone_grads = h, clone
    devices = _devices(callables, [c.leaves for c in caps])
    if len(devices) > 1:
        raise ValueError(f"make_graphed_callables: sample args and params are on several "
                         f"device types ({sorted(devices)}); put them all on one CUDA device")
    on_cuda = _cuda.wants_graph(devices)
    if on_cuda and torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables under torch.autocast needs "
                           "cache_enabled=False (a cached cast would be baked into the graph)")
    if cfg.weight_caching:
        from . import _device
        if not any(cap.caches() for cap in caps):
            raise ValueError("make_graphed_callables: fp8_weight_caching=True but no callable "
                             "holds a tritium FP8 module (weight caching needs nn.Modules built "
                             "from te.Linear, LayerNormLinear or LayerNormMLP)")
        if any(p.is_cuda and not _device.use_triton(p) for c in caps for p in c.params[:1]):
            raise RuntimeError("make_graphed_callables(fp8_weight_caching=True) needs the Triton "
                               "cast kernel on CUDA (it reads the skip flag on the device); "
                               "unset TRITIUM_FORCE_REF")
        for cap in _graph_order.first_per_callable(caps):
            cap.install_flag()
        for cap in caps:
            cap.flag = cap.caches()[0].skip if cap.caches() else None
    if not on_cuda:
        warnings.warn("tritium.make_graphed_callables: no CUDA tensors, so no CUDA graphs: the "
                      "callables run eagerly (same arguments, FP8 settings and weight caching)",
                      stacklevel=2)
        out = [_wrap(cap, False, layout is None) for cap in caps]
        return out[0] if one else tuple(out)
    sequence = None if layout is None else layout.capture_sequence(caps)
    try:
        return _graph(caps, cfg, num_warmup_iters, allow_unused_input, pool,
                      retain_graph_in_backward, one, sequence, _reuse_graph_input_output_buffers)
    except BaseException:
        for cap in caps:  # leave the modules as they were: no flag, eager weight caching
            if cap.flag is not None:
                for m in cap.fp8_modules:
                    for c in m._weight_caches:
                        c.skip = None
        raise


def _graph(caps, cfg, num_warmup_iters, allow_unused_input, pool, retain_graph, one,
           sequence=None, reuse_buffers=False):
    # FP8GlobalStateManager.fp8_graph_capturing() is True from warm-up to the end of capture
    _autocast_stack.graph_capturing = True
    try:
        return _warm_and_capture(caps, cfg, num_warmup_iters, allow_unused_input, pool,
                                 retain_graph, one, sequence, reuse_buffers)
    finally:
        _autocast_stack.graph_capturing = False


def _warm_and_capture(caps, cfg, num_warmup_iters, allow_unused_input, pool, retain_graph, one,
                      sequence, reuse_buffers):
    if cfg.active:
        for cap in caps:
            for m in cap.fp8_modules:  # the states exist before the snapshot and the capture
                m.fp8_meta.prepare(cfg.recipe, next(m.parameters()).device)
            for m in cap.attention_modules:
                attn_fp8.prepare(m, cfg.recipe, (cap.params or cap.inputs)[0].device)
    saved = [s for cap in caps for s in cap.snapshot()]
    rng = _cuda.get_rng_state()
    for cap in caps:
        cap.has_grad = set()
    _cuda.synchronize()
    with torch.enable_grad(), _cuda.side_stream():
        _warmup(caps, num_warmup_iters, allow_unused_input)
    _cuda.synchronize()
    _restore(saved)
    _cuda.set_rng_state(rng)
    for cap in caps:  # the tensors the optimizer sees exist before capture, never replaced
        for p in cap.params:
            if p.requires_grad and id(p) in cap.has_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        cap.metas = [(m, m.fp8_meta.fwd, m.fp8_meta.bwd) for m in cap.fp8_modules]
    with torch.enable_grad():
        _capture(caps, _cuda.pool() if pool is None else pool, retain_graph,
                 sequence=sequence, reuse_buffers=reuse_buffers)
    _cuda.synchronize()
    for cap in caps:
        cap.keep = [c.entry for m in cap.fp8_modules for c in m._weight_caches if c.entry]
        cap.set_flag(True)
    out = [_wrap(cap, True, sequence is None) for cap in caps]
    return out[0] if one else tuple(out)


__all__ = ["make_graphed_callables"]
