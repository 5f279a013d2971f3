"""Full (unsharded) views of a sharded model outside the training step: summoning full
parameters, releasing a model back to ordinary parameters, the global gradient norm of any
parameter list, and full optimizer state dicts.

[Note: releasing]
FSDP1 lets users nest wrappers by hand (`FSDP(layer)` first, `FSDP(model)` later) and FSDP2
applies `fully_shard` bottom-up. The engine shards a whole model with one Plan, so a front-end
that meets an already-sharded submodule *releases* it (gathers its full parameters back into the
original `nn.Parameter` objects and removes its hooks) and shards the enclosing model with the
submodule as a unit. Releasing costs one gather per flat group, once, at construction.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Optional

import torch
from torch import nn

from fsdp_bridge.engine.flat_group import local_part
from fsdp_bridge.engine.row_group import RowGroup
from fsdp_bridge.engine.runtime import ShardedModel, _grad_norm

OWNER_ATTRIBUTE = "_fsdp_bridge_owner"  # on each local parameter: weakref to its ShardedModel
ATTRIBUTE = "_fsdp_bridge"  # on each sharded module: its ShardedModel


def tag_parameters(sharded: ShardedModel) -> None:
    """Mark every local shard so that `owner_of(param)` finds its model (global norms)."""
    ref = weakref.ref(sharded)
    for param in sharded.managed_parameters():
        setattr(param, OWNER_ATTRIBUTE, ref)


def owner_of(param: torch.Tensor) -> Optional[ShardedModel]:
    ref = getattr(param, OWNER_ATTRIBUTE, None)
    return ref() if ref is not None else None


def release(sharded: ShardedModel) -> None:
    """Undo `shard_model`: every parameter becomes an ordinary full `nn.Parameter` again (the
    original objects, refilled), buffers get back their dtypes, hooks are removed. A collective:
    every rank must call it."""
    for handle in sharded.hook_handles:
        handle.remove()
    with torch.no_grad():
        for unit in sharded.units:
            for group in unit.groups:
                group.invalidate()
                if isinstance(group, RowGroup):  # DTensor parameters stay sharded
                    group.detach_params()
                    continue
                flat = group.gather_full_master()
                for slot, value in group.split(flat):
                    slot.param.grad = None
                    slot.param.data = value.clone()
                    slot.param.requires_grad_(group.requires_grad)
                    # An ordinary parameter again: no owner to combine norms over, no
                    # replicas to count (the objects are the user's, they outlive us).
                    slot.param.__dict__.pop(OWNER_ATTRIBUTE, None)
                    slot.param.__dict__.pop("_fsdp_bridge_replicas", None)
                    for owner, attr in slot.owners:
                        owner.__dict__.pop(attr, None)
                        owner._parameters[attr] = slot.param
    for name, dtype in sharded.buffer_dtypes.items():
        owner, _, attr = name.rpartition(".")
        module = sharded.module.get_submodule(owner)
        buffer = module._buffers[attr]
        assert buffer is not None
        module._buffers[attr] = buffer.to(dtype)
    object.__delattr__(sharded.module, ATTRIBUTE)


@contextlib.contextmanager
def summon_full_params(
    sharded: ShardedModel,
    writeback: bool = True,
    rank0_only: bool = False,
    with_grads: bool = False,
    offload_to_cpu: bool = False,
):
    """Inside the context, every parameter is its full fp32 value (a plain `nn.Parameter`);
    with `writeback`, in-place changes are copied back into the shards on exit. With
    `rank0_only`, other ranks keep their shards; with `offload_to_cpu`, the full values (and
    gradients) live on the CPU. A collective: every rank must enter."""
    on_this_rank = not rank0_only or sharded.comm.world_rank == 0
    swapped = []  # (owner, attr, local param)
    gathered = []  # (group, full flat)
    for unit in sharded.units:
        for group in unit.groups:
            flat = group.gather_full_master()
            if offload_to_cpu and on_this_rank:
                flat = flat.cpu()  # written back from here on exit
            grads = None
            if with_grads and group.requires_grad and any(
                p.grad is not None for p in group.local_params
            ):
                local = torch.zeros_like(group.master)
                for index, param in enumerate(group.local_params):
                    lo, hi = group.local_range(index)
                    if param.grad is not None:
                        local[lo:hi] = param.grad
                grads = group.gather_full(local)
                if offload_to_cpu:
                    grads = grads.cpu()
            gathered.append((group, flat))
            if not on_this_rank:
                continue
            grad_views = ([view for _, view in group.split(grads)] if grads is not None
                          else [None] * len(group.slots))
            for (slot, value), grad in zip(group.split(flat), grad_views):
                full = nn.Parameter(value, requires_grad=group.requires_grad)
                full.grad = grad
                for owner, attr in slot.owners:
                    swapped.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = full
    try:
        yield
    finally:
        for owner, attr, local in reversed(swapped):
            owner._parameters[attr] = local
        if writeback and not rank0_only:
            for group, flat in gathered:
                group.load_full_master(flat.to(group.master.device))


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The true global norm of the gradients of `parameters`, which may mix local shards of
    sharded models (combined over their shard groups) and ordinary parameters."""
    norm_type = float(norm_type)
    by_owner: dict[int, tuple[ShardedModel, list]] = {}
    plain = []
    for param in parameters:
        if param.grad is None:
            continue
        owner = owner_of(param)
        if owner is None:
            plain.append(param.grad)
        else:
            by_owner.setdefault(id(owner), (owner, []))[1].append(local_part(param.grad))
    if not by_owner:
        grads = plain
        if not grads:
            return torch.zeros(())
        norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
        return norms.max() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)
    parts = []
    for index, (owner, grads) in enumerate(by_owner.values()):
        local = plain if index == 0 else []
        parts.append(_grad_norm(grads, local, norm_type, owner.comm, owner.device))
    if norm_type == float("inf"):
        return torch.stack(parts).max()
    return torch.stack(parts).pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grads_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in parameters:
        param.grad.mul_(clip_coef.to(param.grad.dtype))
    return total


# -- optimizer state ------------------------------------------------------------------------------


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
    for unit in sharded.units:
        for group in unit.groups:
            for slot, param in zip(group.slots, group.local_params):
                fqn_of[id(param)] = slot.fqn
            first = optimizer.state.get(group.local_params[0], {})
            keys = sorted(
                k for k, v in first.items()
                if torch.is_tensor(v) and v.shape == group.local_params[0].shape and v.dim() > 0
            )
            for slot, param in zip(group.slots, group.local_params):
                if param in optimizer.state:
                    state[slot.fqn] = {
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
                    if slot.fqn in state:
                        state[slot.fqn][key] = value.clone()
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
    """FQN -> parameter for the parameters of the model the engine does not shard."""
    found = {}
    for name, param in nn.Module.named_parameters(sharded.module):
        if id(param) not in managed:
            found[name] = param
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
                fqn = group.slots[index].fqn
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


# -- sharded (local) state dicts --------------------------------------------------------------------


def sharded_state_dict(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """This rank's shards under the original names (1-D local slices of each parameter's flat
    range; buffers and ignored parameters whole). No collectives; reload it with
    `load_sharded_state_dict` at the same world size and layout."""
    local = {}
    for unit in sharded.units:
        for group in unit.groups:
            for slot, param in zip(group.slots, group.local_params):
                for fqn in slot.owner_fqns:
                    local[fqn] = param.detach().clone()
    result = {}
    for key, value in nn.Module.state_dict(sharded.module, keep_vars=True).items():
        value = local.get(key, value.detach().clone())
        if key in sharded.buffer_dtypes:
            value = value.to(sharded.buffer_dtypes[key])
        result[key] = value
    return result


def load_sharded_state_dict(sharded: ShardedModel, state_dict: dict, strict: bool = True) -> None:
    entries = nn.Module.state_dict(sharded.module, keep_vars=True)
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
    for unit in sharded.units:
        for group in unit.groups:
            group.invalidate()


# -- explicit unshard / reshard and forward-like methods ------------------------------------------


def _unit(sharded: ShardedModel, name: str):
    """Unit `name`, or for a module inside a unit (e.g. a module of an FSDP2 list call) the
    innermost unit that encloses it."""
    best = None
    for unit in sharded.units:
        if unit.name == name:
            return unit
        if unit.name == "" or name.startswith(unit.name + "."):
            if best is None or len(unit.name) > len(best.name):
                best = unit
    return best if best is not None else sharded.units[-1]


def set_gradient_divide_factor(sharded: ShardedModel, name: str, factor: Optional[float]) -> None:
    """Divide the reduced gradients of unit `name` (or of the unit enclosing module `name`) by
    `factor` instead of the data-parallel size (FSDP2's per-module divide factor)."""
    _unit(sharded, name).gradient_divide_factor = None if factor is None else float(factor)


def unshard_unit(sharded: ShardedModel, name: str) -> list:
    """Start gathering unit `name` (FSDP2's `unshard`): the next forward finds it gathered.
    Returns the groups whose gathers are in flight (wait with `group.wait_gather()`)."""
    unit = _unit(sharded, name)
    started = []
    for group in unit.groups:
        if not group.is_gathered:
            group.start_gather()
            started.append(group)
    return started


def expose_unit(sharded: ShardedModel, name: str) -> None:
    """After `unshard_unit` finished: unit `name`'s modules hold its full parameters until
    it is resharded (FSDP2's unsharded state; DTensor parameters only)."""
    for group in _unit(sharded, name).groups:
        if isinstance(group, RowGroup):
            group.expose_full()


def reshard_unit(sharded: ShardedModel, name: str) -> None:
    """Drop unit `name`'s gathered copy (FSDP2's `reshard`), unless it is running."""
    unit = _unit(sharded, name)
    if not unit.in_use:
        for group in unit.groups:
            group.invalidate()


def run_pre_forward(sharded: ShardedModel, name: str, args, kwargs):
    """Run the engine's pre-forward hook of unit `name` by hand (for a hook registered while
    the module's own hooks were already being called)."""
    unit = _unit(sharded, name)
    return sharded._make_pre_forward(unit)(unit.module, args, kwargs)


def run_as_forward(sharded: ShardedModel, name: str, method, args, kwargs):
    """Call `method` with unit `name` gathered as for its forward (FSDP2's
    `register_fsdp_forward_method`)."""
    unit = _unit(sharded, name)
    if unit.in_use:
        return method(*args, **kwargs)
    args, kwargs = sharded._make_pre_forward(unit)(unit.module, args, kwargs)
    output = method(*args, **kwargs)
    return sharded._make_post_forward(unit)(unit.module, args, output)
