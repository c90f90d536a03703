"""gpu tier: make_graphed_callables' TE keywords with real CUDA graphs: `_order` (Megatron's
interleaved schedule, with and without `_reuse_graph_input_output_buffers`) and modules built
under fp8_model_init train exactly like eager. Skipped without CUDA; the CPU tier checks the
same scenarios through the eager emulation (tests/test_graph_keywords.py)."""
from __future__ import annotations

import pytest
import torch

from test_graph_keywords import _fp8_param_training, _train_pipeline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


@pytest.mark.parametrize("reuse,caching", [(False, False), (True, False), (False, True)])
def test_order_trains_like_eager(reuse, caching):
    _same(_train_pipeline(False, device="cuda", caching=caching),
          _train_pipeline(True, reuse=reuse, device="cuda", caching=caching))


def test_fp8_model_init_module_graphs_like_eager():
    _same(_fp8_param_training(False, device="cuda"), _fp8_param_training(True, device="cuda"))
