"""Full state dicts of a sharded model: original names, fp32 masters, every key the unwrapped
model's `state_dict()` has (tied weights under each of their names), in the same order.

Names come from the modules' own `state_dict()` (their hooks included: torch's activation-
checkpointing wrappers drop their inner child's name there, as native FSDP1 does), never from
the paths recorded at wrap time, which may differ from them: a wrapper inserted before the wrap
is in the recorded paths, one inserted after is not. The engine's parameters are found among
the module's tensors by identity.

[Note: reading what the modules hold]
A front-end may put wrapper modules of its own inside the sharded model, one above each unit
(FSDP1's nested instances), whose `state_dict()` gathers full values when a user calls it.
While the engine reads the keys and the tensors the modules hold (`held_entries`),
`reading_held_tensors()` is true: such a wrapper then answers as the module it wraps would,
under the same prefix. Every function here takes an optional `module`, a module of the sharded
model (a unit's, say): the state dict is then that module's, keys relative to it, and only the
flat groups it holds pieces of are gathered."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from torch import nn

from fsdp_bridge.engine.flat_params import originals_registered
from fsdp_bridge.engine.layout import state_dict_key
from fsdp_bridge.engine.runtime import ShardedModel

_READING = threading.local()


def reading_held_tensors() -> bool:
    """Whether the engine is reading what the modules hold (see [Note: reading what the
    modules hold])."""
    return getattr(_READING, "depth", 0) > 0


@contextlib.contextmanager
def _reading_held():
    _READING.depth = getattr(_READING, "depth", 0) + 1
    try:
        yield
    finally:
        _READING.depth -= 1


def held_entries(sharded: ShardedModel, module: Optional[nn.Module] = None
                 ) -> dict[str, torch.Tensor]:
    """Key -> tensor held, for every key `module` (default: the sharded model) gives in its
    state dict, with the original parameters in place (see [Note: flat parameters] in
    flat_params.py)."""
    # nn.Module's own state_dict: the keys and order of the unwrapped model (wrappers may
    # override state_dict on the root, so call the base implementation). keep_vars: the
    # tensors the modules hold, the engine's local pieces among them.
    with _reading_held(), originals_registered(sharded):
        return nn.Module.state_dict(sharded.module if module is None else module,
                                    keep_vars=True)


def groups_holding(sharded: ShardedModel, entries: dict[str, torch.Tensor]) -> list:
    """The flat groups (in the model's order, the same on every rank) that hold a piece of
    one of `entries`' tensors."""
    held = {id(tensor) for tensor in entries.values()}
    return [group for group in sharded.flat_groups()
            if any(id(param) in held for param in group.local_params)]


def _buffer_dtypes(sharded: ShardedModel) -> dict[str, torch.dtype]:
    """The dtype to report per buffer key (buffers the engine keeps in another dtype)."""
    return {state_dict_key(name): dtype for name, dtype in sharded.buffer_dtypes.items()}


def _saved_copy(key: str, held: torch.Tensor, dtypes: dict[str, torch.dtype]) -> torch.Tensor:
    """A copy of what the model holds under `key`, in the dtype it reports (see
    `_buffer_dtypes`)."""
    value = held.detach().clone()
    return value.to(dtypes[key]) if key in dtypes else value


def full_state_dict(
    sharded: ShardedModel, rank0_only: bool = False, cpu_offload: bool = True,
    module: Optional[nn.Module] = None,
) -> dict[str, torch.Tensor]:
    """Every rank takes part in the gathers; with `rank0_only` the others return {}."""
    entries = held_entries(sharded, module)
    full_values: dict[int, torch.Tensor] = {}  # id(local parameter) -> its full value
    for group in groups_holding(sharded, entries):
        flat = group.gather_full_master()
        for param, (_, view) in zip(group.local_params, group.split(flat)):
            full_values[id(param)] = view.clone()
    if rank0_only and sharded.comm.world_rank != 0:
        return {}
    dtypes = _buffer_dtypes(sharded)
    result = {}
    for key, held in entries.items():
        value = full_values.get(id(held))
        if value is None:  # a buffer or an ignored parameter: every rank holds it whole
            value = _saved_copy(key, held, dtypes)
        result[key] = value.cpu() if cpu_offload else value
    return result


def load_full_state_dict(
    sharded: ShardedModel, state_dict: dict[str, torch.Tensor], strict: bool = True,
    module: Optional[nn.Module] = None,
) -> None:
    """Load a full state dict (as `full_state_dict` returns) into the sharded model (or into
    its `module`)."""
    entries = held_entries(sharded, module)
    missing = [key for key in entries if key not in state_dict]
    unexpected = [key for key in state_dict if key not in entries]
    if strict and (missing or unexpected):
        raise ValueError(
            "load_full_state_dict: state_dict does not match the model: "
            f"missing keys {missing[:10]}{'...' if len(missing) > 10 else ''}, "
            f"unexpected keys {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}. "
            "Pass a full state dict of the same model (or strict=False to load the overlap)."
        )
    names = _names_by_tensor(entries)
    with torch.no_grad():
        for group in groups_holding(sharded, entries):
            _load_group(group, state_dict, names)
        load_unmanaged(unmanaged_entries(sharded, entries), state_dict)


def unmanaged_entries(sharded: ShardedModel, entries: Optional[dict] = None
                      ) -> dict[str, torch.Tensor]:
    """The model's state-dict entries (`entries`, when already read) the engine does not
    shard (buffers, ignored parameters: whole on every rank), by key."""
    managed = {id(param) for group in sharded.flat_groups() for param in group.local_params}
    entries = held_entries(sharded) if entries is None else entries
    return {key: held for key, held in entries.items() if id(held) not in managed}


def load_unmanaged(unmanaged: dict[str, torch.Tensor], state_dict: dict) -> None:
    """Copy the values of `state_dict` for the `unmanaged` entries (see `unmanaged_entries`)
    into the model, checking their shapes."""
    for key, current in unmanaged.items():
        if key in state_dict:
            _check_shape(key, state_dict[key], current.shape)
            current.copy_(state_dict[key])


def _names_by_tensor(entries: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """id(tensor) -> every key it is saved under (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for key, tensor in entries.items():
        names.setdefault(id(tensor), []).append(key)
    return names


def _check_shape(key: str, value: torch.Tensor, shape) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict "
            f"but {tuple(shape)} in the model. Load a checkpoint of the same model."
        )


def _load_group(group, state_dict, names: dict[int, list[str]]) -> None:
    current = group.gather_full_master()
    for param, (slot, view) in zip(group.local_params, group.split(current)):
        key = next((name for name in names.get(id(param), ()) if name in state_dict), None)
        if key is None:
            continue  # strict mode already refused missing keys
        value = state_dict[key]
        _check_shape(key, value, slot.shape)
        view.copy_(value)
    group.load_full_master(current)


# -- sharded (local) state dicts --------------------------------------------------------------------


def sharded_state_dict(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """This rank's shards under the original names (1-D local slices of each parameter's flat
    range; buffers and ignored parameters whole). No collectives; reload it with
    `load_sharded_state_dict` at the same world size and layout."""
    dtypes = _buffer_dtypes(sharded)
    result = {}
    for key, held in held_entries(sharded).items():
        result[key] = _saved_copy(key, held, dtypes)
    return result


def load_sharded_state_dict(sharded: ShardedModel, state_dict: dict, strict: bool = True) -> None:
    entries = held_entries(sharded)
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries]
    if strict and (missing or unexpected):
        raise ValueError(
            f"load_sharded_state_dict: missing keys {missing[:10]}, unexpected keys "
            f"{unexpected[:10]}. Load a sharded state dict saved by the same model."
        )
    with torch.no_grad():
        for key, current in entries.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(current.shape):
                raise ValueError(
                    f"load_sharded_state_dict: {key!r} has shape {tuple(value.shape)} but this "
                    f"rank's shard has {tuple(current.shape)}: a sharded state dict loads only "
                    "at the world size and wrapping it was saved with; use a full state dict "
                    "to change either."
                )
            current.copy_(value)
    for group in sharded.flat_groups():
        group.invalidate()
