"""Run-time translation of FSDP1 values, for code rewritten by `fsdp-bridge migrate`.

Real training code passes FSDP1 settings through variables, config objects and `**kwargs`, which a
codemod cannot read. The codemods translate literals in place and route everything else here:
these helpers take FSDP1's own arguments and do, when the script runs, exactly what the codemod
does for literals. They read those arguments as our FSDP1 front-end does (its constructor's
signature, its `sharding_strategy` parser, `fsdp_bridge.policies` for wrap policies and
`fsdp_bridge.topology` for process groups and meshes), so importing this module imports
fsdp_bridge's front-ends and engine. The sharding is torch's own `fully_shard` for `--to fsdp2`;
`fsdp1_to_yafsdp` builds fsdp_bridge's YaFSDP, the target of `--to yafsdp`.

--to fsdp2:  fsdp1_fully_shard, fsdp1_no_sync, fsdp1_clip_grad_norm_, fsdp1_state_dict_options,
             fsdp1_state_dict_type, fsdp1_state_dict, fsdp1_load_state_dict, fsdp1_optim_state_dict,
             fsdp1_optim_state_dict_to_load, fsdp1_scatter_full_optim_state_dict, fsdp1_fsdp_modules,
             fsdp1_unwrap, fsdp1_load_sharded_optimizer_state_dict, fsdp1_module_class
--to yafsdp: fsdp1_to_yafsdp, yafsdp_zero_stage, yafsdp_modules_to_wrap, yafsdp_unit_state_dict, fsdp1_unwrap
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import sys
import types
import warnings
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

from fsdp_bridge import policies
from fsdp_bridge.engine.init import materialize_region, region_problem
from fsdp_bridge.fsdp._fsdp1_translate import FRONTEND, ParsedStrategy, parse_sharding_strategy
from fsdp_bridge.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from fsdp_bridge.plan import ShardingMode
from fsdp_bridge.topology import MESH_DIM_NAMES, Topology, mesh_of_pair, resolve_topology

__all__ = [
    "fsdp1_fully_shard",
    "fsdp1_units",
    "fsdp1_no_sync",
    "fsdp1_clip_grad_norm_",
    "fsdp1_state_dict_options",
    "fsdp1_optim_state_dict_to_load",
    "fsdp1_state_dict_type",
    "fsdp1_state_dict",
    "fsdp1_load_state_dict",
    "fsdp1_optim_state_dict",
    "fsdp1_scatter_full_optim_state_dict",
    "fsdp1_load_sharded_optimizer_state_dict",
    "fsdp1_fsdp_modules",
    "fsdp1_unwrap",
    "fsdp1_module_class",
    "fsdp1_to_yafsdp",
    "yafsdp_zero_stage",
    "yafsdp_modules_to_wrap",
    "yafsdp_unit_state_dict",
]


# --------------------------------------------------------------------------------------------
# FSDP1's constructor arguments
# --------------------------------------------------------------------------------------------

# What `FullyShardedDataParallel(...)` takes, from our FSDP1 front-end (`self` left out): the
# constructor helpers below accept exactly that and show it to `help()` and editors.
FSDP1_SIGNATURE = inspect.signature(FullyShardedDataParallel)


def _fsdp1_arguments(args: tuple, kwargs: dict) -> types.SimpleNamespace:
    """FSDP1 constructor arguments by name, bound as the constructor binds them (defaults in)."""
    bound = FSDP1_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return types.SimpleNamespace(**bound.arguments)


def _takes_fsdp1_arguments(*extra: inspect.Parameter):
    """Give a helper FSDP1's constructor signature, plus `extra` keyword-only parameters."""

    def decorate(function):
        parameters = [*FSDP1_SIGNATURE.parameters.values(), *extra]
        function.__signature__ = FSDP1_SIGNATURE.replace(parameters=parameters)
        return function

    return decorate


# --------------------------------------------------------------------------------------------
# Which modules FSDP1 would have wrapped
# --------------------------------------------------------------------------------------------


def fsdp1_units(
    root: nn.Module,
    auto_wrap_policy: Any,
    ignored_modules: Iterable[nn.Module] = (),
) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The submodules FSDP1's `auto_wrap_policy` wraps, children before parents, root excluded.

    Each comes with its per-module FSDP1 keyword overrides (only `CustomPolicy` returns any).
    `fsdp_bridge.policies` runs torch's own policy machinery, so the grouping is FSDP1's
    exactly, including the numel bookkeeping of `size_based_auto_wrap_policy`.
    """
    if auto_wrap_policy is None:
        return []
    if not (callable(auto_wrap_policy) or isinstance(auto_wrap_policy, policies._Policy)):
        raise TypeError(
            f"auto_wrap_policy={auto_wrap_policy!r} is not a wrap policy: pass a torch wrap policy "
            "(ModuleWrapPolicy, CustomPolicy, functools.partial(transformer_auto_wrap_policy, ...)) "
            "or a callable (module, recurse, nonwrapped_numel) -> bool"
        )
    ignored = set(ignored_modules)
    ignored_params = [p for m in ignored for p in m.parameters()]
    found = policies.evaluate_policy(root, auto_wrap_policy, ignored, ignored_params)
    return [(unit.module, unit.overrides) for unit in found]


def _is_container(module: nn.Module) -> bool:
    """ModuleList/ModuleDict without a forward: fully_shard refuses them (FSDP1 only warned)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


# --------------------------------------------------------------------------------------------
# Mesh, precision, offload
# --------------------------------------------------------------------------------------------


def _device_type(device_id: Any) -> str:
    if isinstance(device_id, torch.device):
        return device_id.type
    if isinstance(device_id, str):
        return torch.device(device_id).type
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if isinstance(device_id, int) and accelerator is not None:
        torch.accelerator.set_device_index(device_id)  # FSDP1 used this device for compute
    return accelerator.type if accelerator is not None else "cpu"


def _move_to_device(region: list[nn.Module], device_id: Any) -> None:
    """Move the region's own tensors to FSDP1's `device_id` (an int is an index of the current
    accelerator), in place: parameters stay the same objects (and tied ones stay tied)."""
    if device_id is None:
        return
    if isinstance(device_id, int):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = torch.device("cpu") if accelerator is None else torch.device(accelerator.type, device_id)
    else:
        device = torch.device(device_id)
    with torch.no_grad():
        for sub in region:
            for param in sub.parameters(recurse=False):
                param.data = param.data.to(device)
            for name, buffer in sub.named_buffers(recurse=False):
                setattr(sub, name, buffer.to(device))


def _mesh(fsdp1: types.SimpleNamespace, strategy: ParsedStrategy) -> DeviceMesh:
    """FSDP2's mesh for FSDP1's process_group / device_mesh: the groups are resolved as our
    FSDP1 front-end resolves them; torch's `fully_shard` takes them as one mesh."""
    device_type = _device_type(fsdp1.device_id)
    topology = resolve_topology(strategy.mode, process_group=fsdp1.process_group,
                                device_mesh=fsdp1.device_mesh, device_type=device_type,
                                frontend=FRONTEND, setting=strategy.strategy.name)
    if topology.mesh is not None:
        return _named(topology.mesh)
    if topology.mode is ShardingMode.HYBRID:
        return mesh_of_pair(topology.shard_group, topology.replicate_group, device_type)
    return _flat_mesh(topology, device_type)


def _named(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP1 reads dim 0 of a 2-D mesh as replicate and dim 1 as shard; FSDP2 wants those names."""
    if mesh.ndim == 2 and not mesh.mesh_dim_names:
        return DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=MESH_DIM_NAMES)
    return mesh


def _flat_mesh(topology: Topology, device_type: str) -> DeviceMesh:
    """The mesh of a one-group mode: the whole world unless the user named a group."""
    replicate = topology.mode is ShardingMode.REPLICATE
    group = topology.replicate_group if replicate else topology.shard_group
    if group is not topology.world_group:
        # TODO: FSDP2 replicates only across dim 0 of a 2-D mesh, so NO_SHARD over a group of
        # the user's is sharded over that group instead (the same numbers, more traffic).
        return DeviceMesh.from_group(group, device_type)
    world = dist.get_world_size()
    if replicate:  # every rank a replica: shard groups of one rank
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=MESH_DIM_NAMES)
    return init_device_mesh(device_type, (world,))


def _mp_policy(mixed_precision: Any, root: bool) -> MixedPrecisionPolicy:
    """FSDP2 policy for an FSDP1 `MixedPrecision`, keeping FSDP1's input-casting rules."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision={mixed_precision!r} is not a MixedPrecision; pass "
            "torch.distributed.fsdp.MixedPrecision(param_dtype=..., reduce_dtype=...) or None."
        )
    if mixed_precision.keep_low_precision_grads:
        warnings.warn(
            "MixedPrecision(keep_low_precision_grads=True) has no FSDP2 equivalent: gradients are "
            "upcast to the parameter dtype after reduction.",
            stacklevel=3,
        )
    if root:  # the FSDP1 root casts if cast_root_forward_inputs (default True) or cast_forward_inputs
        cast = mixed_precision.cast_root_forward_inputs or mixed_precision.cast_forward_inputs
    else:
        cast = mixed_precision.cast_forward_inputs
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=cast,
    )


def _offload_policy(cpu_offload: Any) -> OffloadPolicy:
    if cpu_offload is None:
        return OffloadPolicy()
    if isinstance(cpu_offload, OffloadPolicy):
        return cpu_offload
    if isinstance(cpu_offload, CPUOffload):
        if not cpu_offload.offload_params:
            return OffloadPolicy()
        # Pinning host memory needs an accelerator.
        return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    raise TypeError(f"cpu_offload={cpu_offload!r} is not a CPUOffload; pass CPUOffload(offload_params=True) or None.")


def _ignored_params(ignored_modules, ignored_states) -> set[nn.Parameter]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("ignored_modules and ignored_states were both passed; FSDP1 also rejects this. Pass one.")
    params: set[nn.Parameter] = set()
    for item in ignored_modules or ignored_states or ():
        params.update(item.parameters() if isinstance(item, nn.Module) else [item])
    return params


def _fsdp2_kwargs(mesh, strategy: ParsedStrategy, mixed_precision, cpu_offload, ignored, root: bool) -> dict[str, Any]:
    return {
        "mesh": mesh,
        "reshard_after_forward": None if strategy.reshard_after_forward else False,
        "mp_policy": _mp_policy(mixed_precision, root),
        "offload_policy": _offload_policy(cpu_offload),
        "ignored_params": ignored or None,
    }


# --------------------------------------------------------------------------------------------
# The constructor
# --------------------------------------------------------------------------------------------


@_takes_fsdp1_arguments()
def fsdp1_fully_shard(*args: Any, **kwargs: Any) -> nn.Module:
    """`FullyShardedDataParallel(module, ...)` done with FSDP2's `fully_shard`, in place.

    Takes FSDP1's constructor arguments. The wrap policy is evaluated to FSDP1's units, which are
    sharded bottom-up, root last; `backward_prefetch`, `forward_prefetch`, `limit_all_gathers`
    and `use_orig_params` only tune FSDP1's schedule and are not needed by FSDP2.
    Returns `module` itself (FSDP2 has no wrapper), now an `FSDPModule`.
    """
    fsdp1 = _fsdp1_arguments(args, kwargs)
    module, mixed_precision, cpu_offload = fsdp1.module, fsdp1.mixed_precision, fsdp1.cpu_offload
    strategy = parse_sharding_strategy(fsdp1.sharding_strategy)
    mesh = _mesh(fsdp1, strategy)
    ignored = _ignored_params(fsdp1.ignored_modules, fsdp1.ignored_states)
    ignored_module_set = set(fsdp1.ignored_modules or ())
    # Containers and ignored modules are no units: their parameters stay with the enclosing unit.
    units = [(unit, overrides) for unit, overrides in fsdp1_units(module, fsdp1.auto_wrap_policy, ignored_module_set)
             if not _is_container(unit) and unit not in ignored_module_set]
    regions = _regions(module, [unit for unit, _ in units])
    for unit, overrides in units:
        if fsdp1.sync_module_states:
            _sync_region(regions[id(unit)], fsdp1, mesh)
        _check_overrides(overrides)
        unit_strategy = parse_sharding_strategy(overrides.get("sharding_strategy", strategy.strategy),
                                                "auto_wrap_policy (a CustomPolicy override).sharding_strategy")
        unit_mp = overrides.get("mixed_precision", mixed_precision)
        unit_offload = overrides.get("cpu_offload", cpu_offload)
        fully_shard(unit, **_fsdp2_kwargs(mesh, unit_strategy, unit_mp, unit_offload, ignored, root=False))
    if fsdp1.sync_module_states:
        _sync_region(regions[id(module)], fsdp1, mesh)
    _keep_norms_in_fp32(module, mixed_precision, fsdp1.auto_wrap_policy, mesh, strategy, cpu_offload, ignored)
    fully_shard(module, **_fsdp2_kwargs(mesh, strategy, mixed_precision, cpu_offload, ignored, root=True))
    if isinstance(mixed_precision, MixedPrecision) and mixed_precision.buffer_dtype is not None:
        _cast_buffers(module, mixed_precision.buffer_dtype)
    if _has_meta(module):
        _materialize(module, fsdp1.param_init_fn, mesh.device_type)
    return module


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _regions(root: nn.Module, units: list[nn.Module]) -> dict[int, list[nn.Module]]:
    """Each unit's region, by the unit's id: the modules whose innermost enclosing unit it is
    (`units` children first; the root's region is what no unit claims)."""
    owner: dict[int, nn.Module] = {}
    for unit in [*units, root]:
        for sub in unit.modules():
            owner.setdefault(id(sub), unit)
    return {id(unit): [sub for sub in unit.modules() if owner[id(sub)] is unit] for unit in [*units, root]}


def _own_tensors(region: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers the region's modules hold themselves (a tied one once)."""
    seen: dict[int, torch.Tensor] = {}
    for sub in region:
        for tensor in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _sync_region(region: list[nn.Module], fsdp1: types.SimpleNamespace, mesh: DeviceMesh) -> None:
    """`sync_module_states=True` for one unit, just before it is sharded, as FSDP1 does it: the
    unit's meta tensors are materialised (a rank that built the model on meta, the low-CPU-memory
    recipe, must join the same broadcasts as rank 0), moved to `device_id` (NCCL cannot broadcast
    tensors of a model rank 0 built on the CPU) and broadcast from the first rank. One unit at a
    time: no rank ever holds more than one unit unsharded, or the recipe for models larger than one
    device runs out of memory."""
    if any(t.is_meta for t in _own_tensors(region)):
        named = [("", sub) for sub in region]
        _, error = materialize_region(named, _init_device(mesh.device_type), fsdp1.param_init_fn)
        if error is not None:
            raise error
        problem = region_problem(named, fsdp1.param_init_fn)
        if problem is not None:
            raise ValueError(f"sync_module_states=True: {problem}")
    _move_to_device(region, fsdp1.device_id)
    _broadcast_from_first_rank(region, mesh)

# CustomPolicy overrides: applied per unit, or not needed by FSDP2 (it schedules prefetching itself).
_APPLIED_OVERRIDES = {"sharding_strategy", "mixed_precision", "cpu_offload"}
_UNNEEDED_OVERRIDES = {"backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params", "device_id"}


def _check_overrides(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - _APPLIED_OVERRIDES - _UNNEEDED_OVERRIDES)
    if unknown:
        raise ValueError(
            f"auto_wrap_policy: a CustomPolicy override sets {', '.join(unknown)} for one module; "
            f"fully_shard can only vary {', '.join(sorted(_APPLIED_OVERRIDES))} per module. Move "
            "these settings to the FullyShardedDataParallel(...) call, or shard that module by hand."
        )


def _keep_norms_in_fp32(module, mixed_precision, policy, mesh, strategy, cpu_offload, ignored) -> None:
    """FSDP1 (with a policy) wraps `_module_classes_to_ignore` (BatchNorm) separately in fp32."""
    if policy is None or not isinstance(mixed_precision, MixedPrecision) or mixed_precision.param_dtype is None:
        return
    classes = tuple(mixed_precision._module_classes_to_ignore or ())
    for unit in policies.post_order(module):
        if classes and isinstance(unit, classes) and unit is not module and not isinstance(unit, FSDPModule):
            kwargs = _fsdp2_kwargs(mesh, strategy, None, cpu_offload, ignored, root=False)
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.float32, output_dtype=mixed_precision.param_dtype, cast_forward_inputs=True
            )
            fully_shard(unit, **kwargs)


def _broadcast_from_first_rank(region: list[nn.Module], mesh: DeviceMesh) -> None:
    """`sync_module_states=True`: every rank starts from the first rank's parameters and buffers
    (those the region's modules hold themselves).

    Broadcasting along each mesh dimension from its first member reaches every rank (FSDP2 has
    no such flag; its recipe is a full state dict broadcast, which needs rank 0's copy anyway).
    """
    with torch.no_grad():
        for tensor in _own_tensors(region):
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    warnings.warn(
        f"MixedPrecision(buffer_dtype={dtype}) has no FSDP2 or YaFSDP field: floating-point buffers are cast "
        "once now (checkpoints will hold them in that dtype, FSDP1 saved them in full precision).",
        stacklevel=3,
    )
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point():
                setattr(sub, name, buffer.to(dtype))


def _init_device(device_type: str) -> torch.device:
    """Where meta tensors get their storage: the CPU, or the current accelerator."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def _materialize(module: nn.Module, param_init_fn, device_type: str) -> None:
    """FSDP2's meta-device recipe: shard first, then allocate and initialize."""
    device = _init_device(device_type)
    if param_init_fn is not None:  # FSDP1 calls it on each module that holds meta tensors
        for sub in module.modules():
            local = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            if any(t.is_meta for t in local):
                param_init_fn(sub)
        return
    module.to_empty(device=device)
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------


def _under_activation_wrappers(model: Any) -> Any:
    """The module inside torch's activation checkpoint or offload wrappers (`checkpoint_wrapper`,
    `offload_wrapper`): they forward attribute reads to it, which is how FSDP1's methods were
    reached through them; the migrated model's methods are not, so the helpers look inside."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    while isinstance(model, ActivationWrapper):
        model = model._checkpoint_wrapped_module
    return model


@contextlib.contextmanager
def fsdp1_no_sync(model: nn.Module) -> Iterator[None]:
    """`with model.no_sync():` for FSDP2 modules (and anything else that has `no_sync`), also
    under an activation checkpoint or offload wrapper.

    Gradient sync is switched off for the block and restored even if the block raises.
    """
    sharded = _under_activation_wrappers(model)
    if isinstance(sharded, FSDPModule):
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)
        return
    with model.no_sync():
        yield


def fsdp1_clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`model.clip_grad_norm_(max_norm, norm_type)` for FSDP2 modules (also under an activation
    checkpoint or offload wrapper, through which FSDP1's method was reached): a plain tensor."""
    if not isinstance(_under_activation_wrappers(model), FSDPModule):
        return model.clip_grad_norm_(max_norm, norm_type)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def fsdp1_state_dict_options(
    state_dict_type: StateDictType,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
    *,
    for_optimizer: bool = False,
) -> StateDictOptions:
    """`StateDictOptions` equivalent to an FSDP1 `state_dict_type(...)` setting."""
    if state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            "state_dict_type=LOCAL_STATE_DICT has no FSDP2 form (there is no flat parameter); "
            "use StateDictType.SHARDED_STATE_DICT (DTensor shards) or FULL_STATE_DICT."
        )
    config = optim_state_dict_config if for_optimizer else state_dict_config
    # FSDP1's defaults: the optimizer's full config offloads, the model's does not.
    offload = bool(getattr(config, "offload_to_cpu", for_optimizer and config is None))
    if state_dict_type == StateDictType.SHARDED_STATE_DICT:
        return StateDictOptions(full_state_dict=False, cpu_offload=offload)
    if state_dict_type != StateDictType.FULL_STATE_DICT:
        raise ValueError(f"state_dict_type={state_dict_type!r} is not a StateDictType; pass "
                         "FULL_STATE_DICT or SHARDED_STATE_DICT.")
    # DCP's cpu_offload with a full state dict means "on rank 0 only, on CPU".
    rank0_only = bool(getattr(config, "rank0_only", False))
    if offload != rank0_only:
        name = "optim_state_dict_config" if for_optimizer else "state_dict_config"
        warnings.warn(
            f"{name}: offload_to_cpu={offload} with rank0_only={rank0_only} has no StateDictOptions form "
            "(DCP's cpu_offload means both at once): the full state dict is "
            + ("on the CPU of rank 0 only" if rank0_only else "in device memory on every rank"), stacklevel=2)
    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)


def fsdp1_optim_state_dict_to_load(model: nn.Module, optim, optim_state_dict: dict, options=None) -> dict:
    """FSDP1's `optim_state_dict_to_load`: the state dict to pass to `optim.load_state_dict`,
    with `optim` left as it was.

    DCP's `set_optimizer_state_dict` is the only torch call that reshards an optimizer state,
    and it loads it: the state is loaded, read back, and the optimizer's own state put back,
    since FSDP1's call changed nothing (a script may load the result later, or never).
    Without `options`, those of an active `fsdp1_state_dict_type` context apply (FULL otherwise).
    torch 2.0 took the arguments as `(optim_state_dict, model, optim)`; code written for it passes
    them so, which the types show (a dict first, then the module), so that order is accepted too.
    """
    if isinstance(model, dict) and isinstance(optim, nn.Module):
        model, optim, optim_state_dict = optim, optim_state_dict, model
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fsdp1_optim_state_dict_to_load: model={type(model).__name__} is not a module; pass "
            "(model, optim, optim_state_dict) as torch 2.1+ does, or torch 2.0's (optim_state_dict, model, optim)."
        )
    options = _as_load_options(options or _active_options(model, True))
    if options.broadcast_from_rank0 and optim_state_dict is None:
        optim_state_dict = {}  # FSDP1's rank0_only load: the ranks after 0 pass None
    own = copy.deepcopy(optim.state_dict())
    set_optimizer_state_dict(model, optim, optim_state_dict, options=options)
    to_load = optim.state_dict()
    optim.load_state_dict(own)
    return to_load


def _as_load_options(options: StateDictOptions) -> StateDictOptions:
    """Options for loading an optimizer state, from those that would take it under the same FSDP1
    config. A full state dict offloaded to the CPU means FSDP1's rank0_only there (DCP's
    cpu_offload is "rank 0 only, on the CPU"); loading under rank0_only, rank 0 passes the full
    state and FSDP1 broadcasts it to the other ranks, which is DCP's broadcast_from_rank0."""
    if options.full_state_dict and options.cpu_offload:
        return dataclasses.replace(options, cpu_offload=False, broadcast_from_rank0=True)
    return options


# --------------------------------------------------------------------------------------------
# State-dict settings held in variables
# --------------------------------------------------------------------------------------------

# [Note: state-dict settings at run time]
# FSDP1's `state_dict_type(model, ...)` is a mode: every state-dict call on `model` (or on a module
# inside it) made while the context is open uses it. FSDP2 has no mode; options are passed per
# call. When a script holds the context in a variable or builds it in a helper, the codemod routes
# the context and the file's state-dict calls here: the context records its options for its
# module, and the calls look them up, so each call gets the options FSDP1 would have used.


@dataclasses.dataclass(frozen=True)
class _Setting:
    module: nn.Module
    model: StateDictOptions
    optim: StateDictOptions


_ACTIVE: list[_Setting] = []


def _holds_fsdp2(module: Any) -> bool:
    return isinstance(module, nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def _active_setting(model: nn.Module) -> _Setting | None:
    for setting in reversed(_ACTIVE):
        if setting.module is model or any(sub is model for sub in setting.module.modules()):
            return setting
    return None


def _active_options(model: nn.Module, for_optimizer: bool) -> StateDictOptions:
    setting = _active_setting(model)
    if setting is None:
        return StateDictOptions(full_state_dict=True)  # FSDP1's default state-dict type is FULL
    return setting.optim if for_optimizer else setting.model


@contextlib.contextmanager
def fsdp1_state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """`FSDP.state_dict_type(module, ...)` for FSDP2 modules (FSDP1's own context otherwise).

    Applies to the state-dict helpers of this module (`fsdp1_state_dict`, ...), see the note above.
    """
    if not _holds_fsdp2(module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.state_dict_type(module, state_dict_type, state_dict_config,
                                                      optim_state_dict_config):
            yield
        return
    setting = _Setting(
        module,
        fsdp1_state_dict_options(state_dict_type, state_dict_config, optim_state_dict_config),
        fsdp1_state_dict_options(state_dict_type, state_dict_config, optim_state_dict_config, for_optimizer=True),
    )
    _ACTIVE.append(setting)
    try:
        yield
    finally:
        _ACTIVE.remove(setting)


def fsdp1_state_dict(model: nn.Module, options: StateDictOptions | None = None) -> dict[str, Any]:
    """`model.state_dict()` with FSDP1's meaning: options given, or of the active context, or FULL."""
    if not _holds_fsdp2(model):
        return model.state_dict()
    return get_model_state_dict(model, options=options or _active_options(model, False))


def fsdp1_load_state_dict(model: nn.Module, state_dict: dict, options: StateDictOptions | None = None,
                          strict: bool | None = None):
    """`model.load_state_dict(state_dict, strict=...)` with FSDP1's meaning (see `fsdp1_state_dict`);
    `strict` overrides that of `options`."""
    if not _holds_fsdp2(model):
        return model.load_state_dict(state_dict) if strict is None else model.load_state_dict(state_dict, strict)
    options = options or _active_options(model, False)
    if strict is not None:
        options = dataclasses.replace(options, strict=strict)
    return set_model_state_dict(model, state_dict, options=options)


def fsdp1_optim_state_dict(model: nn.Module, optim, options: StateDictOptions | None = None) -> dict[str, Any]:
    """`FSDP.optim_state_dict(model, optim)` (and `full_optim_state_dict`) under the given options,
    or those of the active state-dict setting.

    FSDP1 returns copies; DCP hands back some of the optimizer's own state tensors (Adam's
    `step`, unsharded entries), which later steps would change under a state dict kept in memory.
    Those are copied.

    With no options and no active setting, FSDP1's default optimizer config applies (a full state
    dict on every rank, offloaded to the CPU): DCP offloads a full state dict only on rank 0, so
    every rank gathers it and moves it to the CPU here, with a warning where that gather went
    through device memory (FSDP1 offloads one parameter's state at a time).
    """
    default = options is None and _active_setting(model) is None
    state = get_optimizer_state_dict(model, optim, options=options or _active_options(model, True))
    if default:
        state = _on_cpu(state)
    live = {id(value) for entry in optim.state.values() for value in entry.values() if torch.is_tensor(value)}
    for entry in state.get("state", {}).values():
        for key, value in entry.items():
            if id(value) in live:
                entry[key] = value.detach().clone()
    return state


def _on_cpu(state: dict) -> dict:
    """An optimizer state dict with its state tensors on the CPU (warned when any was not)."""
    moved = False
    for entry in state.get("state", {}).values():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.device.type != "cpu":
                entry[key], moved = value.cpu(), True
    if moved:
        warnings.warn(
            "FSDP.optim_state_dict outside a state_dict_type context (FSDP1's default optimizer config: "
            "full on every rank, offloaded to the CPU): every rank gathered the full optimizer state in "
            "device memory before moving it to the CPU. Pass options=StateDictOptions(full_state_dict=True, "
            "cpu_offload=True) if rank 0's copy is enough.", stacklevel=3)
    return state


def fsdp1_scatter_full_optim_state_dict(full_optim_state_dict: dict | None, model: nn.Module, optim) -> dict:
    """`FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim)`: rank 0's full optimizer
    state loaded on every rank (`broadcast_from_rank0`); returns the loaded optimizer state."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optim, full_optim_state_dict or {}, options=options)
    return optim.state_dict()


def fsdp1_load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str,
                                            storage_reader: Any, planner: Any = None) -> dict[str, Any]:
    """torch's `load_sharded_optimizer_state_dict` for a model whose sharded state dict holds
    DTensors (FSDP2, YaFSDP): `{optimizer_key: state}` read from a DCP checkpoint, each state
    tensor of a parameter sharded as that parameter is, for `set_optimizer_state_dict`.

    torch's own function builds FSDP1 ShardedTensors, which an FSDP2 optimizer cannot step with;
    it is still what runs for a state dict of ShardedTensors (a model left as FSDP1).
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    sharded = [value for value in model_state_dict.values() if isinstance(value, DTensor)]
    if not sharded:
        return load_sharded_optimizer_state_dict(model_state_dict, optimizer_key, storage_reader, planner)
    device = sharded[0].device
    metadata = storage_reader.read_metadata()
    placeholders: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] != optimizer_key:
            continue
        if isinstance(stored, BytesStorageMetadata):
            placeholders[key] = "<bytes_io>"  # param_groups and other pickled entries
            continue
        # ("optim", "state", <parameter name>, <state name>): shaped as the parameter, sharded as it.
        like = model_state_dict.get(path[2]) if len(path) == 4 and path[1] == "state" else None
        if isinstance(like, DTensor) and like.shape == stored.size:
            placeholders[key] = torch.empty_like(like, dtype=stored.properties.dtype)
        else:
            placeholders[key] = torch.empty(stored.size, dtype=stored.properties.dtype, device=device)
    dcp_load(placeholders, storage_reader=storage_reader, planner=planner)
    return _nested(placeholders, metadata.planner_data)


def _nested(flat: dict[str, Any], paths: dict[str, tuple]) -> dict[str, Any]:
    """A flat DCP state dict put back into its nesting: `paths` gives each flat key's path of
    dict keys and list indices, as DCP's metadata records it."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node: Any = root
        path = paths[key]
        for part, following in zip(path, path[1:]):
            empty: Any = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                node.extend([None] * (part + 1 - len(node)))
                node[part] = empty if node[part] is None else node[part]
            else:
                node.setdefault(part, empty)
            node = node[part]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


def fsdp1_fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
    """`FSDP.fsdp_modules(module)`: the FSDP2 modules in `module` (itself included), in order.

    FSDP1 wrappers count too (torch's, or ours): a file may keep an FSDP1 constructor the
    migration could not translate (a subclass, a partial), and the code walking the units of
    such a model must still find them rather than an empty list."""
    found = [m for m in module.modules() if isinstance(m, (FSDPModule, FullyShardedDataParallel, TorchFSDP))]
    if root_only:
        nested = {id(sub) for m in found for sub in list(m.modules())[1:]}
        found = [m for m in found if id(m) not in nested]
    return found


def fsdp1_module_class(module: Any) -> type:
    """`type(module)` as FSDP1's module tree showed it: `fully_shard` gives each module it shards a
    class of its own, `FSDP<Name>(FSDPModule, <the module's class>)`, and this is the module's
    class from before; for any other object, its own class."""
    cls = type(module)
    if isinstance(module, FSDPModule) and len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[1]
    return cls


def fsdp1_unwrap(model: nn.Module) -> nn.Module:
    """`model.module` where `model` may be a rewritten FSDP model: FSDP2 and YaFSDP have no wrapper
    (the model is the model, also under an activation checkpoint or offload wrapper, through which
    FSDP1's `.module` was read), anything else (DDP, an FSDP1 wrapper) keeps its `.module`."""
    ya_fsdp = sys.modules.get("fsdp_bridge.ya_fsdp")
    sharded = _under_activation_wrappers(model)
    if isinstance(sharded, FSDPModule) or (ya_fsdp is not None and isinstance(sharded, ya_fsdp.YaFSDP)):
        return sharded
    return model.module


# --------------------------------------------------------------------------------------------
# --to yafsdp
# --------------------------------------------------------------------------------------------


def yafsdp_zero_stage(sharding_strategy: Any) -> int:
    """YaFSDP's `zero_stage` for an FSDP1 strategy: FULL_SHARD -> 3, SHARD_GRAD_OP -> 2."""
    strategy = parse_sharding_strategy(sharding_strategy).strategy
    stages = {ShardingStrategy.FULL_SHARD: 3, ShardingStrategy.SHARD_GRAD_OP: 2}
    if strategy not in stages:
        raise ValueError(
            f"sharding_strategy={strategy.name} has no YaFSDP zero_stage; YaFSDP accepts FULL_SHARD "
            "(zero_stage=3) and SHARD_GRAD_OP (zero_stage=2). Use --to fsdp2 for hybrid or NO_SHARD."
        )
    return stages[strategy]


def yafsdp_modules_to_wrap(
    model: nn.Module, auto_wrap_policy: Any, ignored_modules: Iterable[nn.Module] = ()
) -> list[tuple[nn.Module, str]]:
    """YaFSDP's `modules_to_wrap_with_names` for an FSDP1 wrap policy (FSDP1's units, by name)."""
    names = {m: name for name, m in model.named_modules()}
    units = fsdp1_units(model, auto_wrap_policy, ignored_modules)
    for unit, overrides in units:
        varied = sorted(set(overrides) - _UNNEEDED_OVERRIDES)
        if varied:
            raise ValueError(
                f"auto_wrap_policy: a CustomPolicy sets {', '.join(varied)} for module {names[unit]!r}; "
                "YaFSDP applies one setting to every module, so these per-module keyword dicts cannot be "
                "honoured. Return True instead of a dict from the policy (the settings then come from "
                "the FullyShardedDataParallel(...) call), or migrate with --to fsdp2."
            )
    return [(m, names[m]) for m, _ in units if not _is_container(m)]


def _yafsdp_reduces_in_param_dtype(mixed_precision: Any) -> bool:
    """YaFSDP's `bit16_reduce_scatter` for FSDP1's MixedPrecision: FSDP1 reduces in `reduce_dtype`,
    or in `param_dtype` when that is unset; YaFSDP reduces in fp32 or in `param_dtype`."""
    if not isinstance(mixed_precision, MixedPrecision) or mixed_precision.param_dtype in (None, torch.float32):
        return False
    reduce = mixed_precision.reduce_dtype or mixed_precision.param_dtype
    if reduce not in (torch.float32, mixed_precision.param_dtype):
        raise ValueError(
            f"mixed_precision: MixedPrecision(reduce_dtype={reduce}) with param_dtype="
            f"{mixed_precision.param_dtype} has no YaFSDP equivalent; YaFSDP reduces gradients in fp32 "
            "or in param_dtype. Set reduce_dtype to one of those, or migrate with --to fsdp2 instead."
        )
    return reduce == mixed_precision.param_dtype


_GRADIENT_ACCUMULATION_STEPS = inspect.Parameter(
    "gradient_accumulation_steps", inspect.Parameter.KEYWORD_ONLY, default=1, annotation="int")


@_takes_fsdp1_arguments(_GRADIENT_ACCUMULATION_STEPS)
def yafsdp_unit_state_dict(root: nn.Module, unit_name: str, rank0_only: bool = False) -> dict[str, Any]:
    """The full state dict of the unit named `unit_name` in the YaFSDP model `root` (as FSDP1's
    `unit.state_dict()` under a full `state_dict_type` gave it): YaFSDP's units are plain modules,
    so the root's full state dict is taken and the keys under that name kept, relative to it."""
    state = root.state_dict(rank0_only=rank0_only)
    # A walk over the YaFSDP model names its modules through the wrapper's inner attribute
    # (`_module.0.adapter`); its state dict leaves that name out, as FSDP1's did its own.
    hidden = getattr(type(root), "_hidden_child", None)
    if hidden and (unit_name == hidden or unit_name.startswith(hidden + ".")):
        unit_name = unit_name[len(hidden) + 1:]
    if not unit_name:
        return state
    prefix = unit_name + "."
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def fsdp1_to_yafsdp(*args: Any, gradient_accumulation_steps: int = 1, **kwargs: Any):
    """`FullyShardedDataParallel(module, ...)` as `fsdp_bridge.ya_fsdp.YaFSDP(...)`.

    YaFSDP needs `gradient_accumulation_steps` up front (FSDP1 learnt it from `no_sync`).
    """
    from fsdp_bridge.ya_fsdp import YaFSDP  # imported when used: only --to yafsdp needs it

    fsdp1 = _fsdp1_arguments(args, kwargs)
    unsupported = {
        "cpu_offload": fsdp1.cpu_offload is not None and getattr(fsdp1.cpu_offload, "offload_params", True),
        "ignored_modules": bool(fsdp1.ignored_modules),
        "ignored_states": bool(fsdp1.ignored_states),
        "device_mesh": fsdp1.device_mesh is not None,
        "a tuple process_group": isinstance(fsdp1.process_group, tuple),
    }
    for name, present in unsupported.items():
        if present:
            raise ValueError(
                f"{name} has no YaFSDP equivalent; remove it, or migrate with --to fsdp2 instead."
            )
    mixed_precision = fsdp1.mixed_precision
    param_dtype = mixed_precision.param_dtype if isinstance(mixed_precision, MixedPrecision) else None
    if isinstance(mixed_precision, MixedPrecision) and mixed_precision.buffer_dtype is not None:
        _cast_buffers(fsdp1.module, mixed_precision.buffer_dtype)
    if isinstance(mixed_precision, MixedPrecision) and mixed_precision.keep_low_precision_grads:
        warnings.warn("MixedPrecision(keep_low_precision_grads=True) has no YaFSDP field: gradients are "
                      "kept in fp32", stacklevel=2)
    return YaFSDP(
        fsdp1.module,
        zero_stage=yafsdp_zero_stage(fsdp1.sharding_strategy),
        modules_to_wrap_with_names=yafsdp_modules_to_wrap(fsdp1.module, fsdp1.auto_wrap_policy,
                                                          fsdp1.ignored_modules or ()),
        param_dtype=param_dtype if param_dtype is not None else torch.float32,
        bit16_reduce_scatter=_yafsdp_reduces_in_param_dtype(mixed_precision),
        gradient_accumulation_steps=gradient_accumulation_steps,
        sync_module_states=fsdp1.sync_module_states,
        param_init_fn=fsdp1.param_init_fn,
        device_id=fsdp1.device_id,
        data_parallel_process_group=fsdp1.process_group,
    )
