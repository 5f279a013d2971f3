"""Which model a parameter or module belongs to, and giving a model back.

[Note: releasing]
FSDP1 lets users nest wrappers by hand (`FSDP(layer)` first, `FSDP(model)` later) and FSDP2
applies `fully_shard` bottom-up. The engine shards a whole model with one Plan, so a front-end
that meets an already-sharded submodule *releases* it (gathers its full parameters back into the
original `nn.Parameter` objects and removes its hooks) and shards the enclosing model with the
submodule as a unit. Releasing costs one gather per flat group, once, at construction.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from fsdp_bridge.engine import flat_params
from fsdp_bridge.engine.layout import FLATTENED_MARK, OWNER_ATTRIBUTE
from fsdp_bridge.engine.row_group import RowGroup
from fsdp_bridge.engine.runtime import ShardedModel
from fsdp_bridge.engine.summon import SUMMONED

ATTRIBUTE = "_fsdp_bridge"  # on each sharded module: its ShardedModel


def tag_parameters(sharded: ShardedModel) -> None:
    """Mark every local shard so that `owner_of(param)` finds its model (global norms)."""
    ref = weakref.ref(sharded)
    for param in sharded.managed_parameters():
        setattr(param, OWNER_ATTRIBUTE, ref)


def owner_of(param: torch.Tensor) -> Optional[ShardedModel]:
    ref = getattr(param, OWNER_ATTRIBUTE, None)
    return ref() if ref is not None else None


def units_within(sharded: ShardedModel, module: nn.Module) -> list:
    """The units of `sharded` whose module is `module` or inside it, in the Plan's order."""
    inside = {id(sub) for sub in module.modules()}
    return [unit for unit in sharded.units if id(unit.module) in inside]


def displaced_parameter(sharded: ShardedModel) -> Optional[tuple[str, Optional[torch.Tensor]]]:
    """(name, what its module holds now) for the first parameter of a flat layout whose module
    no longer holds it, or None. Its place is empty or holds a plain tensor (torch's FSDP1
    around the model, which flattens it), or a parameter that is not this model's (torch's
    fully_shard around the model, or a parameter assigned after wrapping): see [Note: one
    dialect per model] in fsdp_bridge/mixed_dialects.py. The model's own parameters (a tie
    redone after wrapping) and `summon_full_params`'s full ones are not displaced. With flat
    parameters, what each unit's module must hold is its flat parameter (see
    engine/flat_params.py)."""
    if flat_params.shows_flat_params(sharded):
        return flat_params.displaced_flat_param(sharded)
    for group in sharded.flat_groups():
        if isinstance(group, RowGroup):
            continue  # DTensor parameters: torch's wrappers refuse them when they wrap
        for slot in group.slots:
            for owner, attr in slot.owners:
                now = owner._parameters.get(attr)
                if now is slot.param or (isinstance(now, torch.nn.Parameter) and (
                        owner_of(now) is sharded or getattr(now, SUMMONED, False))):
                    continue
                return slot.fqn, now
    return None


def release(sharded: ShardedModel) -> None:
    """Undo `shard_model`: every parameter becomes an ordinary full `nn.Parameter` again (the
    original objects, refilled), buffers get back their dtypes, hooks are removed. A collective:
    every rank must call it."""
    for handle in sharded.hook_handles:
        handle.remove()
    flat_params.withdraw(sharded)
    with torch.no_grad():
        for group in sharded.flat_groups():
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
                slot.param.__dict__.pop(FLATTENED_MARK, None)
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
