"""Full state dicts of a sharded model: original names, fp32 masters, every key the unwrapped
model's `state_dict()` has (tied weights under each of their names), in the same order.

Names come from the modules' own `state_dict()` (their hooks included: torch's activation-
checkpointing wrappers drop their inner child's name there, as native FSDP1 does), never from
the paths recorded at wrap time, which may differ from them: a wrapper inserted before the wrap
is in the recorded paths, one inserted after is not. The engine's parameters are found among
the module's tensors by identity."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fsdp_bridge.engine.layout import state_dict_key
from fsdp_bridge.engine.runtime import ShardedModel


def _unwrapped_entries(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    # nn.Module's own state_dict: the keys and order of the unwrapped model (wrappers may
    # override state_dict on the root, so call the base implementation). keep_vars: the
    # tensors the modules hold, the engine's local pieces among them.
    return nn.Module.state_dict(sharded.module, keep_vars=True)


def _buffer_dtypes(sharded: ShardedModel) -> dict[str, torch.dtype]:
    """The dtype to report per buffer key (buffers the engine keeps in another dtype)."""
    return {state_dict_key(name): dtype for name, dtype in sharded.buffer_dtypes.items()}


def _saved_copy(key: str, held: torch.Tensor, dtypes: dict[str, torch.dtype]) -> torch.Tensor:
    """A copy of what the model holds under `key`, in the dtype it reports (see
    `_buffer_dtypes`)."""
    value = held.detach().clone()
    return value.to(dtypes[key]) if key in dtypes else value


def full_state_dict(
    sharded: ShardedModel, rank0_only: bool = False, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """Every rank takes part in the gathers; with `rank0_only` the others return {}."""
    full_values: dict[int, torch.Tensor] = {}  # id(local parameter) -> its full value
    for group in sharded.flat_groups():
        flat = group.gather_full_master()
        for param, (_, view) in zip(group.local_params, group.split(flat)):
            full_values[id(param)] = view.clone()
    if rank0_only and sharded.comm.world_rank != 0:
        return {}
    dtypes = _buffer_dtypes(sharded)
    result = {}
    for key, held in _unwrapped_entries(sharded).items():
        value = full_values.get(id(held))
        if value is None:  # a buffer or an ignored parameter: every rank holds it whole
            value = _saved_copy(key, held, dtypes)
        result[key] = value.cpu() if cpu_offload else value
    return result


def load_full_state_dict(
    sharded: ShardedModel, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a full state dict (as `full_state_dict` returns) into the sharded model."""
    entries = _unwrapped_entries(sharded)
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
        for group in sharded.flat_groups():
            _load_group(group, state_dict, names)
        load_unmanaged(unmanaged_entries(sharded, entries), state_dict)


def unmanaged_entries(sharded: ShardedModel, entries: Optional[dict] = None
                      ) -> dict[str, torch.Tensor]:
    """The model's state-dict entries (`entries`, when already read) the engine does not
    shard (buffers, ignored parameters: whole on every rank), by key."""
    managed = {id(param) for group in sharded.flat_groups() for param in group.local_params}
    entries = _unwrapped_entries(sharded) if entries is None else entries
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
    for key, held in _unwrapped_entries(sharded).items():
        result[key] = _saved_copy(key, held, dtypes)
    return result


def load_sharded_state_dict(sharded: ShardedModel, state_dict: dict, strict: bool = True) -> None:
    entries = _unwrapped_entries(sharded)
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
