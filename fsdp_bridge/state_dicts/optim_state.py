"""Optimizer state dicts of a model sharded by our engine, keyed by parameter name, in the
form torch's `get_optimizer_state_dict` gives for native FSDP2:

    {"state": {fqn: {"step": tensor, "exp_avg": DTensor | Tensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

Per-parameter tensors (those shaped like the local shard) are reported with the parameter's
full shape: DTensors over the rows when sharded, plain tensors when full (see
[Note: sharded state dicts are DTensors over the rows] in `model_state`). Everything else
(`step`, scalars) is copied as it is. Loading accepts either form, from any world size, and
also the FSDP1 FULL form (`FSDP.optim_state_dict`, plain full tensors).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.engine import default_device
from fsdp_bridge.engine.device import backends_of, collective_device
from fsdp_bridge.state_dicts import flat_optim
from fsdp_bridge.state_dicts.model_state import global_shape, to_dtensor, to_full
from fsdp_bridge.state_dicts.parts import (
    entries,
    find_parts,
    flat_piece_entries,
    mesh_of,
    world_rank,
)

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


def _init_optim_state(optim) -> None:
    # torch's own lazy-state initialisation (a step with zero gradients and lr 0), so that
    # every rank reports (and can load) the same keys before the first real step.
    from torch.distributed.checkpoint.state_dict import _init_optim_state as init

    init(flat_optim.real(optim))
    if isinstance(optim, flat_optim.PieceView):
        optim.refresh()


def _names(model: nn.Module, parts):
    """id(parameter) -> (canonical name, Entry) for every parameter of the model."""
    named = {}
    for entry in entries(model, parts):
        if not entry.is_buffer and id(entry.tensor) not in named:
            named[id(entry.tensor)] = (entry.key, entry)
    return named


def _per_param_keys(optim, params) -> list[str]:
    keys = set()
    for param in params:
        for key, value in optim.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
                keys.add(key)
    return sorted(keys)


def _check_agreement(signature) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, signature)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise RuntimeError(
                f"optimizer state differs in structure between rank 0 and rank {rank} "
                "(parameters with state, or state keys): every rank must have stepped the "
                "same parameters. Call the state-dict functions on every rank, after the same "
                "number of optimizer steps.")


def get_optimizer_state_dict(model: nn.Module, optimizers: Iterable, *,
                             full_state_dict: bool = False, cpu_offload: bool = False) -> dict:
    parts = find_parts(model)
    named = _names(model, parts)
    result: dict[str, Any] = {STATE: {}, GROUPS: []}
    for optim in map(flat_optim.pieces_of, optimizers):
        _init_optim_state(optim)
        params = [p for pg in optim.param_groups for p in pg[PARAMS]]
        unknown = [i for i, p in enumerate(params) if id(p) not in named]
        if unknown:
            raise ValueError(
                f"the optimizer holds {len(unknown)} parameter(s) (positions {unknown[:5]}) that "
                "are not parameters of the model passed in: pass the model the optimizer was "
                "built on.")
        for pg in optim.param_groups:
            entry = {k: v for k, v in pg.items() if k != PARAMS}
            entry[PARAMS] = [named[id(p)][0] for p in pg[PARAMS]]
            result[GROUPS].append(entry)
        in_optim = {id(p) for p in params}
        _check_agreement([(named[id(p)][0], sorted(optim.state.get(p, {}))) for p in params])
        done = set()
        for part in parts:
            mesh = None if full_state_dict else mesh_of(part.sharded)
            for group in part.sharded.flat_groups():
                mine = [p for p in group.local_params if id(p) in in_optim]
                if mine:
                    _group_state(optim, group, named, mesh, result[STATE])
                    done.update(id(p) for p in mine)
        for param in params:  # parameters the engine does not manage: plain values
            if id(param) in done or param not in optim.state:
                continue
            result[STATE][named[id(param)][0]] = {
                k: (v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in optim.state[param].items()}
    if full_state_dict and cpu_offload and world_rank() != 0:
        return {}
    if cpu_offload:
        result[STATE] = {fqn: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                         for fqn, s in result[STATE].items()}
    return result


def _group_state(optim, group, named, mesh, out: dict) -> None:
    params = group.local_params
    per_param = _per_param_keys(optim, params)
    for param in params:
        if param in optim.state:
            out[named[id(param)][0]] = {
                k: (v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in optim.state[param].items() if k not in per_param}
    for key in per_param:
        sample = next(optim.state[p][key] for p in params
                      if p in optim.state and key in optim.state[p])
        local = torch.zeros(group.shard_numel, dtype=sample.dtype, device=sample.device)
        for index, param in enumerate(params):
            value = optim.state.get(param, {}).get(key)
            if value is not None:
                lo, hi = group.local_range(index)
                local[lo:hi] = value
        full = group.gather_full(local)
        for (_, value), param in zip(group.split(full), params):
            fqn = named[id(param)][0]
            if fqn not in out:
                continue
            out[fqn][key] = value.clone() if mesh is None else to_dtensor(value, mesh)


# -- loading ------------------------------------------------------------------------------------


def set_optimizer_state_dict(model: nn.Module, optimizers: Iterable, state_dict: dict, *,
                             strict: bool = True, broadcast_from_rank0: bool = False) -> None:
    """Load a name-keyed optimizer state dict (full tensors, DTensors of any world size, or
    FSDP1's FULL form) into optimizers over the sharded model. A collective."""
    optimizers = list(optimizers)
    to_load = optimizer_states_to_load(model, optimizers, state_dict, strict=strict,
                                       broadcast_from_rank0=broadcast_from_rank0)
    for optim, local in zip(optimizers, to_load):
        optim.load_state_dict(local)


def optimizer_states_to_load(model: nn.Module, optimizers: Iterable, state_dict: dict, *,
                             strict: bool = True, broadcast_from_rank0: bool = False) -> list:
    """What `set_optimizer_state_dict` loads, one dict per optimizer (keyed by position, this
    rank's pieces), without loading it: an optimizer that had no state yet is left without
    (as native FSDP1's `optim_state_dict_to_load` leaves it). A collective."""
    if broadcast_from_rank0:
        state_dict = broadcast_object_tree(state_dict if world_rank() == 0 else None)
    if STATE not in state_dict or GROUPS not in state_dict:
        raise ValueError(
            "optimizer state dict: expected the keys 'state' and 'param_groups' (the form "
            "get_optimizer_state_dict and FSDP.optim_state_dict return); got keys "
            f"{sorted(state_dict)[:8]}. A flattened state dict "
            "(flatten_optimizer_state_dict=True) is not supported for fsdp_bridge models.")
    parts = find_parts(model)
    named = _names(model, parts)
    saved_state, saved_groups = state_dict[STATE], state_dict[GROUPS]
    model_names = {name for name, _ in named.values()}
    unknown = [fqn for fqn in saved_state if fqn not in model_names]
    if strict and unknown:
        raise ValueError(
            f"optimizer state dict: state for {len(unknown)} parameter(s) the model does not "
            f"have: {unknown[:8]}. Load the optimizer state of this model.")
    optimizers = [flat_optim.pieces_of(optim) for optim in optimizers]
    fresh = [not flat_optim.real(optim).state for optim in optimizers]
    plans = []
    for optim in optimizers:  # check everything before loading anything
        _init_optim_state(optim)
        plans.append(_plan_load(optim, named, saved_state, saved_groups))
    for optim, was_fresh in zip(optimizers, fresh):
        if was_fresh:  # the zero-lr step of `_init_optim_state` made state: drop it
            flat_optim.real(optim).state.clear()
    to_load = []
    for optim, (groups, order) in zip(optimizers, plans):
        state = {}
        with torch.no_grad():
            for position, param, saved in order:
                state[position] = _local_state(param, named[id(param)], saved)
        to_load.append(flat_optim.for_optimizer(optim, {STATE: state, GROUPS: groups}))
    return to_load


def _plan_load(optim, named, saved_state, saved_groups):
    groups, order, position = [], [], 0
    where = {}
    for index, pg in enumerate(saved_groups):
        for fqn in pg[PARAMS]:
            where[fqn] = index
    for pg in optim.param_groups:
        fqns = [named[id(p)][0] for p in pg[PARAMS]]
        indices = {where[f] for f in fqns if f in where}
        if len(indices) > 1:
            raise ValueError(f"optimizer state dict: parameters {fqns[:4]}... form one group "
                             "here but several in the state dict.")
        if not indices and len(saved_groups) != len(optim.param_groups):
            raise ValueError(f"optimizer state dict: no saved param group holds {fqns[:4]}.")
        saved_pg = saved_groups[indices.pop() if indices else len(groups)]
        entry = {k: v for k, v in saved_pg.items() if k != PARAMS}
        entry[PARAMS] = list(range(position, position + len(fqns)))
        groups.append(entry)
        for param, fqn in zip(pg[PARAMS], fqns):
            if fqn in saved_state:
                _check_state_shapes(fqn, param, named[id(param)][1], saved_state[fqn])
                order.append((position, param, saved_state[fqn]))
            position += 1
    return groups, order


def _full_shape(entry) -> tuple:
    if entry.part is not None:
        return tuple(entry.group.slots[entry.index].shape)
    return tuple(entry.tensor.shape)


def _check_state_shapes(fqn, param, entry, saved: dict) -> None:
    full = _full_shape(entry)
    for key, value in saved.items():
        shape = global_shape(value)
        if shape is None or len(shape) == 0 or shape == full:
            continue
        if entry.part is not None and shape == tuple(param.shape) and not _is_distributed(value):
            continue  # this rank's own piece, saved at the same world size and layout
        hint = ""
        if entry.part is not None and len(shape) == 1:
            hint = (" It looks like one rank's piece of a per-rank optimizer state dict "
                    "(optim.state_dict()), saved at another world size or wrapping: such a "
                    "layout only loads where it was saved. Save with get_optimizer_state_dict "
                    "(or FSDP.optim_state_dict) to load at any world size.")
        raise ValueError(
            f"optimizer state dict: {fqn!r} state {key!r} has shape {shape}; the parameter is "
            f"{full} (this rank holds {tuple(param.shape)} of it).{hint}")


def _is_distributed(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor"


def _local_state(param, named_entry, saved: dict) -> dict:
    _, entry = named_entry
    full_shape = _full_shape(entry)
    out = {}
    for key in sorted(saved):  # sorted: the same collective order on every rank
        value = saved[key]
        shape = global_shape(value)
        if shape is None or len(shape) == 0 or entry.part is None:
            value = to_full(value) if shape is not None else value
            out[key] = value.detach().clone() if torch.is_tensor(value) else value
            continue
        if shape != full_shape:  # this rank's own piece (checked in _check_state_shapes)
            out[key] = value.detach().clone()
            continue
        group, index = entry.group, entry.index
        lo, hi = group.local_range(index)
        start = group.shard_start + lo - group.offsets[index]
        full = to_full(value)
        out[key] = full.reshape(-1)[start: start + (hi - lo)].clone()
    return out


def broadcast_object_tree(tree):
    """Rank 0's nested dict/list of tensors and Python values, on every rank: the structure
    (with tensor shapes) as one object, then each tensor by a broadcast."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if world_rank() == 0:
        leaves, spec = tree_flatten(tree)
        meta = [("t", tuple(x.shape), x.dtype) if torch.is_tensor(x) else ("v", x)
                for x in leaves]
        header = [(spec, meta)]
    else:
        header = [None]
    dist.broadcast_object_list(header, src=0)
    spec, meta = header[0]
    # NCCL sends CUDA tensors only: each goes over the wire on the device the default group
    # talks on, and arrives on the CPU (rank 0 keeps its own copy where it was).
    wire = collective_device(backends_of(None), default_device())
    out = []
    for index, item in enumerate(meta):
        if item[0] == "v":
            out.append(item[1])
            continue
        if world_rank() == 0:
            tensor = to_full(leaves[index]).detach().clone()
            dist.broadcast(tensor.to(wire), src=0)
        else:
            tensor = torch.empty(item[1], dtype=item[2], device=wire)
            dist.broadcast(tensor, src=0)
            tensor = tensor.cpu()
        out.append(tensor)
    return tree_unflatten(out, spec)


# -- an optimizer's own state dict, as torch's state-dict helpers read and load it ---------------
# (see [Note: answering torch's state-dict helpers] in `torch_helpers`)


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group[PARAMS]]


def holds_flat_pieces(optimizer) -> bool:
    return bool(flat_piece_entries(_optimizer_params(optimizer)))


def pieces_as_rows(optimizer, state_dict: dict) -> dict:
    """`optimizer.state_dict()` (keyed by position) with each flat piece's per-parameter
    tensors replaced by the whole parameter's row DTensor. A collective."""
    params = _optimizer_params(optimizer)
    located = flat_piece_entries(params)
    if not located:
        return state_dict
    _check_agreement([(i, sorted(optimizer.state.get(p, {}))) for i, p in enumerate(params)])
    position = {id(p): i for i, p in enumerate(params)}
    state = dict(state_dict[STATE])
    groups = []
    for entry in located.values():
        if all(entry.group is not seen[1] for seen in groups):
            groups.append((entry.part.sharded, entry.group))
    for sharded, group in groups:
        named = {id(p): (position.get(id(p), ("elsewhere", id(p))), None)
                 for p in group.local_params}
        for param in group.local_params:
            state.pop(position.get(id(param)), None)
        _group_state(optimizer, group, named, mesh_of(sharded), state)
    return {STATE: state, GROUPS: state_dict[GROUPS]}


def rows_as_pieces(optimizer, state_dict: dict) -> dict:
    """The reverse, before `optimizer.load_state_dict`: whole-parameter values (DTensors of
    any world size or full tensors) of flat pieces cut down to this rank's piece. The saved
    state is matched to parameters by position in the groups, as torch's loader does."""
    params = _optimizer_params(optimizer)
    located = flat_piece_entries(params)
    saved_keys = [key for group in state_dict[GROUPS] for key in group[PARAMS]]
    state = dict(state_dict[STATE])
    with torch.no_grad():
        for key, param in zip(saved_keys, params):
            entry = located.get(id(param))
            if entry is None or key not in state:
                continue
            _check_state_shapes(key, param, entry, state[key])
            state[key] = _local_state(param, (key, entry), state[key])
    return {STATE: state, GROUPS: state_dict[GROUPS]}


def refuse_hidden_originals(optimizer) -> None:
    """An optimizer built before a wrap with `use_orig_params=False` holds the original
    parameters, which the model no longer registers and no backward gives a gradient (native
    FSDP1 then trains nothing, silently): refuse its first step, naming the fix."""
    for entry in flat_piece_entries(_optimizer_params(optimizer)).values():
        if entry.group.flat_param is not None:
            slot = entry.group.slots[entry.index]
            raise RuntimeError(
                f"{type(optimizer).__name__} steps parameter {slot.fqn!r}, which "
                "FullyShardedDataParallel(use_orig_params=False) flattened into its unit's flat "
                "parameter: no backward gives it a gradient any more, so this step would train "
                "nothing (native FSDP1 silently does). Build the optimizer after wrapping, over "
                "model.parameters() (the flat parameters), or wrap with use_orig_params=True to "
                "keep an optimizer built before.")


def check_local_shapes(optimizer) -> None:
    """Every per-parameter state tensor of a flat piece must be shaped like the piece."""
    params = _optimizer_params(optimizer)
    for entry in flat_piece_entries(params).values():
        param = entry.tensor
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                slot = entry.group.slots[entry.index]
                raise ValueError(
                    f"optimizer state {key!r} of parameter {slot.fqn!r} has shape "
                    f"{tuple(value.shape)}, but this rank holds a piece of shape "
                    f"{tuple(param.shape)} of it (the parameter is {tuple(slot.shape)}): the "
                    "state was loaded as whole-parameter values into an optimizer that had "
                    "not stepped yet while gradients existed, so nothing cut it to this "
                    "rank's piece. Call optimizer.zero_grad() before torch's "
                    "set_optimizer_state_dict (torch then initialises the optimizer by a step "
                    "and the state is cut to each rank's piece on loading).")
