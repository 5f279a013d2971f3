"""FSDP1's full optimizer state dicts of a sharded model (`FSDP.optim_state_dict` and
`optim_state_dict_to_load`): original names, full values."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_bridge.engine.runtime import ShardedModel
from fsdp_bridge.engine.state_dict import held_entries


def _param_index(sharded: ShardedModel):
    """id(local param) -> (group, index in group)."""
    return {
        id(param): (group, index)
        for unit in sharded.units
        for group in unit.groups
        for index, param in enumerate(group.local_params)
    }


def full_optim_state_dict(sharded: ShardedModel, optimizer, rank0_only: bool = False) -> dict:
    """The optimizer's state with every per-parameter tensor gathered to the parameter's full
    shape, keyed by the parameter's FQN (FSDP1's FULL optim state dict). A collective."""
    fqn_of = {}
    state: dict[str, dict] = {}
    for group in sharded.flat_groups():
        for slot, param in zip(group.slots, group.local_params):
            fqn_of[id(param)] = slot.state_key
        first = optimizer.state.get(group.local_params[0], {})
        keys = sorted(
            k for k, v in first.items()
            if torch.is_tensor(v) and v.shape == group.local_params[0].shape and v.dim() > 0
        )
        for slot, param in zip(group.slots, group.local_params):
            if param in optimizer.state:
                state[slot.state_key] = {
                    k: (v.clone() if torch.is_tensor(v) else v)
                    for k, v in optimizer.state[param].items() if k not in keys
                }
        for key in keys:
            local = torch.zeros_like(group.master, dtype=first[key].dtype)
            for index, param in enumerate(group.local_params):
                lo, hi = group.local_range(index)
                value = optimizer.state.get(param, {}).get(key)
                if value is not None:
                    local[lo:hi] = value
            full = group.gather_full(local)
            for slot, value in group.split(full):
                if slot.state_key in state:
                    state[slot.state_key][key] = value.clone()
    # Parameters the engine does not shard (ignored modules / states): whole on every rank,
    # their state is kept as it is, under their FQN (as FSDP1's).
    for name, param in _unmanaged_names(sharded, fqn_of).items():
        if param in optimizer.state:
            state[name] = {k: (v.clone() if torch.is_tensor(v) else v)
                           for k, v in optimizer.state[param].items()}
            fqn_of[id(param)] = name
    param_groups = []
    for pg in optimizer.param_groups:
        entry = {k: v for k, v in pg.items() if k != "params"}
        entry["params"] = [fqn_of.get(id(p), f"<unmanaged {i}>") for i, p in enumerate(pg["params"])]
        param_groups.append(entry)
    if rank0_only and sharded.comm.world_rank != 0:
        return {}
    return {"state": state, "param_groups": param_groups}


def _unmanaged_names(sharded: ShardedModel, managed) -> dict:
    """Name (as state dicts give it) -> parameter for the parameters of the model the engine
    does not shard."""
    found, seen = {}, set()
    for name, held in held_entries(sharded).items():
        if isinstance(held, nn.Parameter) and id(held) not in managed and id(held) not in seen:
            found[name] = held  # a tied parameter under its first name, as named_parameters()
            seen.add(id(held))
    return found


def optim_state_dict_to_load(sharded: ShardedModel, optimizer, full_osd: dict) -> dict:
    """A full (FQN-keyed) optimizer state dict turned into one this rank's optimizer can
    `load_state_dict`: per-parameter tensors sliced to the local shards. No collectives."""
    where = _param_index(sharded)
    unmanaged = {id(p): name for name, p in _unmanaged_names(sharded, where).items()}
    state: dict[int, dict] = {}
    param_groups = []
    position = 0
    for pg, saved_pg in zip(optimizer.param_groups, full_osd["param_groups"]):
        entry = {k: v for k, v in saved_pg.items() if k != "params"}
        ids = []
        for param in pg["params"]:
            ids.append(position)
            located = where.get(id(param))
            if located is not None:
                group, index = located
                fqn = group.slots[index].state_key
                saved = full_osd["state"].get(fqn)
                if saved is not None:
                    lo, hi = group.local_range(index)
                    start = group.shard_start + lo - group.offsets[index]
                    state[position] = {
                        k: (v.reshape(-1)[start : start + (hi - lo)].clone()
                            if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in saved.items()
                    }
            elif id(param) in unmanaged and unmanaged[id(param)] in full_osd["state"]:
                saved = full_osd["state"][unmanaged[id(param)]]
                state[position] = {k: (v.clone() if torch.is_tensor(v) else v)
                                   for k, v in saved.items()}
            position += 1
        entry["params"] = ids
        param_groups.append(entry)
    return {"state": state, "param_groups": param_groups}
