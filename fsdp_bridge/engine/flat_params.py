"""One parameter per unit, over its master shard: FSDP1's flat parameters
(`use_orig_params=False`).

[Note: flat parameters]
With `use_orig_params=False`, native FSDP1 registers one parameter per unit, on the module the
unit wraps, under `_flat_param`: this rank's shard of the unit's parameters flattened one after
the other (in `named_modules` order, a tied parameter once), padded at the end to a multiple of
the shard-group size, with no padding between parameters. The original parameters are no longer
registered; outside the unit's forward their modules hold plain tensors of the full shapes
whose storage is freed. So `named_parameters()` gives one parameter per unit, and an optimizer
built over `model.parameters()` steps the flat shards.

An engine flat group has exactly that layout (see `FlatGroup`), so a unit's flat parameter here
is an `nn.Parameter` over the group's master shard: the same storage, no copy. What an optimizer
writes into it is the master, which the original parameters (views into it) and the next
gather read. Its `.grad` is the group's whole gradient shard (padding included, zero there);
the original parameters get none. `expose` de-registers the originals, registers the flat
parameters and gives the owner modules the storage-less tensors. The engine's own walks of the
module tree by parameter (state dicts, summon_full_params) run inside `originals_registered`,
where the originals are registered again in place of the flat parameters, as native FSDP1 does
inside its state-dict and summon contexts. A unit whose parameters make several flat groups
(several dtypes, or frozen and trainable parameters together) has no one flat shard: front-ends
refuse it before sharding, as native FSDP1 does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM

from fsdp_bridge.engine.flat_group import FlatGroup
from fsdp_bridge.engine.layout import OWNER_ATTRIBUTE
from fsdp_bridge.engine.runtime import ShardedModel, Unit

# How many `originals_registered` contexts are open, per model (they nest).
_OPEN: "weakref.WeakKeyDictionary[ShardedModel, int]" = weakref.WeakKeyDictionary()


def _flat_units(sharded: ShardedModel) -> list[tuple[Unit, FlatGroup]]:
    return [(unit, unit.groups[0]) for unit in sharded.units
            if unit.groups and unit.groups[0].flat_param is not None]


def exposes_flat_params(sharded: ShardedModel) -> bool:
    return bool(_flat_units(sharded))


def shows_flat_params(sharded: ShardedModel) -> bool:
    """Whether the modules hold the flat parameters now (not inside `originals_registered`)."""
    return exposes_flat_params(sharded) and not _OPEN.get(sharded, 0)


def expose(sharded: ShardedModel) -> None:
    """Give every unit of `sharded` its flat parameter (see [Note: flat parameters]); each unit
    must have at most one flat group."""
    ref = weakref.ref(sharded)
    for unit in sharded.units:
        if not unit.groups:
            continue
        assert len(unit.groups) == 1, f"unit {unit.name!r} has several flat groups"
        flat = unit.groups[0].make_flat_param()
        for tensor in [flat, *(unit.groups[0].resting or ())]:
            setattr(tensor, OWNER_ATTRIBUTE, ref)  # the model a module's tensors belong to
        _register_flat(unit, unit.groups[0])


def withdraw(sharded: ShardedModel) -> None:
    """Undo `expose` in the module tree (releasing the model): the original parameters
    registered again, no flat parameters. The groups keep theirs: a failed wrap around this
    model puts the tree back as it was (see engine/rollback.py), and with it this state."""
    for unit, group in _flat_units(sharded):
        _register_originals(unit, group)
        for slot in group.slots:
            for owner, attr in slot.owners:
                owner.__dict__.pop(attr, None)
    _OPEN.pop(sharded, None)


@contextlib.contextmanager
def originals_registered(sharded: ShardedModel):
    """Inside, the model's modules hold their original parameters (this rank's pieces) where
    they were before wrapping, and no flat parameters; nothing changes for a model without
    flat parameters. Re-entrant."""
    units = _flat_units(sharded)
    outermost = bool(units) and not _OPEN.get(sharded, 0)
    if outermost:
        for unit, group in units:
            _register_originals(unit, group)
    if units:
        _OPEN[sharded] = _OPEN.get(sharded, 0) + 1
    try:
        yield
    finally:
        if units:
            _OPEN[sharded] -= 1
        if outermost:
            for unit, group in units:
                _register_flat(unit, group)


def _register_originals(unit: Unit, group: FlatGroup) -> None:
    if unit.module._parameters.get(FLAT_PARAM) is group.flat_param:
        del unit.module._parameters[FLAT_PARAM]
    assert group.resting is not None
    for slot, resting in zip(group.slots, group.resting):
        for owner, attr in slot.owners:
            owner._parameters[attr] = slot.param
            if owner.__dict__.get(attr) is resting:
                del owner.__dict__[attr]  # attribute lookups find the registered parameter


def _register_flat(unit: Unit, group: FlatGroup) -> None:
    assert group.resting is not None
    for slot, resting in zip(group.slots, group.resting):
        for owner, attr in slot.owners:
            if owner._parameters.get(attr) is slot.param:
                del owner._parameters[attr]
            owner.__dict__.setdefault(attr, resting)
    unit.module._parameters[FLAT_PARAM] = group.flat_param


def displaced_flat_param(sharded: ShardedModel) -> Optional[tuple[str, Optional[torch.Tensor]]]:
    """(name, what its module holds now) for the first flat parameter its unit's module no
    longer holds, or for the first original parameter whose module registers a parameter
    again, or None (see `ownership.displaced_parameter`)."""
    for unit, group in _flat_units(sharded):
        now = unit.module._parameters.get(FLAT_PARAM)
        if now is not group.flat_param:
            return (f"{unit.name}.{FLAT_PARAM}" if unit.name else FLAT_PARAM), now
        for slot in group.slots:
            for owner, attr in slot.owners:
                if owner._parameters.get(attr) is not None:
                    return slot.fqn, owner._parameters[attr]
    return None


def flat_param_group(param: torch.Tensor) -> Optional[FlatGroup]:
    """The flat group whose flat parameter `param` is, or None."""
    ref = getattr(param, OWNER_ATTRIBUTE, None)
    sharded = ref() if ref is not None else None
    if sharded is None or not isinstance(param, nn.Parameter):
        return None
    for _, group in _flat_units(sharded):
        if group.flat_param is param:
            return group
    return None
