"""gpu tier: torch.compile of the FP8 modules on CUDA (Triton kernels behind tritium's custom ops,
cuBLASLt FP8 GEMMs), Inductor, against eager.

  * Linear, LayerNormMLP and a TransformerLayer (bf16 params) under DelayedScaling and
    Float8CurrentScaling, `torch.compile(fullgraph=True)` vs eager over 3 steps: outputs, input
    and parameter gradients, FP8 scales and amax histories. The GEMMs and casts are the same
    kernels in both; Inductor compiles the glue between them (it may keep an intermediate in
    fp32 where eager rounds it to bf16, and FP8 rounding magnifies such a difference in the few
    elements it flips), so the FP8 state must agree bit for bit and each tensor within 1%
    relative error (Frobenius norm);
  * mode="reduce-overhead" (CUDA graphs through Inductor) of a 2-layer FP8 model: the same
    comparison, and Inductor did not skip CUDA graphs (the FP8 state buffers are static inputs).
Attention runs on the deterministic "torch" backend (cuDNN / flash backward may reduce in another
order from run to run).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tritium as te
from tritium import recipe

from testlib import fp8_state

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs CUDA with FP8 tensor cores")]

H, FFN, HEADS, SEQ, BATCH = 128, 256, 4, 64, 2
BF16 = torch.bfloat16


def _assert_close_rel(actual, expected, what: str, limit: float = 1e-2) -> None:
    err = ((actual - expected).norm() / expected.norm()).item()
    assert err < limit, f"{what}: relative error {err:.2e} >= {limit}"


def _build(kind: str) -> torch.nn.Module:
    kw = dict(params_dtype=BF16, device="cuda")
    if kind == "Linear":
        return te.Linear(H, H, **kw)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, FFN, normalization="RMSNorm", activation="swiglu", **kw)
    return te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=2, normalization="RMSNorm",
                               activation="swiglu", bias=False, hidden_dropout=0.0,
                               attention_dropout=0.0, attn_input_format="sbhd", **kw)


def _steps(module, forward, fp8_recipe, xs, dys):
    seen = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = forward(x)
        out.backward(dy)
        seen += [out.detach().float(), x.grad.float()]
    grads = [p.grad.float() for p in module.parameters() if p.grad is not None]
    return seen + grads, fp8_state([module])


@pytest.fixture(autouse=True)
def _torch_attention(setenv):
    setenv("TRITIUM_ATTN_BACKEND", "torch")


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_compiled_equals_eager_on_cuda(kind, recipe_name):
    fp8_recipe = (recipe.DelayedScaling(amax_history_len=4) if recipe_name == "delayed"
                  else recipe.Float8CurrentScaling())
    eager_module = _build(kind)
    compiled_module = copy.deepcopy(eager_module)
    te.prepare_fp8(compiled_module, fp8_recipe)
    xs = [torch.randn(SEQ, BATCH, H, device="cuda", dtype=BF16) for _ in range(3)]
    dys = [torch.randn(SEQ, BATCH, H, device="cuda", dtype=BF16) for _ in range(3)]
    torch._dynamo.reset()
    eager, eager_state = _steps(eager_module, eager_module, fp8_recipe, xs, dys)
    compiled_fn = torch.compile(compiled_module, fullgraph=True)
    compiled, compiled_state = _steps(compiled_module, compiled_fn, fp8_recipe, xs, dys)
    for i, (a, b) in enumerate(zip(eager_state, compiled_state)):
        assert torch.equal(a, b), f"FP8 state tensor {i} differs"
    for i, (a, b) in enumerate(zip(eager, compiled)):
        _assert_close_rel(b, a, f"tensor {i}")


def test_reduce_overhead_fp8_model():
    """mode="reduce-overhead" (CUDA graphs) against the same compile without CUDA graphs: bit for
    bit (outputs, grads, every scale and history), with the FP8 state updated in place inside
    the graphs. Against eager over 2 layers and 4 steps the compiled model differs by what
    Inductor's glue changes (a rounding here and there, then amaxes and scales, then the FP8
    grads by a few %): outputs and input grads must stay within 1%."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    base = torch.nn.Sequential(_build("TransformerLayer"), _build("TransformerLayer"))
    xs = [torch.randn(SEQ, BATCH, H, device="cuda", dtype=BF16) for _ in range(4)]
    dys = [torch.randn(SEQ, BATCH, H, device="cuda", dtype=BF16) for _ in range(4)]
    eager_model = copy.deepcopy(base)
    eager, _ = _steps(eager_model, eager_model, fp8_recipe, xs, dys)
    from torch._dynamo.utils import counters
    runs = {}
    for mode in ("default", "reduce-overhead"):
        model = copy.deepcopy(base)
        te.prepare_fp8(model, fp8_recipe)
        for p in model.parameters():  # accumulate into eager memory, not into a CUDA graph's
            p.grad = torch.zeros_like(p)  # output that the next replay overwrites
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, mode=mode, fullgraph=True)

        def forward(x):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(x).clone()
        runs[mode] = _steps(model, forward, fp8_recipe, xs, dys)
        assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])
    (plain, plain_state), (graphed, graphed_state) = runs["default"], runs["reduce-overhead"]
    for i, (a, b) in enumerate(zip(plain + plain_state, graphed + graphed_state)):
        assert torch.equal(a, b), f"tensor {i}: CUDA graphs changed it"
    for i in range(2 * len(xs)):  # outputs and input grads, step by step
        _assert_close_rel(plain[i], eager[i], f"tensor {i} vs eager")
