"""FSDP1's legacy ways of handing an optimizer its state: a full state dict held by rank 0
alone (`rank0_only=True` loads, `scatter_full_optim_state_dict`), and a full state dict turned
into one keyed by position in `model.parameters()` when no optimizer is given
(`shard_full_optim_state_dict` / `scatter_full_optim_state_dict` without `optim`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_bridge import engine
from fsdp_bridge.engine.layout import state_dict_key
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


def by_model_order(model: nn.Module, sharded, frontend: str, full_osd: dict) -> dict:
    """This rank's part of a full (name-keyed) optimizer state dict, keyed by position in
    `model.parameters()` (how an optimizer built on them numbers them), one param group per
    saved one with its positions sorted, as FSDP1 gives it when no optimizer is passed."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    # Saved names are state-dict keys: without activation checkpointing's wrapper child.
    by_name = {state_dict_key(fqn): param
               for fqn, param in nn.Module.named_parameters(sharded.module)}
    groups = []
    for saved in full_osd["param_groups"]:
        unknown = [fqn for fqn in saved["params"]
                   if fqn not in by_name or id(by_name[fqn]) not in position]
        if unknown:
            raise bad_argument(frontend, "full_optim_state_dict",
                               f"<a param group holding {unknown[:4]}>",
                               "the full optimizer state dict of this model's parameters",
                               "Load the state saved from this model (these names are not its "
                               "parameters).")
        params = sorted((by_name[fqn] for fqn in saved["params"]), key=lambda p: position[id(p)])
        groups.append({"params": params})
    # The engine numbers parameters as an optimizer's param_groups list them: give it ours.
    in_model_order = type("ModelOrder", (), {"param_groups": groups})()
    local = engine.optim_state_dict_to_load(sharded, in_model_order, full_osd)
    order = [position[id(p)] for group in groups for p in group["params"]]
    local["state"] = {order[i]: value for i, value in local["state"].items()}
    for group in local["param_groups"]:
        group["params"] = [order[i] for i in group["params"]]
    return local
