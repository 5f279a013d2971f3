"""The sharding engine: flat units, reused buffers, collectives, hooks and state dicts.

Its public verbs, one module each, are re-exported here: `shard_model` / `get_sharded`,
`ownership` (owner_of, release), `summon` (summon_full_params), `grad_norm` (grad_norm,
clip_grads_), `state_dict` (full and per-rank state dicts), `local_state` (FSDP1's
LOCAL_STATE_DICT: the flat shards), `optim_state` (FSDP1's full
optimizer state dicts), `unit_verbs` (FSDP2's per-unit unshard / reshard / divide factor),
`flat_params` (FSDP1's one parameter per unit over its master shard, `use_orig_params=False`).

It applies a `fsdp_bridge.plan.Plan` and knows nothing of FSDP dialects; front-ends build the
Plan. Entry point: `shard_model(module, plan, ...)`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.engine.comm import CollectiveStats, Comm
from fsdp_bridge.engine.device import backends_of, device_for_backends
from fsdp_bridge.engine.flat_params import (
    expose as expose_flat_params,
)
from fsdp_bridge.engine.flat_params import (
    exposes_flat_params,
    flat_param_group,
    originals_registered,
)
from fsdp_bridge.engine.grad_norm import clip_grads_, grad_norm
from fsdp_bridge.engine.local_state import load_local_state_dict, local_state_dict
from fsdp_bridge.engine.optim_state import (
    full_optim_state_dict,
    optim_state_dict_to_load,
)
from fsdp_bridge.engine.ownership import (
    ATTRIBUTE,
    displaced_parameter,
    owner_of,
    release,
    tag_parameters,
    units_within,
)
from fsdp_bridge.engine.rollback import restored_on_failure
from fsdp_bridge.engine.row_group import register_sharded
from fsdp_bridge.engine.runtime import ShardedModel
from fsdp_bridge.engine.state_dict import (
    full_state_dict,
    held_entries,
    load_full_state_dict,
    load_sharded_state_dict,
    reading_held_tensors,
    sharded_state_dict,
)
from fsdp_bridge.engine.summon import summon_full_params
from fsdp_bridge.engine.topology import topology_of_groups
from fsdp_bridge.engine.unit_verbs import (
    end_forward_method,
    expose_unit,
    forwards_begun,
    hook_module_inside,
    reshard_unit,
    run_as_forward,
    run_post_forward,
    run_pre_forward,
    set_all_reduce_hook,
    set_custom_collective,
    set_gradient_divide_factor,
    set_reduce_unused_params,
    set_unit_all_reduce,
    set_unit_gradient_sync,
    unit_in_use,
    unshard_unit,
)
from fsdp_bridge.plan import Plan

__all__ = [
    "CollectiveStats",
    "ShardedModel",
    "clip_grads_",
    "displaced_parameter",
    "end_forward_method",
    "expose_flat_params",
    "expose_unit",
    "exposes_flat_params",
    "flat_param_group",
    "held_entries",
    "originals_registered",
    "reading_held_tensors",
    "units_within",
    "forwards_begun",
    "hook_module_inside",
    "register_sharded",
    "full_optim_state_dict",
    "full_state_dict",
    "get_sharded",
    "grad_norm",
    "load_full_state_dict",
    "load_local_state_dict",
    "local_state_dict",
    "load_sharded_state_dict",
    "optim_state_dict_to_load",
    "owner_of",
    "release",
    "set_all_reduce_hook",
    "set_custom_collective",
    "set_reduce_unused_params",
    "set_unit_all_reduce",
    "set_unit_gradient_sync",
    "reshard_unit",
    "restored_on_failure",
    "run_as_forward",
    "run_post_forward",
    "run_pre_forward",
    "set_gradient_divide_factor",
    "shard_model",
    "sharded_state_dict",
    "summon_full_params",
    "tag_parameters",
    "unit_in_use",
    "unshard_unit",
]

def default_device(group: Optional[dist.ProcessGroup] = None,
                   module: Optional[nn.Module] = None) -> torch.device:
    """The compute device when none is given, from the devices the group talks on (see
    [Note: device from the backend config] in engine/device.py): the current CUDA device for
    a group with a CUDA backend of its own (NCCL, "cpu:gloo,cuda:nccl"); else the CUDA device
    `module` already lives on, else the CPU."""
    module_device = None
    if module is not None:
        tensors = [*module.parameters(), *module.buffers()]
        devices = {t.device for t in tensors if not t.is_meta}
        module_device = devices.pop() if len(devices) == 1 else None
        if tensors and not devices:
            module_device = torch.device("meta")  # nothing real yet: see device_for_backends
    if not dist.is_initialized():
        return module_device if module_device is not None and module_device.type == "cuda" \
            else torch.device("cpu")
    cuda = torch.cuda.is_available()
    return device_for_backends(backends_of(group), module_device, cuda_available=cuda,
                               current_cuda=torch.cuda.current_device() if cuda else 0)


def shard_model(
    module: nn.Module,
    plan: Plan,
    *,
    shard_group: Optional[dist.ProcessGroup] = None,
    replicate_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
) -> ShardedModel:
    """Shard `module` in place according to `plan`; returns the engine state, also reachable
    as `get_sharded(module)`."""
    if getattr(module, ATTRIBUTE, None) is not None:
        raise ValueError(
            f"module {type(module).__name__} is already sharded by fsdp_bridge; shard it once."
        )
    topology = topology_of_groups(plan.mode, shard_group, replicate_group)
    device = torch.device(device) if device is not None else default_device(topology.shard_group, module)
    comm = Comm(topology.shard_group, topology.replicate_group, topology.world_group,
                device.type)
    with restored_on_failure(module, buffer_values=plan.sync_module_states) as record:
        sharded = ShardedModel(module, plan, comm, device, param_init_fn, record)
        tag_parameters(sharded)
        # object.__setattr__: keep the state out of the module tree (not a submodule).
        object.__setattr__(module, ATTRIBUTE, sharded)
    return sharded


def get_sharded(module: nn.Module) -> Optional[ShardedModel]:
    return getattr(module, ATTRIBUTE, None)
