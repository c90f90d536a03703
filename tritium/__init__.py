"""tritium: FP8 training of Transformers in Python + Triton, with TransformerEngine's API.

    import tritium as te
    from tritium import recipe
    layer = te.Linear(4096, 4096)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        y = layer(x)
"""
from . import optimizers, recipe
from .fp8.autocast import autocast, fp8_autocast
from .fp8.model_init import fp8_model_init, quantized_model_init
from .fp8.tensor import Float8Tensor
from .graphs import make_graphed_callables
from .attention import DotProductAttention, RotaryPositionEmbedding, apply_rotary_pos_emb
from .functional.cross_entropy import parallel_cross_entropy
from .functional.linear_cross_entropy import linear_cross_entropy
from .modules.cross_entropy import LinearCrossEntropyLoss
from .modules import (LayerNorm, LayerNormLinear, LayerNormMLP, Linear, MultiheadAttention,
                      RMSNorm, TransformerLayer)
from . import distributed
from .distributed.activation_checkpoint import checkpoint
from .distributed.random import CudaRNGStatesTracker

from .modules.base import prepare_fp8
from .modules.grouped_linear import GroupedLinear
from .modules.moe import MoE, MoEConfig
from .functional.moe import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                             fused_topk_with_score_function, moe_permute,
                             moe_permute_with_probs, moe_unpermute)
from . import quantization, utils
from .fp8.formats import DType
from .fp8.global_state import (FP8GlobalStateManager, get_cudnn_version, get_default_recipe,
                               get_device_compute_capability, is_bf16_available, is_fp8_available,
                               is_fp8_block_scaling_available, is_mxfp8_available,
                               is_nvfp4_available)
from .fp8.quantized_tensor import QuantizedTensor
from .fp8.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer, Quantizer
from .utils import deinterleave_glu_tensor, interleave_glu_tensor

__version__ = "0.1.0"

__all__ = ["recipe", "optimizers", "autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init",
           "Float8Tensor", "Linear", "LayerNorm", "RMSNorm",
           "LayerNormLinear", "LayerNormMLP", "DotProductAttention", "RotaryPositionEmbedding",
           "apply_rotary_pos_emb", "MultiheadAttention", "TransformerLayer",
           "make_graphed_callables", "distributed", "checkpoint", "CudaRNGStatesTracker",
           "parallel_cross_entropy", "linear_cross_entropy", "LinearCrossEntropyLoss",
           "quantization", "utils", "DType", "FP8GlobalStateManager", "get_cudnn_version",
           "get_default_recipe", "get_device_compute_capability", "is_bf16_available",
           "is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available",
           "is_nvfp4_available", "QuantizedTensor", "Quantizer", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "interleave_glu_tensor", "deinterleave_glu_tensor",
           "__version__"]
__all__ += ["prepare_fp8", "GroupedLinear", "MoE", "MoEConfig", "moe_permute", "moe_permute_with_probs",
            "moe_unpermute", "fused_topk_with_score_function",
            "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]
