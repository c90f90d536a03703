"""Helpers the test modules import: TE's tolerances, data with a known amax, and an FP8 Linear
emulation written independently of tritium (from DESIGN.md section 4, not from its code).

The emulation quantizes each GEMM operand with a given scale (scale in fp32, clamp to +-max,
round with torch's `.to(fp8 dtype)`), dequantizes with 1/scale and multiplies in fp32. It reads
nothing from tritium, so comparing a module with it checks the module's casts, scales, GEMM
layouts and padding. Also, for the tests that start process groups: `free_port`, `gloo_group`
(a spawned rank's group) and `spawn` / `spawn_results` (torch.multiprocessing).
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys

import torch

# TE's tolerances (DESIGN.md section 9), as assert_close keyword arguments.
FP32_TOL = dict(rtol=1.3e-6, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
FP8_TOL = dict(rtol=0.125, atol=0.0675)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FP32_MAX = 3.4028234663852886e38


def with_amax(t: torch.Tensor, amax: float, limit: float | None = None) -> torch.Tensor:
    """`t` clamped to +-limit (default amax/2) with -amax written at one place, so that
    max|t| == amax exactly."""
    limit = amax / 2 if limit is None else limit
    out = t.detach().clone().clamp_(-limit, limit)
    out.view(-1)[out.numel() // 3] = -amax
    return out


def fake_quant(x: torch.Tensor, scale, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Quantize with `scale` (a float or one-element tensor) and dequantize, in fp32."""
    s = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    limit = FP8_MAX[fp8_dtype]
    q = (x.float() * s).clamp(-limit, limit).to(fp8_dtype)
    return q.float() * (1.0 / s)


def current_scale(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Float8CurrentScaling's scale with amax_epsilon=0 for a tensor of non-zero finite values."""
    return torch.tensor(FP8_MAX[fp8_dtype], dtype=torch.float32) / x.detach().abs().max().float()


def emulated_linear(x, w, b, dy, s_x, s_w, s_dy, fwd_dtype, bwd_dtype):
    """out, dx, dw, db of y = x w^T + b with all three GEMMs on fake-quantized operands.

    x [..., K], w [N, K], dy [..., N]; s_* are the scales the module used for each operand."""
    x2d, dy2d = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, dy.shape[-1]).float()
    xq, wq = fake_quant(x2d, s_x, fwd_dtype), fake_quant(w, s_w, fwd_dtype)
    dyq = fake_quant(dy2d, s_dy, bwd_dtype)
    out = xq @ wq.t()
    if b is not None:
        out = out + b.float()
    dx = dyq @ wq
    dw = dyq.t() @ xq
    db = None if b is None else dy2d.sum(0)
    return (out.reshape(*x.shape[:-1], w.shape[0]), dx.reshape(x.shape), dw, db)


def fp8_state(modules) -> list:
    """Copies of every FP8 scale and amax history found in `modules` (for bitwise comparisons)."""
    out = []
    for m in modules:
        for mod in m.modules():
            meta = getattr(mod, "fp8_meta", None)
            for st in (getattr(meta, "fwd", None), getattr(meta, "bwd", None)):
                if st is not None:
                    out += [st.scale.clone(), st.amax_history.clone()]
    return out


def fp8_linear_steps(layer, x, dy, fp8_recipe, steps: int):
    """`steps` fwd+bwd of `layer` on x (a fresh leaf each time) under fp8_autocast; returns the
    last step's (out, dx, dweight, dbias)."""
    import tritium as te
    for _ in range(steps):
        xi = x.clone().requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = layer(xi)
        out.backward(dy)
    return out.detach(), xi.grad, layer.weight.grad, layer.bias.grad


def fp64_attention(q, k, v, do, causal: bool, scale: float) -> list:
    """The attention oracle: fp64 autograd on the same (16-bit) q, k, v [b, s, h, d] and do,
    GQA by repeating k/v heads. Returns [out, lse, dq, dk, dv] in fp64."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(groups, 2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    out.backward(do.double())
    res = [out.detach(), lse.detach(), q.grad, k.grad, v.grad]
    del s, out  # the fp64 scores are large: free them before the caller's next allocation
    return res


def free_port() -> int:
    """A free TCP port on localhost, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """A gloo process group for this spawned rank (rendezvous on localhost:port, one CPU thread,
    TRITIUM_FORCE_REF=1 re-read by tritium). After the body, every rank waits for the others
    before the group is torn down: a rank destroying it early aborts a peer still in a
    collective (SIGABRT). On an error the group goes at once."""
    import torch.distributed as dist
    from tritium import _env
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), TRITIUM_FORCE_REF="1")
    _env.reload()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_then_exit(rank: int, worker, args: tuple) -> None:
    worker(rank, *args)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def spawn(worker, nprocs: int, *args) -> None:
    """mp.spawn(worker, args, nprocs, join=True), with each rank leaving by os._exit(0) once
    worker(rank, *args) returns. The worker has destroyed its process group by then; what is
    skipped is the interpreter's own teardown, where torch's gloo/TCPStore threads abort a rank
    now and then ("terminate called without an active exception", ~1 run in 15 at 4 ranks on
    2 cores) after every test in it had passed. An exception in the worker still fails the
    spawn with its traceback."""
    import torch.multiprocessing as mp
    mp.spawn(_run_then_exit, args=(worker, args), nprocs=nprocs, join=True)


def spawn_results(worker, world: int, out_dir, *args):
    """Run worker(rank, port, str(out_dir), *args) in `world` processes (`spawn`, a fresh
    rendezvous port) and return what they left in out_dir/results.pt."""
    spawn(worker, world, free_port(), str(out_dir), *args)
    return torch.load(os.path.join(str(out_dir), "results.pt"), weights_only=False)


@contextlib.contextmanager
def all_gather_sizes(owner=None, name: str = "all_gather_single"):
    """Inside: every dist.all_gather_single call (FSDP2's gather) appends its input's bytes to
    the yielded list; or every call of `owner.name` (e.g. tritium.distributed.tensor_parallel's
    `_all_gather`, which all_gather_dim0 calls: the tensor-parallel gathers)."""
    import torch.distributed as dist
    owner = dist if owner is None else owner
    sizes, real = [], getattr(owner, name)

    def counting(output, inp, *args, **kwargs):
        sizes.append(inp.numel() * inp.element_size())
        return real(output, inp, *args, **kwargs)
    setattr(owner, name, counting)
    try:
        yield sizes
    finally:
        setattr(owner, name, real)


def fp8_states(model) -> list:
    """Copies of every module's delayed-scaling scales and amax histories (forward, backward;
    FP8 attention's q/k/v and output states where a module has them)."""
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if meta is not None and meta.fwd is not None:
            out += [meta.fwd.scale, meta.fwd.amax_history, meta.bwd.scale, meta.bwd.amax_history]
        for attr in ("fp8_attn_state", "fp8_out_state"):
            st = getattr(m, attr, None)
            if st is not None:
                out += [st.scale, st.amax_history]
    return [t.clone() for t in out]


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bits(got, want, what):
    """got and want hold the same bits (or are both None): dtype, shape and every element."""
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bits = lambda t: t.detach().contiguous().view(_INT[t.element_size()])  # noqa: E731
    bad = (bits(got) != bits(want)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ"


class WrappedWeight(torch.Tensor):
    """A weight wrapper of the kind torchao's float8 training puts on params: no storage of its
    own, one inner tensor (`_tensor`), every op run on the inner tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device, requires_grad=False)

    def __init__(self, inner):
        self._tensor = inner
        self._precomputed_scale = None   # torchao sets one between steps: a second inner tensor

    def __tensor_flatten__(self):
        names = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None
                               else [])
        return names, None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return WrappedWeight(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._tensor if isinstance(t, WrappedWeight) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return WrappedWeight(out) if func is torch.ops.aten.detach.default else out
