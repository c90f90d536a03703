"""Block-scaled FP8 params (Float8BlockTensor) in the tensor-parallel state-dict helpers.

`shard_state_dict` / `gather_full_state_dict` (tensor_parallel.py) move a block-FP8 weight
with its fp8 bytes and scales: each part of `Float8BlockTensor.checkpoint_parts()` (the
scales, and for 1x128 weights the columnwise form) is sharded or gathered along the weight's
sharded dim like the dequantized values, and the bytes are rebuilt as values / scales
(`load_checkpoint_`, as DCP does), bit for bit. Dequantizing and requantizing would not do: the
amax of a block's dequantized values can pick another scale (always, for scales that are not
powers of 2), and a 1x128 weight's columnwise form is quantized from high precision, not from
the rowwise bytes. This needs every shard to hold whole 128-element blocks along the sharded
dim (each sharded size a multiple of 128 x tp): a cut block is not a block of the shard, and
requantizing its values in the shard's blocks would round them again, so a block-FP8 param
refuses such a shard; high-precision params take the exact dequantized values.
"""
from __future__ import annotations

from ..fp8.block_tensor import BLOCK, Float8BlockTensor
from .tensor_parallel import shard_tensor


def whole_blocks(blocks, size: int) -> bool:
    """Whether each rank's shard of every block holds whole 128-element scale blocks of a
    block-scaled FP8 weight (Float8BlockScaling: 128x128, or 1x128 tiles along both dims)."""
    return all(b % (BLOCK * size) == 0 for b in blocks)


def block_parts(value, dim: int, blocks):
    """(part, its block sizes along `dim`) for each of `checkpoint_parts()` of a block-scaled
    FP8 weight: a part holds one entry per element or per 128 elements along `dim`."""
    for name, part in value.checkpoint_parts().items():
        per = value.shape[dim] // part.shape[dim]
        yield name, part, [b // per for b in blocks]


def block_fp8(values, parts: dict, like):
    """A Float8BlockTensor of `like`'s form holding the fp8 bytes whose values are `values`,
    with the scales `parts` (Float8BlockTensor.load_checkpoint_: bit for bit)."""
    q = like._qparams
    out = Float8BlockTensor.quantize(values, like._fp8_dtype, block_2d=like._block_2d,
                                     power_2_scale=q[0], amax_epsilon=q[1])
    return out.load_checkpoint_(values, parts)


def shard_block_fp8(key, value, target, dim, blocks, size, rank):
    """Rank `rank`'s shard of a block-scaled FP8 weight (fp8_model_init under
    Float8BlockScaling) with its fp8 bytes and scales, where the shards hold whole blocks.
    Otherwise its dequantized values (exact), which a high-precision param takes as they are,
    but a block-FP8 param would requantize in other blocks (rounding them again): refused."""
    values = shard_tensor(value.dequantize(), dim, blocks, size, rank)
    if not whole_blocks(blocks, size):
        if isinstance(target, Float8BlockTensor):
            raise ValueError(
                f"shard_state_dict: {key} is a block-scaled FP8 weight {tuple(value.shape)} and "
                f"tp_size={size} shards of {[b // size for b in blocks]} along dim {dim} would "
                f"cut its {BLOCK}-element scale blocks: the shards' own blocks would round its "
                f"fp8 values again. Make the sharded size (each part of it) a multiple of "
                f"{BLOCK} x tp_size = {BLOCK * size}, or load a high-precision state dict (the "
                "optimizer's fp32 masters, or the weights before fp8_model_init)")
        return values
    parts = {n: shard_tensor(p, dim, b, size, rank)
             for n, p, b in block_parts(value, dim, blocks)}
    return block_fp8(values, parts, value)


__all__ = ["block_fp8", "block_parts", "shard_block_fp8", "whole_blocks"]
