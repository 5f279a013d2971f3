"""FSDP1's `FullyShardedDataParallel` over our engine.

Differences users can see (all documented in the argument table):
- Wrappers never stay nested: auto-wrapped units are units of the Plan, not wrapper modules in
  the tree, and hand-nested wrappers are adopted by the outer one (see `fsdp_bridge.wrapper`).
  `FSDP.fsdp_modules(model)` therefore lists the root wrappers only.
- Parameters are always the user's own Parameter objects (1-D local shards, as
  `use_orig_params=True`), whatever `use_orig_params` says: an optimizer built before wrapping
  trains.
- A hand-nested wrapper over other ranks than the root's is refused (see check_nested_groups).
- It runs on CPU without `device_id`, with `sync_module_states`, CPU offload and full state
  dicts offloaded to CPU (all of which native FSDP1 refuses on a CPU-only build).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

# Everything else torch's `torch.distributed.fsdp.fully_sharded_data_parallel` exposes, as
# torch's own objects: scripts import configs, enums and constants from this path.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
    ActivationWrapper,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import (  # noqa: F401
    FLAT_PARAM,
    FSDP_PREFIX,
    FSDP_WRAPPED_MODULE,
    HYBRID_SHARDING_STRATEGIES,
    LOW_PRECISION_HOOKS,
    CPUOffload,
    CustomPolicy,
    FlatParameter,
    FlatParamHandle,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    HandleTrainingState,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ProcessGroupType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    TrainingState,
    copy_method_params,
    copy_method_sig,
    traversal_utils,
)

from fsdp_bridge import devices, engine
from fsdp_bridge.fsdp._fsdp1_translate import FRONTEND, build_plan, strategy_of
from fsdp_bridge.plan import ShardingMode
from fsdp_bridge.translation import bad_argument
from fsdp_bridge.wrapper import ShardedWrapper, shard_flat

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]  # torch's, name for name

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def resolve_device(device_id) -> Optional[torch.device]:
    return devices.resolve_device(FRONTEND, device_id)


def _is_group(value) -> bool:
    return isinstance(value, dist.ProcessGroup)


def resolve_groups(strategy: ShardingStrategy, process_group, device_mesh, device):
    """(shard_group, replicate_group) for the engine."""
    if process_group is not None and device_mesh is not None:
        raise bad_argument(FRONTEND, "device_mesh", device_mesh, "only one of process_group "
                           "and device_mesh", "Pass the mesh alone (it carries the groups).")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise bad_argument(FRONTEND, "device_mesh", device_mesh, "a DeviceMesh", "Build one "
                           "with torch.distributed.device_mesh.init_device_mesh.", exc=TypeError)
    if strategy in _HYBRID:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise bad_argument(FRONTEND, "device_mesh", device_mesh, f"a 2-D mesh "
                                   f"(replicate, shard) for {strategy.name}", "e.g. init_device_"
                                   "mesh('cuda', (nodes, gpus_per_node), mesh_dim_names="
                                   "('replicate', 'shard')).")
            return device_mesh.get_group(1), device_mesh.get_group(0)
        if process_group is not None:
            if not (isinstance(process_group, tuple) and len(process_group) == 2
                    and all(_is_group(g) for g in process_group)):
                raise bad_argument(FRONTEND, "process_group", process_group, f"a tuple "
                                   f"(shard_group, replicate_group) for {strategy.name}",
                                   "Pass both groups, or a 2-D device_mesh.", exc=TypeError)
            return process_group
        # [Note: hybrid without groups] torch's FSDP1 uses one shard group per node, sized by
        # the accelerator count: 1 on CPU, where it then silently never synchronises replicas
        # (pytorch#154888). We shard within a node (LOCAL_WORLD_SIZE, else the CUDA device
        # count, else the whole world) and all-reduce across nodes, which is always correct.
        world = dist.get_world_size()
        if torch.cuda.is_available() and device is not None and device.type == "cuda":
            local = torch.cuda.device_count()
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise bad_argument(FRONTEND, "process_group", None, f"a (shard, replicate) tuple or "
                               f"a 2-D device_mesh: the node size {local} does not divide the "
                               f"world size {world}", "Pass the groups explicitly.")
        mesh = init_device_mesh((device or torch.device("cpu")).type, (world // local, local),
                                mesh_dim_names=("replicate", "shard"))
        return mesh.get_group(1), mesh.get_group(0)
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise bad_argument(FRONTEND, "device_mesh", device_mesh, f"a 1-D mesh for "
                               f"{strategy.name} (2-D meshes need HYBRID_SHARD or "
                               "_HYBRID_SHARD_ZERO2)", "Pass a 1-D mesh, or a hybrid strategy.")
        return device_mesh.get_group(), None
    if process_group is not None and not _is_group(process_group):
        raise bad_argument(FRONTEND, "process_group", process_group, f"None or one "
                           f"ProcessGroup for {strategy.name} (a tuple only with a hybrid "
                           "strategy)", "Pass one group, or sharding_strategy=HYBRID_SHARD.",
                           exc=TypeError)
    return process_group, None


def _ranks_of(*groups) -> list[int]:
    """Every rank a wrapper communicates with (from this rank): the union of its groups (the
    shard group and, hybrid or replicated, the replicate group); no group is the whole world."""
    given = [group for group in groups if group is not None]
    if not given:
        return list(range(dist.get_world_size()))
    return sorted({rank for group in given for rank in dist.get_process_group_ranks(group)})


def check_nested_groups(module: nn.Module, shard_group, replicate_group) -> None:
    """[Note: nested wrappers with their own group]
    Native FSDP1 lets a nested wrapper shard over its own process group, e.g. mixture-of-experts
    layers whose experts are wrapped over a group of their own (often one rank per expert).
    The engine shards one wrapped model over one set of ranks, so an outer wrapper adopting
    such a unit would reduce its gradients over the wrong ranks: refuse it by name instead.
    Groups are compared by the ranks they hold, whatever form they were given in."""
    if not dist.is_initialized():
        return
    expected = _ranks_of(shard_group, replicate_group)
    for path, wrapper in module.named_modules():
        if not isinstance(wrapper, ShardedWrapper) or not path:
            continue
        comm = wrapper._sharded.comm
        ranks = _ranks_of(comm.shard_group, comm.replicate_group)
        if ranks != expected:
            kwargs = wrapper._fsdp_kwargs
            argument = "device_mesh" if kwargs.get("device_mesh") is not None else "process_group"
            raise bad_argument(
                FRONTEND, f"{argument} (of the nested wrapper at {path!r})", kwargs.get(argument),
                f"the ranks of the enclosing wrapper ({expected}); this group has ranks {ranks}",
                "fsdp_bridge shards one wrapped model over one set of ranks. Wrap the nested "
                "module with the same process_group / device_mesh as the root (or none); for "
                "modules local to each rank (experts with a one-rank group), leave them "
                "unwrapped and pass them in the root's ignored_modules: they then stay whole "
                "and unreduced on their rank, as a one-rank group keeps them.")


class FullyShardedDataParallel(ShardedWrapper):
    _frontend = FRONTEND

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload=None,
        auto_wrap_policy=None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Optional[Union[int, torch.device]] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh: Optional[DeviceMesh] = None,
    ):
        super().__init__()
        if isinstance(module, ShardedWrapper):
            raise bad_argument(FRONTEND, "module", module, "a module that is not already a "
                               "FullyShardedDataParallel", "Wrap the model once (nested "
                               "wrappers go inside it, around submodules).")
        if not isinstance(module, nn.Module):
            raise bad_argument(FRONTEND, "module", module, "an nn.Module", "Pass the model.",
                               exc=TypeError)
        strategy = strategy_of(sharding_strategy)
        device = resolve_device(device_id)
        if param_init_fn is not None and not callable(param_init_fn):
            raise bad_argument(FRONTEND, "param_init_fn", param_init_fn, "None or a callable "
                               "(module) -> None", "e.g. param_init_fn=lambda m: m.to_empty("
                               "device=device, recurse=False).", exc=TypeError)
        # Validate everything that is pure before touching the world (no collective yet).
        translate_kwargs = dict(
            sharding_strategy=strategy,
            auto_wrap_policy=auto_wrap_policy,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            ignored_modules=ignored_modules,
            ignored_states=ignored_states,
            sync_module_states=sync_module_states,
            use_orig_params=use_orig_params,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        shard_group, replicate_group = resolve_groups(strategy, process_group, device_mesh, device)
        # From here on the model changes (nested wrappers released, parameters flattened): a
        # failure anywhere puts it back as it was (see engine/rollback.py).
        check_nested_groups(module, shard_group, replicate_group)
        with engine.restored_on_failure(module):
            nested = self.release_nested(module)
            plan = build_plan(module, nested=nested, **translate_kwargs)
            if plan.mode is ShardingMode.REPLICATE and replicate_group is None:
                shard_group, replicate_group = None, shard_group
            sharded = shard_flat(module, plan, shard_group=shard_group,
                                 replicate_group=replicate_group, device=device,
                                 param_init_fn=param_init_fn)
            self._attach(module, sharded, dict(translate_kwargs, process_group=process_group,
                                               device_mesh=device_mesh), nested)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy in effect, as torch's FSDP1 reports it: the one passed (FULL_SHARD by
        default), or NO_SHARD when the shard group has one rank (FSDP1 switches to NO_SHARD
        then, and scripts that branch on this attribute see that)."""
        if self._sharded.comm.shard_size == 1:
            return ShardingStrategy.NO_SHARD
        return self._fsdp_kwargs["sharding_strategy"]


FullyShardedDataParallel.__module__ = "fsdp_bridge.fsdp"
