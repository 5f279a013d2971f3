"""FSDP1's `FullyShardedDataParallel` over our engine.

The module tree is native FSDP1's (see [Note: one wrapper per unit] in fsdp_bridge/wrapper.py):
with an auto-wrap policy or hand-nested wrappers, every unit is a FullyShardedDataParallel
around its module, with native's attribute and parameter names, all of them faces of one
engine. With `use_orig_params=False` (the default) `named_parameters()` gives one flat
parameter per unit, shaped as native's local flat shard, which is the engine's master shard
itself (see [Note: flat parameters] in fsdp_bridge/engine/flat_params.py); with True, the
original parameters as 1-D local pieces.

Differences users can see (all documented in the argument table):
- A hand-nested wrapper over other ranks than the root's is refused (see check_nested_groups).
- LOCAL_STATE_DICT holds our flat groups under `<unit>._bridge_flat_param.<i>`, not native's
  `<wrapper>._flat_param`: a native LOCAL dict is refused by name (see
  fsdp_bridge/engine/local_state.py). The legacy `sharded_optim_state_dict` gives DTensors
  where native gives ShardedTensors; `flatten_sharded_optim_state_dict` reads both.
- torch's `get_optimizer_state_dict` / `set_optimizer_state_dict` refuse an optimizer over the
  flat parameters (see [Note: torch's helpers and flat parameters] in
  fsdp_bridge/state_dicts/torch_helpers.py); FSDP1's own optimizer-state APIs take it.
- It runs on CPU without `device_id`, with `sync_module_states`, CPU offload and full state
  dicts offloaded to CPU (all of which native FSDP1 refuses on a CPU-only build).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

# Everything else torch's `torch.distributed.fsdp.fully_sharded_data_parallel` exposes, as
# torch's own objects: scripts import configs, enums and constants from this path.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
    ActivationWrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
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
from fsdp_bridge.fsdp._fsdp1_translate import (
    FRONTEND,
    build_plan,
    parse_sharding_strategy,
    strategy_of,
)
from fsdp_bridge.mixed_dialects import refuse_other_dialects
from fsdp_bridge.topology import Topology, resolve_topology
from fsdp_bridge.translation import bad_argument, check_param_init_fn
from fsdp_bridge.wrapper import ShardedWrapper, shard_flat

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]  # torch's, name for name


def resolve_device(device_id) -> Optional[torch.device]:
    return devices.resolve_device(FRONTEND, device_id)


def resolve_groups(strategy: ShardingStrategy, process_group, device_mesh, device) -> Topology:
    """FSDP1's `process_group` / `device_mesh` for `strategy`, as the engine's groups."""
    return resolve_topology(
        parse_sharding_strategy(strategy).mode, process_group=process_group,
        device_mesh=device_mesh, device_type=(device or torch.device("cpu")).type,
        frontend=FRONTEND, setting=strategy.name)


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
    _wrapper_per_unit = True  # see [Note: one wrapper per unit] in fsdp_bridge/wrapper.py

    # torch's own: it names parameters by walking the model with wrapper children left out (ours
    # and activation checkpointing's) and numbers them as the optimizer does, which reads our
    # models as they are; it moves no tensor and runs no collective.
    rekey_optim_state_dict = staticmethod(TorchFSDP.rekey_optim_state_dict)

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
        refuse_other_dialects(FRONTEND, module)
        strategy = parse_sharding_strategy(sharding_strategy).strategy
        device = resolve_device(device_id)
        check_param_init_fn(FRONTEND, param_init_fn)
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
        topology = resolve_groups(strategy, process_group, device_mesh, device)
        # From here on the model changes (nested wrappers released, parameters flattened): a
        # failure anywhere puts it back as it was (see engine/rollback.py).
        check_nested_groups(module, topology.shard_group, topology.replicate_group)
        with engine.restored_on_failure(module):
            nested, unit_wrappers = self.take_out_wrappers(module)
            plan = build_plan(module, nested=nested, **translate_kwargs)
            sharded = shard_flat(module, plan, shard_group=topology.shard_group,
                                 replicate_group=topology.replicate_group, device=device,
                                 param_init_fn=param_init_fn)
            if not use_orig_params:  # see [Note: flat parameters] in engine/flat_params.py
                engine.expose_flat_params(sharded)
            self._attach(module, sharded, dict(translate_kwargs, process_group=process_group,
                                               device_mesh=device_mesh), unit_wrappers)

    def _unit_wrapper_kwargs(self, unit) -> dict:
        """A unit's wrapper reports the root's arguments with its own sharding strategy (a
        CustomPolicy may have changed its resharding)."""
        spec = next(spec for spec in self._sharded.plan.units if spec.name == unit.name)
        return dict(self._fsdp_kwargs,
                    sharding_strategy=strategy_of(self._sharded.plan.mode,
                                                  spec.reshard_after_forward))

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy in effect, as torch's FSDP1 reports it: the one passed (FULL_SHARD by
        default), or NO_SHARD when the shard group has one rank (FSDP1 switches to NO_SHARD
        then, and scripts that branch on this attribute see that)."""
        if self._sharded.comm.shard_size == 1:
            return ShardingStrategy.NO_SHARD
        return self._fsdp_kwargs["sharding_strategy"]

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group parameters are sharded over, as FSDP1's attribute: the given group (the
        world's by default), the shard group of a hybrid strategy, the whole group with
        NO_SHARD. None only in a process without torch.distributed (native FSDP1 needs one)."""
        comm = self._sharded.comm
        return comm.shard_group if comm.shard_group is not None else comm.replicate_group

    @property
    def rank(self) -> int:
        """This rank within `process_group` (FSDP1's attribute)."""
        group = self.process_group
        return group.rank() if group is not None else 0

    @property
    def world_size(self) -> int:
        """The size of `process_group` (FSDP1's attribute)."""
        group = self.process_group
        return group.size() if group is not None else 1


FullyShardedDataParallel.__module__ = "fsdp_bridge.fsdp"
