"""cpu tier: tritium.distributed.clip_grad_norm_ in one process (no TP, no FSDP) is torch's clip:
the same norm and the same clipped gradients, for fp32 and bf16 gradients in one model; bad
arguments are refused before any gradient changes. The TP x FSDP2 case: tests/test_fsdp_tp.py."""
from __future__ import annotations

import pytest
import torch

import tritium as te
from tritium.distributed import clip_grad_norm_

pytestmark = pytest.mark.cpu


def _model_with_grads(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(te.LayerNormLinear(64, 96),
                                te.Linear(96, 32, params_dtype=torch.bfloat16))
    x = torch.randn(8, 64)
    model[1](model[0](x).to(torch.bfloat16)).float().square().sum().backward()
    return model


@pytest.mark.parametrize("max_norm", [1e-2, 1e6])
def test_equals_torch_clip(max_norm):
    ours, ref = _model_with_grads(0), _model_with_grads(0)
    norm = clip_grad_norm_(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.testing.assert_close(norm, ref_norm.float(), rtol=1e-6, atol=0)
    assert norm > 1e-2   # the small max_norm clips, the large one does not
    for p, q in zip(ours.parameters(), ref.parameters()):   # the same fp32 factor: same bits
        assert torch.equal(p.grad, q.grad)


def test_bad_arguments_change_nothing():
    model = _model_with_grads(1)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="nn.Module"):
        clip_grad_norm_(list(model.parameters()), 1.0)
    with pytest.raises(NotImplementedError, match="norm_type"):
        clip_grad_norm_(model, 1.0, norm_type=float("inf"))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model, 0.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
