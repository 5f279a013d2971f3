"""FSDP1's legacy ways of handing an optimizer its state: a full state dict held by rank 0
alone (`rank0_only=True` loads, `scatter_full_optim_state_dict`), and a full state dict turned
into one keyed by position in `model.parameters()` when no optimizer is given
(`shard_full_optim_state_dict` / `scatter_full_optim_state_dict` without `optim`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_bridge import engine
from fsdp_bridge.state_dicts import flat_optim
from fsdp_bridge.translation import bad_argument


def from_rank0(value, group=None):
    """Rank 0's `value` (rank 0 of `group`, else of the world) on every rank; what the other
    ranks pass (None, {}) is ignored, as FSDP1 ignores it. Pickled as one object, so tensors
    keep the device they had on rank 0 (a CPU-offloaded state dict stays on the CPU)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    holder: list[Any] = [value if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


class _ModelOrder:
    """The parameters of a model as an optimizer built on them would hold them."""

    def __init__(self, param_groups: list[dict]):
        self.param_groups = param_groups
        self.state: dict = {}


def by_model_order(model: nn.Module, sharded, frontend: str, full_osd: dict) -> dict:
    """This rank's part of a full (name-keyed) optimizer state dict, keyed by position in
    `model.parameters()` (how an optimizer built on them numbers them), one param group per
    saved one with its positions sorted, as FSDP1 gives it when no optimizer is passed. With
    flat parameters those are the positions of the flat parameters, each with its state laid
    out flat (see [Note: optimizer state of flat parameters] in flat_optim.py)."""
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    holder = {}  # id(original parameter or piece) -> the parameter of `params` holding it
    for param in params:
        group = engine.flat_param_group(param)
        for piece in (group.local_params if group is not None else [param]):
            holder[id(piece)] = param
    # Saved names are state-dict keys: without our wrappers' and activation checkpointing's
    # children.
    by_name = {key: holder.get(id(held)) for key, held in engine.held_entries(sharded).items()
               if isinstance(held, nn.Parameter)}
    groups = []
    for saved in full_osd["param_groups"]:
        unknown = [fqn for fqn in saved["params"] if by_name.get(fqn) is None]
        if unknown:
            raise bad_argument(frontend, "full_optim_state_dict",
                               f"<a param group holding {unknown[:4]}>",
                               "the full optimizer state dict of this model's parameters",
                               "Load the state saved from this model (these names are not its "
                               "parameters).")
        held = {id(by_name[fqn]): by_name[fqn] for fqn in saved["params"]}
        groups.append({"params": sorted(held.values(), key=lambda p: position[id(p)])})
    # The engine numbers parameters as an optimizer's param_groups list them: give it ours.
    in_model_order = flat_optim.pieces_of(_ModelOrder(groups))
    local = flat_optim.for_optimizer(in_model_order, engine.optim_state_dict_to_load(
        sharded, in_model_order, full_osd))
    order = [position[id(p)] for group in groups for p in group["params"]]
    local["state"] = {order[i]: value for i, value in local["state"].items()}
    for group in local["param_groups"]:
        group["params"] = [order[i] for i in group["params"]]
    return local
