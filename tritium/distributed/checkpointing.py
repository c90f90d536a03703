"""Distributed checkpoints of tritium models and optimizers with torch.distributed.checkpoint (DCP).

What: `get_state_dict(model, optimizer)` / `set_state_dict(model, optimizer, state)` wrap torch's
`torch.distributed.checkpoint.state_dict.get_state_dict` / `set_state_dict` and return / take
one dict {"model": ..., "optim": ...} to pass to `dcp.save` / `dcp.load`; `save(path, model,
optimizer)` and `load(path, model, optimizer)` do both steps. Everything sharded stays a DTensor,
so DCP reshards on load: a checkpoint written by 2 ranks loads on 1, 2 or 4.

Why a wrapper (thin on purpose; torch does the work):
  * FusedAdam / FusedSGD keep their state as DTensors shaped like the params (masters, moments;
    see tritium/optimizers/_dtensor.py), fp32 and unscaled, so torch's optimizer state dict
    flattening and resharding apply to them unchanged: nothing here touches optimizer state.
  * FP8 params (tritium Float8Tensor shards, from fp8_model_init) are saved as their
    dequantized values in their nominal dtype (a DTensor like any other weight): DCP writes plain
    storage, and the checkpoint also loads into a high-precision model. On load they are
    requantized with the module's loaded scale AFTER the FP8 metadata is in place (a module
    loads its params before its extra_state), which gives back the saved fp8 bytes exactly (the
    saved value is fp8 * scale_inv; times the same scale it rounds to the same fp8 value). The
    optimizer's fp32 masters come from the optimizer state, so training resumes bit-exactly.
  * Block-scaled FP8 params (Float8BlockTensor, fp8_model_init under Float8BlockScaling; FSDP2
    shards of them) are saved as their dequantized values too, and their block scales (1x128:
    also the columnwise form) under "fp8_block" {param name: Float8BlockTensor.checkpoint_parts}
    as DTensors sharded like the param (dim 0 of every part follows the weight's rows), so DCP
    reshards them with it. There is no module scale to requantize with: `set_state_dict`
    rebuilds the bytes from the values and the saved scales (block_tensor.py's note), bit for
    bit. A model whose block params do not match the checkpoint (none saved: a tensorwise or
    high-precision checkpoint; the other block form; a tensorwise param where blocks were saved)
    is refused by name before anything is loaded; a high-precision model loads the values.
  * High-precision weights wrapped for FP8 all-gather (tritium.distributed.fsdp) are saved as
    the plain tensors they wrap.
  * FP8 metadata (module extra_state: scales and amax histories as tensors, the recipe as plain
    values) goes through DCP like the rest: tensors are saved once (identical on every rank:
    the amaxes still pending in row 0, such as the weight-shard amaxes the optimizer records,
    are reduced first, in one all-reduce over the amax group) and the plain values as DCP's
    small objects. DCP needs a template of the
    same structure to load into, so a module that has not run under FP8 yet is prepared with
    `fp8_recipe` (the recipe the checkpoint was trained with) before loading; without it, a clear
    error names the module.
  * FP8 attention state (DotProductAttention's `_extra_state` under DelayedScaling(fp8_dpa=True):
    q/k/v scales and amax history) goes the same way; `fp8_recipe` with fp8_dpa=True prepares
    its template. A checkpoint written before attention modules saved a state (no entry for
    one), or without fp8_dpa (None), loads with the attention state left empty, as
    load_state_dict does: the next fp8_autocast makes it fresh.

Not done here: async saving, pipeline parallel flattening, checkpoints of torch's FSDP1.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_state_dict as _torch_get_state_dict,
                                                     set_state_dict as _torch_set_state_dict)
from torch.distributed.tensor import DTensor

from ..attention import fp8 as attn_fp8
from ..fp8.block_tensor import Float8BlockTensor, checkpoint_layout
from ..fp8.recipe import DelayedScaling
from ..fp8.tensor import Float8Tensor
from .amax import reduce_amax_rows

BLOCKS = "fp8_block"    # the state dict entry of block-scaled params' scales


def _plain_local(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The plain high-precision tensor to save for a tritium param's local tensor, or None when
    the param is plain already."""
    if isinstance(t, (Float8Tensor, Float8BlockTensor)):
        return t.dequantize()
    hp = getattr(t, "_hp_shard", None)          # fsdp.enable_fp8_all_gather's wrapper
    return None if hp is None else hp.detach()


def _savable(value):
    if isinstance(value, DTensor):
        plain = _plain_local(value._local_tensor)
        if plain is None:
            return value
        return DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        plain = _plain_local(value)
        return value if plain is None else plain
    return value


def _block_parts(value) -> Optional[dict]:
    """checkpoint_parts of a block-scaled param (DTensors placed like it), else None."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, Float8BlockTensor):
        return None
    parts = local.checkpoint_parts()
    if not isinstance(value, DTensor):
        return parts
    shapes = checkpoint_layout(value.shape, local._block_2d)
    return {n: DTensor.from_local(t.contiguous(), value.device_mesh, value.placements,
                                  run_check=False, shape=shapes[n], stride=(shapes[n][1], 1))
            for n, t in parts.items()}


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_blocks(model: torch.nn.Module, saved: set, where: str) -> None:
    """Every block-scaled param of the model finds its parts (of its block form) among the
    `saved` names ("<param>.<part>"), and no tensorwise FP8 param has block parts saved."""
    for name, p in model.named_parameters():
        local = _local(p)
        mine = {n for n in saved if n.startswith(name + ".")}
        if isinstance(local, Float8BlockTensor):
            want = {f"{name}.{n}" for n in checkpoint_layout(local.shape, local._block_2d)}
            form = "128x128" if local._block_2d else "1x128"
            if want <= saved:
                continue
            if mine:
                raise ValueError(
                    f"{where}: the checkpoint holds block-scaled FP8 param {name!r} with "
                    f"{'1x128' if local._block_2d else '128x128'} blocks, this model's has "
                    f"{form} blocks; build it under fp8_model_init(recipe=Float8BlockScaling("
                    f"w_block_scaling_dim={1 if local._block_2d else 2})) as it was saved")
            raise ValueError(
                f"{where}: the checkpoint holds no block scales for {name!r}, a block-scaled FP8 "
                f"param ({form}) here: it was saved from a tensorwise-FP8 or high-precision "
                "model; build the model as it was saved (or without fp8_model_init and load "
                "the values)")
        if isinstance(local, Float8Tensor) and mine:
            raise ValueError(
                f"{where}: the checkpoint holds {name!r} as a block-scaled FP8 param "
                "(Float8BlockScaling), this model's is a tensorwise FP8 param; build it under "
                "fp8_model_init(recipe=Float8BlockScaling(...)) as it was saved, or without "
                "fp8_model_init to load the values")


def _fp8_modules(model: torch.nn.Module):
    from ..modules.base import FP8Module
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]


def _attn_modules(model: torch.nn.Module):
    from ..attention.dot_product_attention import DotProductAttention
    return [(name, m) for name, m in model.named_modules() if isinstance(m, DotProductAttention)]


def _prepare_fp8_meta(model: torch.nn.Module, fp8_recipe) -> None:
    for name, m in _fp8_modules(model):
        if m.fp8_meta.recipe is None and fp8_recipe is not None:
            device = next((p.device for p in m.parameters()), torch.device("cpu"))
            m.fp8_meta.prepare(fp8_recipe, device)
    if isinstance(fp8_recipe, DelayedScaling):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for name, m in _attn_modules(model):
            attn_fp8.prepare(m, fp8_recipe, device)


def _reduce_pending_amaxes(model: torch.nn.Module, amax_group) -> None:
    """Row 0 of the amax histories holds amaxes not reduced yet (e.g. the weight shard amaxes
    the optimizer just recorded); DCP saves one copy of a replicated tensor, so reduce them
    now, in one all-reduce (MAX): the next update would reduce them the same way."""
    histories = [st.amax_history for _, m in _fp8_modules(model)
                 for st in (m.fp8_meta.fwd, m.fp8_meta.bwd) if st is not None]
    histories += [st.amax_history for _, m in _attn_modules(model)
                  for st in (m.fp8_attn_state, m.fp8_out_state) if st is not None]
    reduce_amax_rows(histories, amax_group)


def get_state_dict(model: torch.nn.Module, optimizers=(), *, fp8_recipe=None, amax_group=None,
                   options: Optional[StateDictOptions] = None) -> dict:
    """{"model": model state, "optim": optimizer state}, ready for `dcp.save` / `dcp.load`.

    For loading, call it on the freshly built (sharded) model and optimizer: the dict is the
    template DCP loads into. `fp8_recipe` prepares the FP8 state of modules that have not run
    under FP8 yet (pass the recipe the checkpoint was trained with). `amax_group`: the
    fp8_group of training (default: the default group); pending amaxes are reduced over it."""
    _prepare_fp8_meta(model, fp8_recipe)
    _reduce_pending_amaxes(model, amax_group)
    model_sd, optim_sd = _torch_get_state_dict(model, optimizers, options=options)
    state = {"model": {k: _savable(v) for k, v in model_sd.items()}, "optim": optim_sd}
    blocks = {k: parts for k, v in model_sd.items() if (parts := _block_parts(v)) is not None}
    if blocks:
        state[BLOCKS] = blocks
    return state


@torch.no_grad()
def set_state_dict(model: torch.nn.Module, optimizers, state_dict: dict, *,
                   options: Optional[StateDictOptions] = None) -> None:
    """Load {"model", "optim"} (as filled by `dcp.load`) into the model and optimizers."""
    if not isinstance(state_dict, dict) or "model" not in state_dict:
        raise ValueError("set_state_dict: state_dict must be the dict made by "
                         "tritium.distributed.checkpointing.get_state_dict ({'model', 'optim'})")
    model_sd = state_dict["model"]
    blocks = state_dict.get(BLOCKS, {})
    _check_blocks(model, {f"{k}.{n}" for k, parts in blocks.items() for n in parts},
                  "set_state_dict")
    _torch_set_state_dict(model, optimizers, model_state_dict=model_sd,
                          optim_state_dict=state_dict.get("optim", {}), options=options)
    # FP8 params were quantized with the scale they had before the module's extra_state was
    # loaded; quantize them again with the loaded scale.
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        value = model_sd.get(name)
        if isinstance(local, Float8Tensor) and isinstance(value, torch.Tensor):
            v = value._local_tensor if isinstance(value, DTensor) else value
            local.copy_(v)   # its transpose follows (Float8Tensor.data_written)
        elif isinstance(local, Float8BlockTensor) and isinstance(value, torch.Tensor):
            local.load_checkpoint_(_local(value), {n: _local(t) for n, t in blocks[name].items()})


def _saved_keys(checkpoint_id) -> Optional[set]:
    """The checkpoint's (flattened) keys, or None for a storage other than a file system
    (then DCP reports what does not match)."""
    try:
        return set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    except Exception:
        return None


def _check_fp8_templates(model: torch.nn.Module, keys: set) -> None:
    """A clear error before DCP's, for a module whose FP8 state is saved but has no template."""
    for name, m in _fp8_modules(model):
        tag = f"model.{name}._extra_state." if name else "model._extra_state."
        if m.fp8_meta.recipe is None and any(k.startswith(tag) for k in keys):
            raise ValueError(f"load: the checkpoint holds FP8 state for module {name!r}, which has "
                             "none yet; pass fp8_recipe= (the recipe it was trained with) so its "
                             "state can be loaded")
    for name, m in _attn_modules(model):
        tag = f"model.{name}._extra_state" if name else "model._extra_state"
        if m.fp8_attn_state is None and any(k.startswith(tag + ".") for k in keys):
            raise ValueError(f"load: the checkpoint holds an FP8 attention state for module "
                             f"{name!r}, which has none yet; pass fp8_recipe= (the "
                             "DelayedScaling(fp8_dpa=True) recipe it was trained with) so its "
                             "state can be loaded")


def _match_attn_templates(model: torch.nn.Module, keys: set, template: dict) -> None:
    """An attention state the checkpoint lacks (written before attention modules saved one, or
    saved None) leaves the template: the module then loads None and starts fresh."""
    for name, m in _attn_modules(model):
        key = f"{name}._extra_state" if name else "_extra_state"
        if m.fp8_attn_state is None:
            continue
        if any(k.startswith(f"model.{key}.") for k in keys):
            if f"model.{key}.o_scale" not in keys and isinstance(template.get(key), dict):
                # saved without fp8_mha: the output's state starts fresh
                template[key].pop("o_scale", None)
                template[key].pop("o_amax_history", None)
            continue
        if f"model.{key}" in keys:
            template[key] = None
        else:
            template.pop(key, None)


def save(checkpoint_id, model: torch.nn.Module, optimizers=(), *, amax_group=None,
         **kwargs) -> None:
    """dcp.save of get_state_dict(model, optimizers) (every rank calls it)."""
    dcp.save(get_state_dict(model, optimizers, amax_group=amax_group),
             checkpoint_id=checkpoint_id, **kwargs)


def load(checkpoint_id, model: torch.nn.Module, optimizers=(), *, fp8_recipe=None,
         **kwargs) -> None:
    """dcp.load into the (sharded) model and optimizers, at any world size (every rank calls
    it). See get_state_dict for fp8_recipe."""
    keys = _saved_keys(checkpoint_id)
    if keys is not None:     # before anything changes (get_state_dict prepares and reduces)
        head = BLOCKS + "."
        _check_blocks(model, {k[len(head):] for k in keys if k.startswith(head)}, "load")
    state = get_state_dict(model, optimizers, fp8_recipe=fp8_recipe)
    if keys is not None:
        _check_fp8_templates(model, keys)
        _match_attn_templates(model, keys, state["model"])
    dcp.load(state, checkpoint_id=checkpoint_id, **kwargs)
    set_state_dict(model, optimizers, state)


__all__ = ["get_state_dict", "set_state_dict", "save", "load"]
