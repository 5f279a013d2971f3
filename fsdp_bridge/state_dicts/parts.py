"""Where a model's sharded parts are, and what every tensor is called in a state dict.

A "part" is a module sharded by the engine (`engine.get_sharded(module)`), found anywhere in
the model handed to a state-dict function: the model itself, the module inside one of our
wrappers (FSDP1's `_fsdp_wrapped_module`, YaFSDP's `_module`), or several independently
sharded submodules. State-dict keys are canonical FQNs: the path from the model with our
wrappers' inner attribute left out, and torch's activation-checkpointing wrappers' too
(`_checkpoint_wrapped_module`, applied before or after our wrap), exactly as torch's
state-dict helpers name a native FSDP1 model (and as our wrappers' own `state_dict()` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE as CHECKPOINT_CHILD,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from fsdp_bridge import engine
from fsdp_bridge.engine.layout import state_dict_key
from fsdp_bridge.engine.runtime import ShardedModel
from fsdp_bridge.plan import ParamLayout
from fsdp_bridge.topology import mesh_of_pair

MESH_ATTRIBUTE = "_fsdp_bridge_checkpoint_mesh"


@dataclasses.dataclass
class Part:
    prefix: str  # canonical key prefix of the sharded module: "" or "a.b."
    sharded: ShardedModel


@dataclasses.dataclass
class Entry:
    """One state-dict key of the model."""

    key: str
    tensor: torch.Tensor  # what the module holds (a local shard for managed parameters)
    is_buffer: bool
    part: Optional[Part] = None
    group: object = None  # FlatGroup of a managed parameter
    index: int = -1  # its slot in the group
    dtype: Optional[torch.dtype] = None  # the dtype to report (buffers kept in another dtype)


def _transparent_child(module: nn.Module) -> Optional[str]:
    """The child attribute a wrapper hides from state-dict names, if any: ours, and torch's
    activation-checkpointing wrappers (whose state-dict hooks drop it, as native FSDP1 does)."""
    if isinstance(module, ActivationWrapper):
        return CHECKPOINT_CHILD
    # Read from the instance: our wrappers hand unknown attributes on to the module inside.
    if isinstance(module.__dict__.get("_sharded"), ShardedModel):
        hidden = getattr(type(module), "_hidden_child", None)
        if hidden in module._modules:
            return hidden
    return None


def ensure_sharded(model: nn.Module) -> None:
    """FSDP2's front-end shards lazily (on first use): make sure that happened."""
    for module in model.modules():
        if hasattr(module, "_fsdp_root_state") and engine.get_sharded(module) is None:
            module._fsdp_root_state()
            return


def find_parts(model: nn.Module) -> list[Part]:
    ensure_sharded(model)
    parts: list[Part] = []

    def visit(module: nn.Module, prefix: str) -> None:
        sharded = engine.get_sharded(module)
        if sharded is None and isinstance(module.__dict__.get("_sharded"), ShardedModel):
            sharded = module.__dict__["_sharded"]  # a wrapper of one unit of a sharded model
        if sharded is not None:
            parts.append(Part(prefix, sharded))
            return
        hidden = _transparent_child(module)
        for name, child in module._modules.items():
            if child is None:
                continue
            visit(child, prefix if name == hidden else f"{prefix}{name}.")

    visit(model, "")
    return parts


def has_flat_shards(model: nn.Module) -> bool:
    """Whether `model` contains a module our engine shards in the flat layout (FSDP1,
    YaFSDP, Zeta, TorchAcc: parameters are 1-D local pieces that torch cannot recognise).
    FSDP2 models hold DTensors, which torch's own state-dict code handles as they are."""
    if not isinstance(model, nn.Module):
        return False
    for module in model.modules():
        sharded = engine.get_sharded(module)
        if sharded is not None and sharded.plan.param_layout is ParamLayout.FLAT:
            return True
    return False


def flat_piece_entries(params) -> dict[int, Entry]:
    """id(param) -> its Entry (sharded model, group, slot) for each of `params` that is a
    flat-layout piece of ours; other parameters are left out."""
    found: dict[int, Entry] = {}
    owners = []
    for param in params:
        sharded = engine.owner_of(param)
        if (sharded is not None and sharded.plan.param_layout is ParamLayout.FLAT
                and all(sharded is not seen for seen in owners)):
            owners.append(sharded)
    for sharded in owners:
        part = Part("", sharded)
        for group in sharded.flat_groups():
            for index, param in enumerate(group.local_params):
                found[id(param)] = Entry("", param, False, part, group, index)
    wanted = {id(p) for p in params}
    return {key: entry for key, entry in found.items() if key in wanted}


def entries(model: nn.Module, parts: list[Part]) -> list[Entry]:
    """Every key `nn.Module.state_dict` would give the unwrapped model, in the same order
    (tied parameters under each of their names)."""
    where = {}
    for part in parts:
        for group in part.sharded.flat_groups():
            for index, param in enumerate(group.local_params):
                where[id(param)] = (part, group, index)
    buffer_dtypes = {}
    for part in parts:
        for name, dtype in part.sharded.buffer_dtypes.items():
            buffer_dtypes[part.prefix + state_dict_key(name)] = dtype
    result: list[Entry] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, param in module._parameters.items():
            if param is None:
                continue
            located = where.get(id(param))
            if located is None:
                result.append(Entry(prefix + name, param, False))
            else:
                part, group, index = located
                result.append(Entry(prefix + name, param, False, part, group, index))
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            key = prefix + name
            result.append(Entry(key, buffer, True, dtype=buffer_dtypes.get(key)))
        hidden = _transparent_child(module)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, prefix if name == hidden else f"{prefix}{name}.")

    with contextlib.ExitStack() as stack:  # the original parameters in their places
        for part in parts:
            stack.enter_context(engine.originals_registered(part.sharded))
        visit(model, "")
    return result


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def mesh_of(sharded: ShardedModel):
    """The DeviceMesh over which a part's parameters are sharded (dim "shard"), with the
    replicate dim first for hybrid sharding; None when parameters are not sharded."""
    comm = sharded.comm
    if comm.shard_size == 1:
        return None
    mesh = getattr(sharded, MESH_ATTRIBUTE, None)
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    device_type = sharded.device.type
    if comm.replicate_size == 1:
        mesh = DeviceMesh.from_group(comm.shard_group, device_type, mesh_dim_names=("shard",))
    else:
        mesh = mesh_of_pair(comm.shard_group, comm.replicate_group, device_type)
    object.__setattr__(sharded, MESH_ATTRIBUTE, mesh)
    return mesh
