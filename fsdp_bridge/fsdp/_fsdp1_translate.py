"""FSDP1's constructor arguments -> Plan. Pure: no processes, no collectives.

Process groups, meshes and devices are resolved by the wrapper class (they need a running
world); everything that decides *what* is sharded and *how* is decided here.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

from fsdp_bridge import policies
from fsdp_bridge.engine.init import still_ignored_params
from fsdp_bridge.engine.layout import GroupLayout, assign_groups
from fsdp_bridge.plan import MixedPrecision, Plan, ShardingMode, UnitSpec, UnsyncedGradSum
from fsdp_bridge.translation import (
    ArgumentTable,
    Shown,
    bad_argument,
    check_bool,
    check_own_params,
    ignored,
    module_paths,
    register_table,
    rejected,
    translated,
)

FRONTEND = "FullyShardedDataParallel"

TABLE = register_table(
    ArgumentTable(
        FRONTEND,
        (
            translated("module", "the model; wrapped, `.module` returns it, `forward` delegates"),
            translated("sharding_strategy", "FULL_SHARD -> mode shard, units reshard after "
                       "forward (root never); SHARD_GRAD_OP -> mode shard, units keep gathered; "
                       "NO_SHARD -> mode replicate; HYBRID_SHARD / _HYBRID_SHARD_ZERO2 -> mode "
                       "hybrid (2-D mesh: dim 0 replicate, dim 1 shard)"),
            translated("auto_wrap_policy", "Plan.units: torch's own policy code is run "
                       "(`_Policy._run_policy`, or `_recursive_wrap` for callables, with FSDP1's "
                       "recursion and numel bookkeeping), post-order, root last; CustomPolicy "
                       "dicts are per-unit overrides; each unit becomes a "
                       "FullyShardedDataParallel around its module in the tree, as natively "
                       "(names, fsdp_modules, isinstance check_fns, per-unit state dicts and "
                       "summon_full_params; clip_grad_norm_ and no_sync on the root only); "
                       "hand-nested wrappers stay where they are, as units"),
            translated("mixed_precision", "MixedPrecision(param_dtype, reduce_dtype (None -> "
                       "param_dtype, as FSDP1), buffer_dtype, cast_forward_inputs, "
                       "cast_root_forward_inputs)"),
            ignored("mixed_precision.keep_low_precision_grads", "True is ignored: gradients "
                    "are exposed in the master dtype (fp32), which every optimizer accepts"),
            rejected("mixed_precision._module_classes_to_ignore", "with an auto_wrap_policy, "
                     "FSDP1 runs these modules (BatchNorm) in fp32 as separate units; per-unit "
                     "precision is not supported yet: a model containing them is refused"),
            translated("cpu_offload", "Plan.cpu_offload: on an accelerator the fp32 master "
                       "shards, their gradients and so the optimizer state live in pinned host "
                       "memory and the optimizer steps on the CPU; on a CPU device they are "
                       "there anyway"),
            translated("process_group", "the shard group; a tuple (shard_pg, replicate_pg) "
                       "with a hybrid strategy"),
            rejected("process_group of a nested wrapper", "a hand-nested wrapper over other "
                     "ranks than the root's (e.g. experts with a one-rank group) is refused by "
                     "name: the engine shards one model over one set of ranks; rank-local "
                     "modules go in the root's ignored_modules instead"),
            translated("device_mesh", "1-D: the shard group; 2-D (hybrid): dim 0 replicate, "
                       "dim 1 shard"),
            translated("ignored_modules", "Plan.ignored_params and Plan.ignored_modules: "
                       "their parameters are neither sharded nor reduced, and the modules are "
                       "left as they are at the wrap: not materialised from meta (but inside a "
                       "unit of the auto-wrap policy, which FSDP1 hands the parameters only: "
                       "materialised there, and then sharded, as FSDP1), moved nor cast; "
                       "sync_module_states broadcasts their buffers only (as FSDP1)"),
            translated("ignored_states", "Plan.ignored_params (parameters, or modules' "
                       "parameters); one on meta that the wrap materialises is sharded, as "
                       "FSDP1 (it knows them by identity), with a warning naming it"),
            translated("param_init_fn", "called on every module of each unit that holds "
                       "meta-device state, breadth-first (as FSDP1); not callable: ValueError"),
            translated("device_id", "the compute device (an int is a CUDA index)"),
            translated("sync_module_states", "Plan.sync_module_states: rank 0's parameters and "
                       "buffers are broadcast (works on CPU, unlike native FSDP1)"),
            translated("use_orig_params", "False: named_parameters() gives each unit's flat "
                       "parameter (`..._fsdp_wrapped_module._flat_param`), native's local flat "
                       "shard (same order, padding and shape) and the unit's master shard "
                       "itself, so an optimizer over them trains as native's; FSDP1's "
                       "optimizer-state APIs name its state per original parameter, torch's "
                       "get/set_optimizer_state_dict refuse it; an optimizer built before the "
                       "wrap is refused at its first step (native trains nothing with it); a "
                       "unit mixing dtypes or requires_grad is refused, as natively, and so is "
                       "a nested wrapper with another value than the root's. True: the "
                       "user's own Parameter objects as 1-D local shards under their names, so "
                       "an optimizer built before wrapping trains"),
            ignored("backward_prefetch", "the engine chooses the point by device: on the "
                    "CPU a unit's gather starts when the unit before it has finished its "
                    "backward, beside that unit's reduction (BACKWARD_POST's point, for the "
                    "lower peak memory); on CUDA before that unit's backward is queued "
                    "(BACKWARD_PRE's point, so that NCCL overlaps it); the value given is "
                    "ignored (numerics are identical)"),
            ignored("forward_prefetch", "the engine always prefetches the next unit in the "
                    "recorded forward order; numerics are identical"),
            ignored("limit_all_gathers", "the engine never holds more than two units' "
                    "gathered weights at once; False is ignored"),
            rejected("sharding_strategy per unit", "a CustomPolicy override or nested wrapper "
                     "may change FULL_SHARD <-> SHARD_GRAD_OP only (resharding), not the mode "
                     "(shard / replicate / hybrid)"),
            translated("state_dict_type=LOCAL_STATE_DICT", "one ShardedTensor per flat group "
                       "under our own keys (`<unit>._bridge_flat_param.<i>`, not native's "
                       "`_flat_param`, whose packing differs: a native LOCAL dict is refused); "
                       "loads back into the same model at the same world size"),
        ),
    )
)

_STRATEGIES = {
    ShardingStrategy.FULL_SHARD: (ShardingMode.SHARD, True),
    ShardingStrategy.SHARD_GRAD_OP: (ShardingMode.SHARD, False),
    ShardingStrategy.NO_SHARD: (ShardingMode.REPLICATE, False),
    ShardingStrategy.HYBRID_SHARD: (ShardingMode.HYBRID, True),
    ShardingStrategy._HYBRID_SHARD_ZERO2: (ShardingMode.HYBRID, False),
}

def strategy_of(mode: ShardingMode, reshard_after_forward: bool) -> ShardingStrategy:
    """The FSDP1 strategy a unit of `mode` with this resharding reports."""
    for strategy, (known_mode, reshard) in _STRATEGIES.items():
        if known_mode is mode and (reshard is reshard_after_forward
                                   or mode is ShardingMode.REPLICATE):
            return strategy
    raise AssertionError(f"no FSDP1 strategy for {mode} / {reshard_after_forward}")


# Defaults of arguments we ignore: giving one of these values is silent.
IGNORED_DEFAULTS: dict[str, Any] = {
    "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
    "forward_prefetch": (False, True),  # both behave as the engine does
    "limit_all_gathers": True,
}

_ACCEPTED_STRATEGIES = "a torch.distributed.fsdp.ShardingStrategy (" + ", ".join(
    s.name for s in ShardingStrategy
) + ") or its name, or None (FULL_SHARD)"


@dataclasses.dataclass(frozen=True)
class ParsedStrategy:
    """A `sharding_strategy` as the engine reads it."""

    strategy: ShardingStrategy  # torch's enum (what FSDP1 reports back)
    mode: ShardingMode
    reshard_after_forward: bool  # False keeps units gathered until backward (ZeRO-2)


def parse_sharding_strategy(value, argument: str = "sharding_strategy") -> ParsedStrategy:
    """FSDP1's `sharding_strategy` (the enum, its name, or None for FULL_SHARD), parsed: the
    one reader of this argument, for the front-end, per-unit overrides and migrated scripts."""
    if value is None:
        value = ShardingStrategy.FULL_SHARD
    elif isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        value = ShardingStrategy[value.upper()]
    if not isinstance(value, ShardingStrategy):
        raise bad_argument(FRONTEND, argument, value, _ACCEPTED_STRATEGIES,
                           "e.g. sharding_strategy=ShardingStrategy.FULL_SHARD.")
    return ParsedStrategy(value, *_STRATEGIES[value])


def _dtype(value, argument: str) -> Optional[torch.dtype]:
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise bad_argument(FRONTEND, argument, value, "None or a floating torch.dtype "
                           "(torch.bfloat16, torch.float16, torch.float32)",
                           "Pass the dtype itself, e.g. param_dtype=torch.bfloat16.",
                           exc=TypeError if not isinstance(value, torch.dtype) else ValueError)
    return value


def mixed_precision_of(mp, model: nn.Module, has_policy: bool) -> tuple[MixedPrecision, tuple]:
    """torch's MixedPrecision -> ours, plus ignored notes."""
    if mp is None:
        return MixedPrecision(cast_root_forward_inputs=False), ()
    if not isinstance(mp, TorchMixedPrecision):
        raise bad_argument(FRONTEND, "mixed_precision", mp, "None or a "
                           "torch.distributed.fsdp.MixedPrecision", "e.g. mixed_precision="
                           "MixedPrecision(param_dtype=torch.bfloat16).", exc=TypeError)
    for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
        check_bool(FRONTEND, f"mixed_precision.{field}", getattr(mp, field))
    param = _dtype(mp.param_dtype, "mixed_precision.param_dtype")
    reduce = _dtype(mp.reduce_dtype, "mixed_precision.reduce_dtype")
    buffer = _dtype(mp.buffer_dtype, "mixed_precision.buffer_dtype")
    notes = ()
    if mp.keep_low_precision_grads:
        notes = (TABLE.warn_ignored("mixed_precision.keep_low_precision_grads", True),)
    classes = tuple(mp._module_classes_to_ignore or ())
    if has_policy and classes and (param or reduce or buffer):
        found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, classes)})
        if found:
            raise bad_argument(
                FRONTEND, "mixed_precision._module_classes_to_ignore", classes,
                "classes the model does not contain (the model has " + ", ".join(found) + ")",
                "FSDP1 would run them as separate fp32 units, which fsdp_bridge does not "
                "support yet; pass MixedPrecision(..., _module_classes_to_ignore=()) to run them "
                "in param_dtype, or keep torch's FSDP for this model.")
    return MixedPrecision(
        param_dtype=param,
        reduce_dtype=reduce if reduce is not None else param,  # FSDP1: None -> param_dtype
        buffer_dtype=buffer,
        cast_forward_inputs=bool(mp.cast_forward_inputs),
        cast_root_forward_inputs=bool(mp.cast_root_forward_inputs),
    ), notes


def ignored_sets(model: nn.Module, ignored_modules, ignored_states):
    """(ignored modules, ignored parameters) from FSDP1's two mutually exclusive arguments."""
    if ignored_modules is not None and ignored_states is not None:
        raise bad_argument(FRONTEND, "ignored_states", "<given together with ignored_modules>",
                           "only one of ignored_modules and ignored_states",
                           "Pass the modules in ignored_states (it accepts modules or "
                           "parameters) and drop ignored_modules.")
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    argument = "ignored_modules" if ignored_modules is not None else "ignored_states"
    items = ignored_modules if ignored_modules is not None else ignored_states
    try:
        items = list(items or ())
    except TypeError:
        raise bad_argument(FRONTEND, argument, items, "an iterable of modules (or, for "
                           "ignored_states, of parameters)", "Wrap a single module in a list.",
                           exc=TypeError) from None
    for index, item in enumerate(items):
        if isinstance(item, nn.Parameter) and argument == "ignored_states":
            params.append(item)
        elif isinstance(item, nn.Module):
            if isinstance(item, _wrapper_types()):
                raise bad_argument(FRONTEND, f"{argument}[{index}]", item, "modules that are "
                                   "not FSDP instances", "Ignore the module inside, not its "
                                   "wrapper.")
            modules.append(item)
        else:
            raise bad_argument(FRONTEND, f"{argument}[{index}]", item, "an nn.Module" + (
                " or an nn.Parameter" if argument == "ignored_states" else ""),
                "List the modules whose parameters FSDP must leave alone.", exc=TypeError)
    if modules and params:
        raise bad_argument(FRONTEND, "ignored_states", items, "all parameters or all "
                           "modules, not a mix", "Split them: pass the modules' parameters too.")
    paths = module_paths(model)
    for index, module in enumerate(modules):
        if id(module) not in paths:
            raise bad_argument(FRONTEND, f"{argument}[{index}]", module, "a submodule of the "
                               "wrapped model", "Ignore modules of the model you wrap.")
    ignored_modules_all = {id(sub): sub for m in modules for sub in m.modules()}
    params += [p for m in modules for p in m.parameters()]
    check_own_params(FRONTEND, argument, params, model)
    return list(ignored_modules_all.values()), params


def _still_ignored(module, units, ignored_modules, ignored_params) -> tuple[str, ...]:
    """The ignored parameters FSDP1 still leaves alone after materialising from meta (see
    `still_ignored_params`); those it shards instead are named in a warning."""
    kept = still_ignored_params(module, [unit.name for unit in units], ignored_modules,
                                ignored_params)
    sharded = [name for name in ignored_params if name not in kept]
    if sharded:
        warnings.warn(
            f"fsdp_bridge ({FRONTEND}): ignored parameters on the meta device in modules the "
            f"wrap materialises are sharded like any other, as FSDP1 does (materialising "
            f"gives them new Parameters, and FSDP1 knows ignored parameters by identity): "
            f"{', '.join(sharded)}. To keep them whole and unreduced, give them storage "
            "before wrapping (or ignore a module among the root's own, which stays as it is).",
            stacklevel=4)
    return kept


def _wrapper_types():
    from fsdp_bridge.wrapper import ShardedWrapper

    return (ShardedWrapper,)


_OVERRIDABLE = {"sharding_strategy"}


def _unit_reshard(name: str, overrides: dict, root: dict, mode: ShardingMode, source: str) -> bool:
    """The reshard_after_forward of a unit whose kwargs are `overrides` over the root's."""
    for key, value in overrides.items():
        if key in _OVERRIDABLE or key in ("auto_wrap_policy", "policy"):
            continue
        if key in root and (root[key] is value or root[key] == value):
            continue
        raise bad_argument(FRONTEND, f"{source}[{name!r}].{key}", value, "the root's value "
                           f"({root.get(key)!r}) or only a sharding_strategy override",
                           "Per-unit settings other than the resharding strategy are not "
                           "supported; give every unit the same value.")
    unit = parse_sharding_strategy(overrides.get("sharding_strategy",
                                                  root.get("sharding_strategy")),
                                    f"{source}[{name!r}].sharding_strategy")
    if unit.mode is not mode:
        raise bad_argument(FRONTEND, f"{source}[{name!r}].sharding_strategy", unit.strategy,
                           f"a strategy of the root's mode ({mode.value}): "
                           + ", ".join(s.name for s, (m, _) in _STRATEGIES.items() if m is mode),
                           "Only FULL_SHARD <-> SHARD_GRAD_OP (or HYBRID_SHARD <-> "
                           "_HYBRID_SHARD_ZERO2) may differ between units.")
    return unit.reshard_after_forward


def ignored_notes(given: dict[str, Any]) -> tuple[str, ...]:
    notes = []
    for name, value in given.items():
        default = IGNORED_DEFAULTS[name]
        defaults = default if isinstance(default, tuple) else (default,)
        if any(value is d or value == d for d in defaults):
            continue
        notes.append(TABLE.warn_ignored(name, value))
    return tuple(notes)


def build_plan(
    module: nn.Module,
    *,
    sharding_strategy=None,
    auto_wrap_policy=None,
    mixed_precision=None,
    cpu_offload=None,
    ignored_modules=None,
    ignored_states=None,
    sync_module_states: bool = False,
    use_orig_params: bool = False,
    backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    nested: tuple[tuple[str, dict], ...] = (),
    frontend: str = FRONTEND,
) -> Plan:
    """`nested`: (FQN, constructor kwargs) of FSDP instances the user wrapped by hand inside
    `module` (released by the wrapper), each a unit."""
    if not isinstance(module, nn.Module):
        raise bad_argument(FRONTEND, "module", module, "an nn.Module", "Pass the model.",
                           exc=TypeError)
    parsed = parse_sharding_strategy(sharding_strategy)
    mode, reshard = parsed.mode, parsed.reshard_after_forward
    for name, value in (("sync_module_states", sync_module_states),
                        ("use_orig_params", use_orig_params),
                        ("forward_prefetch", forward_prefetch),
                        ("limit_all_gathers", limit_all_gathers)):
        check_bool(FRONTEND, name, value)
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise bad_argument(FRONTEND, "cpu_offload", cpu_offload, "None or a torch.distributed."
                           "fsdp.CPUOffload", "e.g. cpu_offload=CPUOffload(offload_params=True).",
                           exc=TypeError)
    if cpu_offload is not None:
        check_bool(FRONTEND, "cpu_offload.offload_params", cpu_offload.offload_params)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise bad_argument(FRONTEND, "backward_prefetch", backward_prefetch, "None or a "
                           "torch.distributed.fsdp.BackwardPrefetch (BACKWARD_PRE, "
                           "BACKWARD_POST)", "e.g. backward_prefetch=BackwardPrefetch."
                           "BACKWARD_PRE.", exc=TypeError)
    notes = ignored_notes({"backward_prefetch": backward_prefetch,
                           "forward_prefetch": forward_prefetch,
                           "limit_all_gathers": limit_all_gathers})
    mp, mp_notes = mixed_precision_of(mixed_precision, module, auto_wrap_policy is not None)
    notes += mp_notes
    skipped_modules, skipped_params = ignored_sets(module, ignored_modules, ignored_states)
    paths = module_paths(module)
    root_kwargs = {"sharding_strategy": parsed.strategy, "mixed_precision": mixed_precision,
                   "cpu_offload": cpu_offload, "use_orig_params": use_orig_params,
                   "backward_prefetch": backward_prefetch, "forward_prefetch": forward_prefetch,
                   "limit_all_gathers": limit_all_gathers, "sync_module_states": sync_module_states,
                   "ignored_modules": ignored_modules, "ignored_states": ignored_states,
                   "param_init_fn": None, "device_id": None, "process_group": None,
                   "device_mesh": None}
    units: list[UnitSpec] = []
    if auto_wrap_policy is not None:
        if not (callable(auto_wrap_policy) or isinstance(auto_wrap_policy, policies._Policy)):
            raise bad_argument(FRONTEND, "auto_wrap_policy", auto_wrap_policy, "None, a torch "
                               "wrap policy object (ModuleWrapPolicy, CustomPolicy) or a policy "
                               "callable (module, recurse, nonwrapped_numel) -> bool", "e.g. "
                               "functools.partial(transformer_auto_wrap_policy, "
                               "transformer_layer_cls={LlamaDecoderLayer}).", exc=TypeError)
        if nested:
            raise bad_argument(FRONTEND, "auto_wrap_policy", auto_wrap_policy, "no policy when "
                               "the module already contains FSDP instances (here "
                               + ", ".join(repr(n) for n, _ in nested) + ")",
                               "Wrap by hand or by policy, not both (as torch's FSDP1).")
        try:
            found = policies.evaluate_policy(module, auto_wrap_policy, skipped_modules,
                                             skipped_params)
        except (TypeError, AttributeError) as exc:
            raise bad_argument(FRONTEND, "auto_wrap_policy", auto_wrap_policy, "a policy that "
                               "can be evaluated on this model", f"Evaluating it raised "
                               f"{type(exc).__name__}: {exc}.", exc=TypeError) from exc
        for unit in found:
            name = paths[id(unit.module)]
            units.append(UnitSpec(name, _unit_reshard(name, unit.overrides, root_kwargs, mode,
                                                      "auto_wrap_policy")))
    for name, kwargs in nested:
        units.append(UnitSpec(name, _unit_reshard(name, kwargs, root_kwargs, mode,
                                                  "nested FullyShardedDataParallel")))
    ignored_names = tuple(
        n for n, p in module.named_parameters(remove_duplicate=False)
        if any(p is q for q in skipped_params)
    )
    units.append(UnitSpec("", reshard))
    skipped_names = tuple(paths[id(m)] for m in skipped_modules)
    ignored_names = _still_ignored(module, units, skipped_names, ignored_names)
    plan = Plan(
        units=tuple(units),
        mode=mode,
        mixed_precision=mp,
        ignored_params=ignored_names,
        ignored_modules=skipped_names,
        sync_module_states=sync_module_states,
        divide_around_reduce=True,
        unsynced_grad_sum=UnsyncedGradSum.COMPUTE_DTYPE,
        rereduce_kept_grad=True,
        cpu_offload=bool(cpu_offload and cpu_offload.offload_params),
        frontend=frontend,
        notes=notes,
    )
    if not use_orig_params:
        check_one_flat_parameter_per_unit(module, plan)
    return plan


def check_one_flat_parameter_per_unit(module: nn.Module, plan: Plan) -> None:
    """With `use_orig_params=False` each unit is one flat parameter (see [Note: flat
    parameters] in engine/flat_params.py), so its parameters must share a dtype and
    `requires_grad`: native FSDP1 refuses a unit that mixes them (ValueError), and so do we."""
    seen: dict[str, GroupLayout] = {}
    for layout in assign_groups(module, plan):
        first = seen.setdefault(layout.unit_name, layout)
        if first is layout:
            continue
        what = ("requires_grad" if first.requires_grad != layout.requires_grad else "dtype")
        found = Shown(f"unit {layout.unit_name or '<root>'!r} holding {first.slots[0].fqn!r} "
                      f"({what} {first.requires_grad if what == 'requires_grad' else first.dtype}) "
                      f"and {layout.slots[0].fqn!r} ({what} "
                      f"{layout.requires_grad if what == 'requires_grad' else layout.dtype})")
        raise bad_argument(
            FRONTEND, "use_orig_params", False, "True when a unit's parameters differ in "
            f"{what} ({found})", "With use_orig_params=False a unit is one flat parameter, so "
            "torch's FSDP1 refuses this too. Pass use_orig_params=True, or wrap the parameters "
            "that differ as units of their own (auto_wrap_policy), or give them one "
            f"{what}.")
