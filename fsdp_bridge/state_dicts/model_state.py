"""Model state dicts of a model sharded by our engine, in torch's distributed-checkpoint form.

[Note: sharded state dicts are DTensors over the rows]
The engine keeps, per rank, a contiguous range of each unit's flat fp32 buffer, so a rank's
piece of a parameter is an arbitrary range of its flattened elements (it may start and end in
the middle of a row). torch.distributed.checkpoint (DCP) can only reshard what it can describe
as boxes with offsets, and its state-dict helpers (`_state_dict_utils`) treat anything that is
neither a DTensor nor a ShardedTensor as a *full, replicated* tensor: handed our 1-D pieces
as they are, `get_model_state_dict(full_state_dict=True)` returns rank-local fragments as if
they were whole, and `dcp.save` keeps one rank's fragment of each and drops the rest, silently.

We considered three ways of giving DCP offsets:
- our own objects implementing DCP's chunk protocol (`__create_write_items__`, up to three
  boxes per piece): no copy, no communication, but `_state_dict_utils._gather_state_dict`,
  `broadcast_from_rank0` and every user who calls `.full_tensor()` would not understand them;
- ShardedTensors with several shards per rank: DCP understands them, but torch's gather of a
  ShardedTensor assumes FSDP1's one-shard-per-rank dim-0 layout and returns garbage for ours,
  and ShardedTensor is deprecated;
- DTensors sharded on dim 0 (torch.chunk of the rows over the shard group, replicated over
  the replicate group): exactly what native FSDP2 returns, so `full_tensor()`,
  `_gather_state_dict`, `broadcast_from_rank0`, DCP resharding and checkpoints written by
  native FSDP2 (and by native FSDP1's SHARDED_STATE_DICT, whose ShardedTensors DCP stores as
  the same row chunks) all work unchanged.
We take the third, least surprising one. Its price, paid by FSDP1's SHARDED_STATE_DICT too:
the rows a rank reports are not the elements it holds, so producing the state dict all-gathers
one flat group at a time (peak memory: one group in full) and loading gathers each value
before slicing this rank's range out of it. The values are copies: load them back with
`set_model_state_dict` (or `model.load_state_dict`, or a DCP `Stateful`), as DCP's docs do.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.state_dicts.parts import Entry, entries, find_parts, mesh_of, world_rank


def _dtensor_types():
    from torch.distributed.tensor import DTensor

    return DTensor


def _sharded_tensor_type():
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return ()
    return ShardedTensor


def to_dtensor(full: torch.Tensor, mesh) -> torch.Tensor:
    """`full` presented as native FSDP2 would: rows chunked over the mesh's last dim."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    last = Shard(0) if full.dim() > 0 else Replicate()
    placements = [Replicate()] * (mesh.ndim - 1) + [last]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape,
                              stride=full.contiguous().stride(), run_check=False)


def global_shape(value: Any) -> Optional[tuple]:
    if isinstance(value, _sharded_tensor_type()):
        return tuple(value.size())
    if torch.is_tensor(value):
        return tuple(value.shape)  # a DTensor's shape is its global shape
    return None


def to_full(value: Any) -> torch.Tensor:
    """The whole value of a state-dict entry (a collective for DTensors/ShardedTensors)."""
    if isinstance(value, _dtensor_types()):
        return value.full_tensor()
    if isinstance(value, _sharded_tensor_type()):
        # Any layout: every element is held by exactly one shard; sum the placed pieces.
        full = torch.zeros(value.size(), dtype=value.metadata().tensor_properties.dtype)
        for shard in value.local_shards():
            box = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                         shard.metadata.shard_sizes))
            full[box] = shard.tensor.to(full.device)
        dist.all_reduce(full, group=value._process_group)
        return full
    return value


def get_model_state_dict(model: nn.Module, *, full_state_dict: bool = False,
                         cpu_offload: bool = False, ignore_frozen_params: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Every key of the unwrapped model. Sharded (default): parameters as DTensors (see
    [Note: sharded state dicts are DTensors over the rows]); full: plain fp32 tensors, on rank 0
    only when `cpu_offload` (torch's convention). A collective: every rank must call it."""
    parts = find_parts(model)
    ents = entries(model, parts)
    held = {id(entry.group) for entry in ents if entry.part is not None}
    values: dict[int, torch.Tensor] = {}
    for part in parts:
        mesh = None if full_state_dict else mesh_of(part.sharded)
        for group in part.sharded.flat_groups():
            if id(group) not in held:  # none of its parameters is in `model` (a unit's)
                continue
            flat = group.gather_full_master()
            for index, (_, value) in enumerate(group.split(flat)):
                value = value.clone() if mesh is None else to_dtensor(value, mesh)
                values[id(group.local_params[index])] = value
            del flat
    if full_state_dict and cpu_offload and world_rank() != 0:
        return {}
    result = {}
    for entry in ents:
        if entry.part is not None:
            if ignore_frozen_params and not entry.group.requires_grad:
                continue
            value = values[id(entry.tensor)]
        else:
            if ignore_frozen_params and not entry.is_buffer and not entry.tensor.requires_grad:
                continue
            value = entry.tensor.detach().clone()
            if entry.dtype is not None:
                value = value.to(entry.dtype)
        result[entry.key] = value.cpu() if cpu_offload else value
    return result


# -- loading ------------------------------------------------------------------------------------


def _expected_shape(entry: Entry) -> tuple:
    if entry.part is not None:
        return tuple(entry.group.slots[entry.index].shape)
    return tuple(entry.tensor.shape)


def check_against_model(ents: list[Entry], shapes: dict[str, Optional[tuple]],
                        strict: bool, what: str = "state dict") -> tuple[list, list]:
    """Raise a ValueError naming every missing/unexpected key (strict) and every wrong shape;
    return (missing, unexpected)."""
    keys = {e.key for e in ents}
    missing = [e.key for e in ents if e.key not in shapes]
    unexpected = [k for k in shapes if k not in keys]
    problems = []
    if strict and missing:
        problems.append(f"missing keys ({len(missing)}): {_show(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_show(unexpected)}")
    wrong = []
    for entry in ents:
        shape = shapes.get(entry.key)
        if entry.key in shapes and shape is not None and shape != _expected_shape(entry):
            wrong.append(f"{entry.key}: {shape} in the {what}, {_expected_shape(entry)} in the "
                         "model")
    if wrong:
        problems.append(f"wrong shapes ({len(wrong)}): {_show(wrong)}")
    if problems:
        raise ValueError(f"the {what} does not match the model: " + "; ".join(problems)
                         + ". Load a checkpoint of this model (same architecture and config), "
                         "or pass strict=False to load only the keys both have.")
    return missing, unexpected


def _show(items: list, limit: int = 8) -> str:
    shown = ", ".join(repr(i) if not isinstance(i, str) or ":" not in i else i
                      for i in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def set_model_state_dict(model: nn.Module, state_dict: dict, *, strict: bool = True,
                         broadcast_from_rank0: bool = False):
    """Load full tensors, DTensors (any placement, any world size they were saved at) or
    ShardedTensors into the sharded model. Everything is checked before anything is written.
    With `broadcast_from_rank0`, only rank 0's `state_dict` is read. A collective."""
    parts = find_parts(model)
    ents = entries(model, parts)
    if broadcast_from_rank0:
        return _load_broadcast(parts, ents, state_dict, strict)
    shapes = {k: global_shape(v) for k, v in state_dict.items()}
    missing, unexpected = check_against_model(ents, shapes, strict)
    with torch.no_grad():
        _load_groups(parts, ents, state_dict, source=lambda key: to_full(state_dict[key]))
        for entry in ents:
            if entry.part is None and entry.key in state_dict:
                entry.tensor.copy_(to_full(state_dict[entry.key]))
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _keys_by_piece(ents: list[Entry]) -> dict[int, list[str]]:
    """id(local piece) -> every key it is saved under (tied weights have several): the keys
    checked against the state dict are the keys loaded, by construction."""
    keys: dict[int, list[str]] = {}
    for entry in ents:
        if entry.part is not None:
            keys.setdefault(id(entry.tensor), []).append(entry.key)
    return keys


def _load_groups(parts, ents, present, source, broadcast: bool = False) -> None:
    """Lay each group's values, read with `source(key)`, into a full flat buffer and keep this
    rank's range. With `broadcast`, only rank 0 reads `source` and sends the buffer."""
    keys = _keys_by_piece(ents)
    for part in parts:
        for group in part.sharded.flat_groups():
            names = [next((k for k in keys.get(id(param), ()) if k in present), None)
                     for param in group.local_params]
            if all(name is None for name in names):
                continue
            if all(name is not None for name in names):
                flat = torch.zeros(group.padded_numel, dtype=group.master.dtype,
                                   device=group.device)
            else:  # keep the current values of what the state dict lacks
                flat = group.gather_full_master()
            if not broadcast or world_rank() == 0:
                for name, (_, view) in zip(names, group.split(flat)):
                    if name is not None:
                        view.copy_(source(name).reshape(view.shape))
            if broadcast:
                dist.broadcast(flat, src=0)
            group.load_full_master(flat)


def _load_broadcast(parts, ents, state_dict, strict):
    """Rank 0 checks and sends; every rank keeps its range."""
    message = [None, None]
    if world_rank() == 0:
        shapes = {k: global_shape(v) for k, v in state_dict.items()}
        try:
            result = check_against_model(ents, shapes, strict)
            message = [None, (sorted(k for k in shapes), result)]
        except ValueError as exc:
            message = [str(exc), None]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise ValueError(message[0])
    present, (missing, unexpected) = set(message[1][0]), message[1][1]
    with torch.no_grad():
        _load_groups(parts, ents, present, lambda key: to_full(state_dict[key]),
                     broadcast=True)
        for entry in ents:
            if entry.part is None and entry.key in present:
                value = entry.tensor.detach().clone()
                if world_rank() == 0:
                    value.copy_(to_full(state_dict[entry.key]))
                dist.broadcast(value, src=0)
                entry.tensor.copy_(value)
    return nn.modules.module._IncompatibleKeys(missing, unexpected)
