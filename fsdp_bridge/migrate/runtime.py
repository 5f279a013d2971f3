"""Run-time translation of FSDP1 values, for code rewritten by `fsdp-bridge migrate`.

Real training code passes FSDP1 settings through variables, config objects and `**kwargs`, which a
codemod cannot read. The codemods translate literals in place and route everything else here:
these helpers take FSDP1's own arguments and do, when the script runs, exactly what the codemod
does for literals. This module imports torch only (never the fsdp_bridge engine), so a rewritten
script depends on nothing else of ours.

--to fsdp2:  fsdp1_fully_shard, fsdp1_no_sync, fsdp1_clip_grad_norm_, fsdp1_state_dict_options,
             fsdp1_state_dict_type, fsdp1_state_dict, fsdp1_load_state_dict, fsdp1_optim_state_dict,
             fsdp1_optim_state_dict_to_load, fsdp1_scatter_full_optim_state_dict, fsdp1_fsdp_modules,
             fsdp1_unwrap
--to yafsdp: fsdp1_to_yafsdp, yafsdp_zero_stage, yafsdp_modules_to_wrap, fsdp1_unwrap
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator

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
    BackwardPrefetch,
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
from torch.distributed.fsdp.wrap import _Policy, _recursive_wrap

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
    "fsdp1_fsdp_modules",
    "fsdp1_unwrap",
    "fsdp1_to_yafsdp",
    "yafsdp_zero_stage",
    "yafsdp_modules_to_wrap",
]

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# FSDP1 strategies that keep parameters unsharded between forward and backward.
NO_RESHARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy.NO_SHARD)


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
    Torch's own policy machinery is reused, so the grouping is FSDP1's exactly, including the
    numel bookkeeping of `size_based_auto_wrap_policy`.
    """
    if auto_wrap_policy is None:
        return []
    ignored = set(ignored_modules)
    if isinstance(auto_wrap_policy, _Policy):  # ModuleWrapPolicy, CustomPolicy
        targets = auto_wrap_policy._run_policy(root, ignored, {})
        return [(m, dict(targets[m])) for m in _post_order(root) if m in targets and m is not root]
    if not callable(auto_wrap_policy):
        raise TypeError(
            f"auto_wrap_policy={auto_wrap_policy!r} is not a wrap policy: pass a torch wrap policy "
            "(ModuleWrapPolicy, CustomPolicy, functools.partial(transformer_auto_wrap_policy, ...)) "
            "or a callable (module, recurse, nonwrapped_numel) -> bool"
        )
    recorded: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        recorded.append(module)
        return module  # setattr(parent, name, module) is then a no-op

    ignored_params = {p for m in ignored for p in m.parameters()}
    _recursive_wrap(root, auto_wrap_policy, record, ignored, ignored_params, only_wrap_children=True)
    return [(m, {}) for m in recorded]


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Children (in registration order) before their parent, each module once: FSDP1's order."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(root)
    return order


def _is_container(module: nn.Module) -> bool:
    """ModuleList/ModuleDict without a forward: fully_shard refuses them (FSDP1 only warned)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


# --------------------------------------------------------------------------------------------
# Mesh, strategy, precision, offload
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


def _mesh(strategy, process_group, device_mesh, device_type: str) -> DeviceMesh:
    """FSDP2's mesh for FSDP1's process_group / device_mesh / strategy."""
    names = ("replicate", "shard")
    hybrid = strategy in HYBRID
    if device_mesh is not None and process_group is not None:
        raise ValueError(
            "process_group and device_mesh were both passed; FSDP1 also rejects this. Pass one of them."
        )
    if device_mesh is not None:
        if hybrid and device_mesh.ndim == 2 and not device_mesh.mesh_dim_names:
            # FSDP1 reads dim 0 as replicate and dim 1 as shard; FSDP2 wants those names.
            return DeviceMesh(device_mesh.device_type, device_mesh.mesh, mesh_dim_names=names)
        return device_mesh
    if isinstance(process_group, tuple):  # FSDP1's hybrid (shard_pg, replicate_pg)
        shard_pg, replicate_pg = process_group
        layout = [None] * dist.get_world_size()
        dist.all_gather_object(layout, (dist.get_rank(replicate_pg), dist.get_rank(shard_pg)))
        grid = torch.empty(dist.get_world_size(replicate_pg), dist.get_world_size(shard_pg), dtype=torch.int)
        for global_rank, (r, s) in enumerate(layout):
            grid[r, s] = global_rank
        return DeviceMesh.from_group([replicate_pg, shard_pg], device_type, mesh=grid, mesh_dim_names=names)
    if process_group is not None:
        return DeviceMesh.from_group(process_group, device_type)
    world = dist.get_world_size()
    if strategy == ShardingStrategy.NO_SHARD:  # replicate everywhere, shard groups of one
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=names)
    if hybrid:
        # FSDP1 shards within a node; on CPU its node size is 1 and it silently stops syncing
        # replicas (pytorch#154888). We use the launcher's node size and a correct 2-D mesh.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % local:
            raise ValueError(
                f"sharding_strategy={strategy} needs world size ({world}) divisible by the node size "
                f"LOCAL_WORLD_SIZE={local}; pass device_mesh=init_device_mesh(..., (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard')) explicitly."
            )
        return init_device_mesh(device_type, (world // local, local), mesh_dim_names=names)
    return init_device_mesh(device_type, (world,))


def _strategy(value: Any) -> ShardingStrategy:
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        return ShardingStrategy[value.upper()]
    raise ValueError(
        f"sharding_strategy={value!r} is not a ShardingStrategy; accepted: "
        f"{', '.join(ShardingStrategy.__members__)} (or their names as strings)."
    )


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


def _fsdp2_kwargs(mesh, strategy, mixed_precision, cpu_offload, ignored, root: bool) -> dict[str, Any]:
    return {
        "mesh": mesh,
        "reshard_after_forward": False if strategy in NO_RESHARD else None,
        "mp_policy": _mp_policy(mixed_precision, root),
        "offload_policy": _offload_policy(cpu_offload),
        "ignored_params": ignored or None,
    }


# --------------------------------------------------------------------------------------------
# The constructor
# --------------------------------------------------------------------------------------------


def fsdp1_fully_shard(
    module: nn.Module,
    process_group: Any = None,
    sharding_strategy: ShardingStrategy | None = None,
    cpu_offload: CPUOffload | None = None,
    auto_wrap_policy: Any = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    mixed_precision: MixedPrecision | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device_id: int | torch.device | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    use_orig_params: bool = False,
    ignored_states: Iterable[Any] | None = None,
    device_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """`FullyShardedDataParallel(module, ...)` done with FSDP2's `fully_shard`, in place.

    Takes FSDP1's constructor arguments. The wrap policy is evaluated to FSDP1's units, which are
    sharded bottom-up, root last; `backward_prefetch`, `forward_prefetch`, `limit_all_gathers`
    and `use_orig_params` only tune FSDP1's schedule and are not needed by FSDP2.
    Returns `module` itself (FSDP2 has no wrapper), now an `FSDPModule`.
    """
    strategy = _strategy(sharding_strategy)
    mesh = _mesh(strategy, process_group, device_mesh, _device_type(device_id))
    ignored = _ignored_params(ignored_modules, ignored_states)
    ignored_module_set = set(ignored_modules or ())
    if sync_module_states:
        # FSDP1 materialises meta tensors before it broadcasts: a rank that built the model on
        # meta (the low-CPU-memory recipe) must join the same broadcasts as rank 0.
        if _has_meta(module):
            _materialize(module, param_init_fn, mesh.device_type)
        _broadcast_from_first_rank(module, mesh)
    units = fsdp1_units(module, auto_wrap_policy, ignored_module_set)
    for unit, overrides in units:
        if _is_container(unit) or unit in ignored_module_set:
            continue  # its parameters stay with the enclosing unit
        _check_overrides(overrides)
        unit_strategy = _strategy(overrides.get("sharding_strategy", strategy))
        unit_mp = overrides.get("mixed_precision", mixed_precision)
        unit_offload = overrides.get("cpu_offload", cpu_offload)
        fully_shard(unit, **_fsdp2_kwargs(mesh, unit_strategy, unit_mp, unit_offload, ignored, root=False))
    _keep_norms_in_fp32(module, mixed_precision, auto_wrap_policy, mesh, strategy, cpu_offload, ignored)
    fully_shard(module, **_fsdp2_kwargs(mesh, strategy, mixed_precision, cpu_offload, ignored, root=True))
    if isinstance(mixed_precision, MixedPrecision) and mixed_precision.buffer_dtype is not None:
        _cast_buffers(module, mixed_precision.buffer_dtype)
    if _has_meta(module):
        _materialize(module, param_init_fn, mesh.device_type)
    return module


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


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
    for unit in _post_order(module):
        if classes and isinstance(unit, classes) and unit is not module and not isinstance(unit, FSDPModule):
            kwargs = _fsdp2_kwargs(mesh, strategy, None, cpu_offload, ignored, root=False)
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.float32, output_dtype=mixed_precision.param_dtype, cast_forward_inputs=True
            )
            fully_shard(unit, **kwargs)


def _broadcast_from_first_rank(module: nn.Module, mesh: DeviceMesh) -> None:
    """`sync_module_states=True`: every rank starts from the first rank's parameters and buffers.

    Broadcasting along each mesh dimension from its first member reaches every rank (FSDP2 has
    no such flag; its recipe is a full state dict broadcast, which needs rank 0's copy anyway).
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    warnings.warn(
        f"MixedPrecision(buffer_dtype={dtype}) has no FSDP2 field: floating-point buffers are cast "
        "once now (checkpoints will hold them in that dtype, FSDP1 saved them in full precision).",
        stacklevel=3,
    )
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point():
                setattr(sub, name, buffer.to(dtype))


def _materialize(module: nn.Module, param_init_fn, device_type: str) -> None:
    """FSDP2's meta-device recipe: shard first, then allocate and initialize."""
    device = torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else torch.device("cpu")
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


@contextlib.contextmanager
def fsdp1_no_sync(model: nn.Module) -> Iterator[None]:
    """`with model.no_sync():` for FSDP2 modules (and anything else that has `no_sync`).

    Gradient sync is switched off for the block and restored even if the block raises.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    with model.no_sync():
        yield


def fsdp1_clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`model.clip_grad_norm_(max_norm, norm_type)` for FSDP2 modules: returns a plain tensor."""
    if not isinstance(model, FSDPModule):
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
    if state_dict_type == StateDictType.SHARDED_STATE_DICT:
        return StateDictOptions(full_state_dict=False)
    if state_dict_type != StateDictType.FULL_STATE_DICT:
        raise ValueError(f"state_dict_type={state_dict_type!r} is not a StateDictType; pass FULL_STATE_DICT or SHARDED_STATE_DICT.")
    config = optim_state_dict_config if for_optimizer else state_dict_config
    # DCP's cpu_offload with a full state dict means "on rank 0 only, on CPU".
    return StateDictOptions(full_state_dict=True, cpu_offload=bool(getattr(config, "rank0_only", False)))


def fsdp1_optim_state_dict_to_load(model: nn.Module, optim, optim_state_dict: dict, options=None) -> dict:
    """FSDP1's `optim_state_dict_to_load`: loads the state into `optim` and returns its state dict.

    FSDP1 returned a dict for `optim.load_state_dict(...)`; DCP loads directly. Returning the
    loaded optimizer's own state dict keeps that following `load_state_dict` call harmless.
    Without `options`, those of an active `fsdp1_state_dict_type` context apply (FULL otherwise).
    """
    set_optimizer_state_dict(model, optim, optim_state_dict, options=options or _active_options(model, True))
    return optim.state_dict()


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


def _active_options(model: nn.Module, for_optimizer: bool) -> StateDictOptions:
    for setting in reversed(_ACTIVE):
        if setting.module is model or any(sub is model for sub in setting.module.modules()):
            return setting.optim if for_optimizer else setting.model
    return StateDictOptions(full_state_dict=True)  # FSDP1's default state-dict type is FULL


@contextlib.contextmanager
def fsdp1_state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Iterator[None]:
    """`FSDP.state_dict_type(module, ...)` for FSDP2 modules (FSDP1's own context otherwise).

    Applies to the state-dict helpers of this module (`fsdp1_state_dict`, ...), see the note above.
    """
    if not _holds_fsdp2(module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config):
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


def fsdp1_load_state_dict(model: nn.Module, state_dict: dict, options: StateDictOptions | None = None):
    """`model.load_state_dict(state_dict)` with FSDP1's meaning (see `fsdp1_state_dict`)."""
    if not _holds_fsdp2(model):
        return model.load_state_dict(state_dict)
    return set_model_state_dict(model, state_dict, options=options or _active_options(model, False))


def fsdp1_optim_state_dict(model: nn.Module, optim, options: StateDictOptions | None = None) -> dict[str, Any]:
    """`FSDP.optim_state_dict(model, optim)` (and `full_optim_state_dict`) under the given options,
    or those of the active state-dict setting.

    FSDP1 returns copies; DCP hands back some of the optimizer's own state tensors (Adam's
    `step`, unsharded entries), which later steps would change under a state dict kept in memory.
    Those are copied.
    """
    state = get_optimizer_state_dict(model, optim, options=options or _active_options(model, True))
    live = {id(value) for entry in optim.state.values() for value in entry.values() if torch.is_tensor(value)}
    for entry in state.get("state", {}).values():
        for key, value in entry.items():
            if id(value) in live:
                entry[key] = value.detach().clone()
    return state


def fsdp1_scatter_full_optim_state_dict(full_optim_state_dict: dict | None, model: nn.Module, optim) -> dict:
    """`FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim)`: rank 0's full optimizer
    state loaded on every rank (`broadcast_from_rank0`); returns the loaded optimizer state."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optim, full_optim_state_dict or {}, options=options)
    return optim.state_dict()


def fsdp1_fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
    """`FSDP.fsdp_modules(module)`: the FSDP2 modules in `module` (itself included), in order."""
    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if root_only:
        nested = {id(sub) for m in found for sub in list(m.modules())[1:]}
        found = [m for m in found if id(m) not in nested]
    return found


def fsdp1_unwrap(model: nn.Module) -> nn.Module:
    """`model.module` where `model` may be a rewritten FSDP model: FSDP2 and YaFSDP have no wrapper
    (the model is the model), anything else (DDP, an FSDP1 wrapper) keeps its `.module`."""
    ya_fsdp = sys.modules.get("fsdp_bridge.ya_fsdp")
    if isinstance(model, FSDPModule) or (ya_fsdp is not None and isinstance(model, ya_fsdp.YaFSDP)):
        return model
    return model.module


# --------------------------------------------------------------------------------------------
# --to yafsdp
# --------------------------------------------------------------------------------------------


def yafsdp_zero_stage(sharding_strategy: Any) -> int:
    """YaFSDP's `zero_stage` for an FSDP1 strategy: FULL_SHARD -> 3, SHARD_GRAD_OP -> 2."""
    strategy = _strategy(sharding_strategy)
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
    return [(m, names[m]) for m, _ in fsdp1_units(model, auto_wrap_policy, ignored_modules) if not _is_container(m)]


def fsdp1_to_yafsdp(
    module: nn.Module,
    process_group: Any = None,
    sharding_strategy: ShardingStrategy | None = None,
    cpu_offload: CPUOffload | None = None,
    auto_wrap_policy: Any = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    mixed_precision: MixedPrecision | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device_id: int | torch.device | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    use_orig_params: bool = False,
    ignored_states: Iterable[Any] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    gradient_accumulation_steps: int = 1,
):
    """`FullyShardedDataParallel(module, ...)` as `fsdp_bridge.ya_fsdp.YaFSDP(...)`.

    YaFSDP needs `gradient_accumulation_steps` up front (FSDP1 learnt it from `no_sync`).
    """
    from fsdp_bridge.ya_fsdp import YaFSDP  # the rewritten script targets our YaFSDP

    unsupported = {
        "cpu_offload": cpu_offload is not None and getattr(cpu_offload, "offload_params", True),
        "ignored_modules": bool(ignored_modules),
        "ignored_states": bool(ignored_states),
        "device_mesh": device_mesh is not None,
        "a tuple process_group": isinstance(process_group, tuple),
    }
    for name, present in unsupported.items():
        if present:
            raise ValueError(
                f"{name} has no YaFSDP equivalent; remove it, or migrate with --to fsdp2 instead."
            )
    param_dtype = mixed_precision.param_dtype if isinstance(mixed_precision, MixedPrecision) else None
    return YaFSDP(
        module,
        zero_stage=yafsdp_zero_stage(sharding_strategy),
        modules_to_wrap_with_names=yafsdp_modules_to_wrap(module, auto_wrap_policy, ignored_modules or ()),
        param_dtype=param_dtype if param_dtype is not None else torch.float32,
        gradient_accumulation_steps=gradient_accumulation_steps,
        sync_module_states=sync_module_states,
        param_init_fn=param_init_fn,
        device_id=device_id,
        data_parallel_process_group=process_group,
    )
