"""gpu tier: the FusedAdam / FusedSGD Triton kernels against their PyTorch twins on CUDA at real
sizes, BIT FOR BIT, and capturable FusedAdam captured in a CUDA graph. Skipped without CUDA.

Why bitwise holds on CUDA too: the kernels are elementwise (no reduction but FP8's amax, a max,
which is exact), compiled without FMA contraction, with IEEE div/sqrt (div.rn / sqrt.rn); the
twins run one torch op per rounding (tensor/tensor division, which CUDA torch does not turn
into a reciprocal multiply; sqrt through float64; torch's bf16/fp8 casts are RTNE, saturation
handled by the clamp). NaN payloads are not compared (NaN where NaN).

Sizes: a Llama-8B-like set (4096x4096, 14336x4096, 128256x... cut to 32320x4096) plus odd
sizes (1, 1023, 4097, 33x77) in one launch; fp32, bf16/fp16 with masters, bf16 without, FP8
e4m3/e5m2 with masters and amax, bf16 remainders; fp32 and bf16 moments; AdamW and L2;
16-byte aligned and misaligned storage. The graph test: warm up 3 steps on a side stream,
capture one step, replay 5 times with new grads copied into the captured grad tensors; the
eager capturable run on the same grads gives the same bits.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tritium.fp8.tensor import Float8Tensor
from tritium.kernels import adam as kadam
from tritium.kernels import sgd as ksgd
from tritium.optimizers import FusedAdam, FusedSGD
from tritium.ref import adam as radam
from tritium.ref import sgd as rsgd

from testlib import WrappedWeight

from interp._helpers import assert_same_bits as _same_bits, assert_same_optimizer_results

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
BIG = [(4096, 4096), (14336, 4096), (32320, 4096)]
ODD = [(1,), (1023,), (4097,), (33, 77)]


def assert_same_bits(got, want, what):
    """Bit for bit, NaN only required in the same places (its payload is not a result)."""
    _same_bits(got, want, what, nan_as_nan=True)


def _empty(shape, dtype, aligned):
    n = 1
    for s in shape:
        n *= s
    if aligned:
        return torch.empty(shape, dtype=dtype, device="cuda")
    return torch.empty(n + 1, dtype=dtype, device="cuda")[1:].view(shape)


def _group(shapes, kind, grad_dtype, moment_dtype, aligned, gen):
    lists = [[], [], [], [], [], [], []]   # params grads m v masters fp8 remainders
    for shape in shapes:
        w = torch.randn(shape, device="cuda", generator=gen) * 3
        g = _empty(shape, grad_dtype, aligned)
        g.copy_(torch.randn(shape, device="cuda", generator=gen))
        m = _empty(shape, moment_dtype, aligned)
        m.copy_(torch.randn(shape, device="cuda", generator=gen) * 0.1)
        v = _empty(shape, moment_dtype, aligned)
        v.copy_(torch.rand(shape, device="cuda", generator=gen) * 0.01)
        if kind in (E4M3, E5M2):
            scale = torch.tensor([FP8_MAX[kind] / 8.0], device="cuda")   # |w| > 8 clamps
            p = _empty(shape, kind, aligned)
            p.copy_((w * scale).clamp(-FP8_MAX[kind], FP8_MAX[kind]).to(kind))
            lists[4].append(w)
            lists[5].append((scale, torch.zeros(1, device="cuda"),
                             torch.zeros(1, device="cuda") if len(shape) > 1 else None))
        elif kind == "rem":
            p = _empty(shape, torch.bfloat16, aligned)
            bits, rem = radam.split_remainder(w)
            p.view(torch.int16).copy_(bits)
            lists[6].append(rem)
        else:
            dtype, master = kind
            p = _empty(shape, dtype, aligned)
            p.copy_(w)
            if master:
                lists[4].append(w)
        for i, t in enumerate((p, g, m, v)):
            lists[i].append(t)
    return [x if x else None for x in lists]


def _clone(lists):
    return [None if xs is None else
            [tuple(None if t is None else t.clone() for t in x) if isinstance(x, tuple)
             else x.clone() for x in xs] for xs in lists]


def _compare(a, b):
    for name, xs, ys in zip(("param", "grad", "m", "v", "master", "fp8", "rem"), a, b):
        if xs is None:
            continue
        for i, (x, y) in enumerate(zip(xs, ys)):
            if isinstance(x, tuple):
                for j, (s, t) in enumerate(zip(x, y)):
                    if s is not None:
                        assert_same_bits(s, t, f"{name}[{i}][{j}]")
            else:
                assert_same_bits(x, y, f"{name}[{i}]")


KINDS = {"fp32": (torch.float32, False), "bf16+master": (torch.bfloat16, True),
         "fp16+master": (torch.float16, True), "bf16": (torch.bfloat16, False),
         "e4m3": E4M3, "e5m2": E5M2, "rem": "rem"}
ADAM_CASES = [("fp32", torch.float32, torch.float32, True, True),
              ("fp32", torch.float32, torch.float32, False, False),
              ("bf16+master", torch.bfloat16, torch.float32, True, True),
              ("bf16+master", torch.float32, torch.bfloat16, True, True),
              ("fp16+master", torch.float16, torch.float32, False, True),
              ("bf16", torch.bfloat16, torch.float32, True, True),
              ("e4m3", torch.bfloat16, torch.float32, True, True),
              ("e5m2", torch.float32, torch.float32, True, False),
              ("rem", torch.bfloat16, torch.float32, True, True),
              ("rem", torch.bfloat16, torch.bfloat16, False, False)]


def _hp(step=7, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    return torch.tensor([lr, 1 - b1 ** step, 1 - b2 ** step, b1, 1 - b1, b2, 1 - b2, eps, wd],
                        dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_adam_kernel_equals_ref(case):
    kind, gdt, mdt, adam_w, aligned = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(str(case).encode()))
    lists = _group(BIG + ODD, KINDS[kind], gdt, mdt, aligned, gen)
    twin = _clone(lists)
    cache = {}
    for step in (1, 2):  # the second call takes the cached tables
        kadam.adam_step(*lists, _hp(step), adam_w_mode=adam_w, weight_decay=True, cache=cache)
        radam.adam_step(*twin, _hp(step), adam_w_mode=adam_w, weight_decay=True)
    torch.cuda.synchronize()
    _compare(lists, twin)


@pytest.mark.parametrize("kind", ["fp32", "bf16+master", "e4m3"])
@pytest.mark.parametrize("momentum,first,nesterov", [(True, True, False), (True, False, True),
                                                     (False, False, False)])
def test_sgd_kernel_equals_ref(kind, momentum, first, nesterov):
    gen = torch.Generator(device="cuda").manual_seed(11)
    p, g, m, _, masters, fp8, _ = _group(BIG[:2] + ODD, KINDS[kind], torch.bfloat16,
                                         torch.float32, True, gen)
    lists = [p, g, m if momentum else None, masters, fp8]
    twin = _clone(lists)
    hp = torch.tensor([0.05, 0.9, 0.8, 0.01], device="cuda")
    kw = dict(weight_decay=True, wd_after_momentum=False, nesterov=nesterov, first=first)
    ksgd.sgd_step(*lists, hp, cache={}, **kw)
    rsgd.sgd_step(*twin, hp, **kw)
    torch.cuda.synchronize()
    _compare(lists, twin)


# ----------------------------------------------------------------------------- CUDA graphs
def _fp8_param(shape, gen):
    x = torch.randn(shape, device="cuda", generator=gen)
    scales = torch.tensor([1.0, 448.0 / 4.0], device="cuda")
    data = (x * scales[1:]).clamp(-448, 448).to(E4M3)
    p = Float8Tensor(data, 1 / scales[1:], E4M3, torch.bfloat16, data.t().contiguous(),
                     scales[1:], requires_grad=True)
    p._amax = torch.zeros(1, device="cuda")
    return p


def _model(gen):
    return [torch.nn.Parameter(torch.randn(4096, 1024, device="cuda", generator=gen)),
            torch.nn.Parameter(torch.randn(1023, device="cuda", generator=gen).bfloat16()),
            torch.nn.Parameter(torch.randn(2048, 512, device="cuda", generator=gen).bfloat16()),
            _fp8_param((512, 256), gen)]


def _copy(params):
    out = []
    for p in params:
        if isinstance(p, Float8Tensor):
            q = Float8Tensor(p._data.clone(), p._scale_inv.clone(), E4M3, p.dtype,
                             p._transpose.clone(), p._scale.clone(), requires_grad=True)
            q._amax = p._amax.clone()
            out.append(q)
        else:
            out.append(torch.nn.Parameter(p.detach().clone()))
    return out


def _set_grads(ps, gs):
    for p, g in zip(ps, gs):
        if p.grad is None:
            p.grad = g.to(p.dtype).clone()
        else:
            p.grad.copy_(g)   # never replace a grad the graph reads


def _eager_and_graphed(make, base, grads):
    """The optimizer `make` builds, stepped eagerly over every grad set on one copy of `base`,
    and on another copy warmed up (3 steps on a side stream), captured in a CUDA graph and
    replayed for the rest: (graph params, graph optimizer, eager params, eager optimizer)."""
    eager_p = _copy(base)
    eager = make(eager_p)
    for gs in grads:
        _set_grads(eager_p, gs)
        eager.step()
    graph_p = _copy(base)
    opt = make(graph_p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for gs in grads[:3]:
            _set_grads(graph_p, gs)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for gs in grads[3:]:
        _set_grads(graph_p, gs)
        graph.replay()
    torch.cuda.synchronize()
    return graph_p, opt, eager_p, eager


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_capturable_step_in_cuda_graph_equals_eager(moments):
    gen = torch.Generator(device="cuda").manual_seed(5)
    base = _model(gen)
    grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in base]
             for _ in range(8)]

    def make(ps):
        return FusedAdam([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-3,
                         weight_decay=0.1, capturable=True, master_weights=True,
                         exp_avg_dtype=moments, exp_avg_sq_dtype=moments)

    graph_p, opt, eager_p, eager = _eager_and_graphed(make, base, grads)
    assert_same_optimizer_results(graph_p, opt, eager_p, eager, nan_as_nan=True)
    assert int(opt.param_groups[0]["step"].item()) == len(grads)


def test_fused_adam_kernel_equals_ref_end_to_end(setenv):
    gen = torch.Generator(device="cuda").manual_seed(9)
    base = _model(gen)
    grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in base]
             for _ in range(3)]

    def run(ps):
        opt = FusedAdam(ps, lr=1e-3, weight_decay=0.1, master_weights=True)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.to(p.dtype)
            opt.step()
        return opt

    kp, rp = _copy(base), _copy(base)
    kopt = run(kp)
    setenv("TRITIUM_FORCE_REF", "1")
    ropt = run(rp)
    for a, b in zip(kp, rp):
        assert_same_bits(a._data if isinstance(a, Float8Tensor) else a.detach(),
                         b._data if isinstance(b, Float8Tensor) else b.detach(), "param")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_same_bits(kopt.state[a][name], ropt.state[b][name], name)


def test_fused_sgd_runs_one_launch_per_bucket():
    """Many tensors of one dtype combination: one kernel launch (the multi-tensor design)."""
    params = [torch.nn.Parameter(torch.randn(1000 + i, device="cuda")) for i in range(64)]
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "_sgd_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]


@pytest.mark.parametrize("config", [
    dict(master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.float16),
    dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, store_param_remainders=True),
], ids=["fp16-master-fp8-m-fp16-v", "fp8-moments-remainders"])
def test_fused_adam_scaled_states_kernel_equals_ref(setenv, config):
    """fp16 masters and fp16 / FP8 moments (two-pass kernel) == the twin, bit for bit, at real
    sizes: the factors come from an exact max (atomic max of |x|) and the same torch ops."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    base = _model(gen)
    grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in base]
             for _ in range(3)]

    def run(ps):
        opt = FusedAdam(ps, lr=1e-3, weight_decay=0.1, master_weights=True, **config)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.to(p.dtype)
            opt.step()
        return opt

    kp, rp = _copy(base), _copy(base)
    kopt = run(kp)
    setenv("TRITIUM_FORCE_REF", "1")
    ropt = run(rp)
    assert_same_optimizer_results(kp, kopt, rp, ropt, nan_as_nan=True)
    for a, b in zip(kp, rp):
        assert_same_bits(kopt.state[a]["state_scales"], ropt.state[b]["state_scales"], "scales")


def test_capturable_scaled_states_in_cuda_graph_equals_eager():
    """The two-pass scaled step has no host sync: it captures, and replays like eager."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    base = _model(gen)
    grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in base]
             for _ in range(6)]

    def make(ps):
        return FusedAdam(ps, lr=1e-3, capturable=True, master_weights=True,
                         master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
                         exp_avg_sq_dtype=torch.float16)

    graph_p, opt, eager_p, eager = _eager_and_graphed(make, base, grads)
    assert_same_optimizer_results(graph_p, opt, eager_p, eager, nan_as_nan=True)


def test_fused_adam_steps_the_inside_of_a_weight_wrapper():
    """A CUDA param wrapped as torchao's float8 training wraps weights (no storage of its own,
    later with a precomputed scale beside the data): the kernel steps the inner tensor, the
    same bits as on a plain param (it once read the wrapper's null pointer: an illegal address)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    plain = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g).to(torch.bfloat16))
             for n in (1000, 4099)]
    wrapped = [torch.nn.Parameter(WrappedWeight(p.detach().clone())) for p in plain]
    opts = [FusedAdam(ps, lr=1e-2, master_weights=True) for ps in (plain, wrapped)]
    for step in range(3):
        for p, q in zip(plain, wrapped):
            q._precomputed_scale = torch.ones((), device="cuda") if step else None
            p.grad = torch.randn(p.shape, device="cuda", generator=g).to(torch.bfloat16)
            q.grad = p.grad.clone()
        for o in opts:
            o.step()
    torch.cuda.synchronize()
    for p, q in zip(plain, wrapped):
        assert torch.equal(q._tensor.view(torch.int16), p.detach().view(torch.int16))

