"""FSDP1's LOCAL_STATE_DICT of a sharded model: each flat group's shard as this rank holds it.

[Note: LOCAL_STATE_DICT keys are ours, not native FSDP1's]
Native FSDP1 saves one `ShardedTensor` per wrapper under `<wrapper path>._flat_param`: the
wrapper's FlatParameter, torch's own packing of its parameters. Our flat groups pack a unit's
parameters by dtype and requires_grad, with our own padding, so a native flat parameter and
ours need not hold the same elements in the same places even where their sizes agree. Loading
one as the other would be silently wrong, so our keys differ by name (`<unit path>.` +
`LOCAL_KEY` + `.<group index>`) and a native `_flat_param` key is refused by name.
Values are ShardedTensors over the shard group, as native's: the group's parameters, flat,
without padding, of which this rank holds the piece at its shard offset (no piece at all when
its shard is only padding). With a one-rank shard group the value is the plain flat tensor
(FSDP1's front-end gives the full state dict there instead, as native FSDP1 does). Buffers
and parameters the engine does not shard are kept whole under their names. Such a dict
loads back only into the same model, wrapped the same way, at the same world size (the
offsets are checked); FULL_STATE_DICT or SHARDED_STATE_DICT move between layouts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM

from fsdp_bridge.engine.layout import state_dict_key
from fsdp_bridge.engine.runtime import ShardedModel
from fsdp_bridge.engine.state_dict import (
    _buffer_dtypes,
    _check_shape,
    _saved_copy,
    held_entries,
    load_unmanaged,
    unmanaged_entries,
)

LOCAL_KEY = "_bridge_flat_param"


def _local_keys(sharded: ShardedModel, module: Optional[nn.Module] = None) -> dict:
    """key -> flat group, for the units of the model (or inside `module`, the module of one of
    its units, keys relative to it), in module order (the outer unit first), as native FSDP1
    lists its flat parameters."""
    top = sharded.module if module is None else module
    order = {id(sub): index for index, sub in enumerate(top.modules())}
    base = next(unit.name for unit in sharded.units if unit.module is top)
    keys = {}
    for unit in sorted((u for u in sharded.units if id(u.module) in order),
                       key=lambda unit: order[id(unit.module)]):
        name = unit.name[len(base) + 1:] if base else unit.name
        # Without activation checkpointing's child, as native FSDP1 names its flat parameters.
        prefix = state_dict_key(f"{name}.") if name else ""
        for index, group in enumerate(unit.groups):
            keys[f"{prefix}{LOCAL_KEY}.{index}"] = group
    return keys


def _valid_range(group) -> tuple[int, int]:
    """(start in the unpadded flat parameters, element count) of this rank's shard."""
    start = min(group.shard_start, group.numel)
    return start, min(group.shard_numel, group.numel - start)


def local_state_dict(sharded: ShardedModel, cpu_offload: bool = False,
                     module: Optional[nn.Module] = None) -> dict:
    """Every rank's LOCAL state dict (see [Note: LOCAL_STATE_DICT keys are ours]), of the model
    or of one unit's `module`. Building a ShardedTensor is a collective over the shard group:
    call it on every rank."""
    result = {}
    for key, group in _local_keys(sharded, module).items():
        start, count = _valid_range(group)
        piece = group.master.detach()[:count]
        if cpu_offload:
            piece = piece.cpu()
        if group.comm.shard_size == 1:
            result[key] = piece
            continue
        shards = [Shard.from_tensor_and_offsets(piece, [start], group.comm.shard_rank)] if count else []
        result[key] = init_from_local_shards(shards, group.numel,
                                             process_group=group.comm.shard_group)
    dtypes = _buffer_dtypes(sharded)
    for key, held in unmanaged_entries(sharded, held_entries(sharded, module)).items():
        value = _saved_copy(key, held, dtypes)
        result[key] = value.cpu() if cpu_offload else value
    return result


def _refuse_native(state_dict: dict) -> None:
    native = [key for key in state_dict if key.split(".")[-1] == FLAT_PARAM]
    if native:
        raise ValueError(
            f"load_state_dict under LOCAL_STATE_DICT: key {native[0]!r} is a native torch FSDP1 "
            "flat parameter (LOCAL_STATE_DICT of torch.distributed.fsdp). Its packing is torch's, "
            "not fsdp_bridge's, so it cannot be loaded here without loading wrong values. Save it "
            "from torch's FSDP1 under FULL_STATE_DICT or SHARDED_STATE_DICT and load that form.")


def _local_piece(key: str, value, group) -> torch.Tensor:
    """The part of `value` this rank loads into `group`, checked against our layout."""
    start, count = _valid_range(group)
    if group.comm.shard_size == 1 and torch.is_tensor(value) and not isinstance(value, ShardedTensor):
        _check_shape(key, value, (group.numel,))
        return value
    if not isinstance(value, ShardedTensor):
        raise ValueError(
            f"load_state_dict under LOCAL_STATE_DICT: {key!r} is a {type(value).__name__}; "
            "expected the ShardedTensor that state_dict() gave under LOCAL_STATE_DICT. Load the "
            "local state dict of this model as it was saved.")
    shards = value.local_shards()
    got = [(s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]) for s in shards]
    want = [(start, count)] if count else []
    if tuple(value.size()) != (group.numel,) or got != want:
        raise ValueError(
            f"load_state_dict under LOCAL_STATE_DICT: {key!r} holds {tuple(value.size())} "
            f"elements with this rank's (offset, size) {got}; this model's group holds "
            f"({group.numel},) with {want}. A local state dict loads only into the same model "
            "wrapped the same way at the same world size; use SHARDED_STATE_DICT or "
            "FULL_STATE_DICT to change either.")
    return shards[0].tensor if shards else torch.empty(0)


def _mismatch(missing: list, unexpected: list) -> ValueError:
    return ValueError(
        "load_state_dict under LOCAL_STATE_DICT: the state dict does not match the model: "
        f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}. Load the local "
        "state dict of this model (or pass strict=False to load the overlap).")


def load_local_state_dict(sharded: ShardedModel, state_dict: dict, strict: bool = True,
                          module: Optional[nn.Module] = None):
    """Load what `local_state_dict` gave (same model, layout and world size), into the model
    or one unit's `module`. Returns the (missing, unexpected) keys; with `strict`, any of them
    is an error."""
    _refuse_native(state_dict)
    groups = _local_keys(sharded, module)
    unmanaged = unmanaged_entries(sharded, held_entries(sharded, module))
    expected = list(groups) + list(unmanaged)
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if strict and (missing or unexpected):
        raise _mismatch(missing, unexpected)
    pieces = {key: _local_piece(key, state_dict[key], group)
              for key, group in groups.items() if key in state_dict}
    with torch.no_grad():
        for key, piece in pieces.items():
            group = groups[key]
            group.master[: piece.numel()].copy_(piece)
            group.invalidate()
        load_unmanaged(unmanaged, state_dict)
    return missing, unexpected
