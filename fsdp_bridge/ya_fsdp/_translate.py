"""YaFSDP's constructor arguments -> Plan. Pure: no processes, no collectives."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fsdp_bridge.plan import MixedPrecision, Plan, ShardingMode, UnitSpec
from fsdp_bridge.translation import (
    ArgumentTable,
    bad_argument,
    check_bool,
    ignored,
    module_paths,
    register_table,
    rejected,
    translated,
)

FRONTEND = "YaFSDP"

TABLE = register_table(
    ArgumentTable(
        FRONTEND,
        (
            translated("module", "the model to shard (wrapped, forward delegates to it)"),
            translated("zero_stage", "3 -> units reshard after forward (ZeRO-3); 2 -> keep "
                       "gathered until backward (ZeRO-2)"),
            translated("param_dtype", "MixedPrecision.param_dtype (gather and compute dtype; "
                       "omitted: the parameters' own dtype)"),
            translated("modules_to_wrap_with_names", "Plan.units, in the given order; each "
                       "name must be the module's path in the model"),
            translated("layer_norm_module_cls", "every module of this class joins the resident "
                       "norm group (Plan.norm_modules)"),
            translated("rogue_layer_norm_modules_with_names", "these modules join the resident "
                       "norm group (Plan.norm_modules)"),
            translated("gradient_accumulation_steps", "Plan.gradient_accumulation_steps: "
                       "gradients are divided once by world size x steps after the last "
                       "micro-step"),
            translated("data_parallel_process_group", "the shard group"),
            translated("bit16_reduce_scatter", "True -> MixedPrecision.reduce_dtype = "
                       "param_dtype; False (default) -> reduce in fp32"),
            translated("sync_module_states", "Plan.sync_module_states: rank 0's parameters "
                       "and buffers are broadcast"),
            translated("param_init_fn", "called on each module with meta-device state"),
            translated("device_id", "the compute device (an int is a CUDA device index)"),
            ignored("intra_node_data_parallel_process_group", "YaFSDP uses it for intra-node "
                    "broadcast and hpZ; fsdp_bridge broadcasts and gathers over the data-parallel "
                    "group"),
            ignored("model_parallel_process_group", "tensor parallelism is not supported: "
                    "clip_grad_norm_ does not reduce over a model-parallel group"),
            ignored("all_reduce_grads_across_model_parallel_group", "tensor parallelism is "
                    "not supported"),
            ignored("bit32_acc_for_bit16_reduce_scatter", "needs Yandex's patched NCCL "
                    "(acc_type); reductions run in reduce_dtype"),
            ignored("hpz_first_layers_num", "hpZ is an inter-node optimisation only; results "
                    "are the same without it"),
            ignored("is_trainable", "inference mode's memory saving (no fp32 masters) is not "
                    "implemented; the model still runs and can be evaluated"),
            ignored("use_yccl", "YCCL is Yandex's private collective library"),
            ignored("use_yccl_padding", "YCCL is Yandex's private collective library"),
            ignored("yccl_intra_inter_expr", "YCCL is Yandex's private collective library"),
            ignored("yccl_all_gather_stages", "YCCL is Yandex's private collective library"),
            ignored("profile", "YCCL profiling events have no equivalent"),
            rejected("zero_stage=1", "undocumented in YaFSDP; use zero_stage=2"),
        ),
    )
)

# Defaults of YaFSDP's arguments that fsdp_bridge ignores: giving one of these values is silent.
IGNORED_DEFAULTS: dict[str, Any] = {
    "intra_node_data_parallel_process_group": None,
    "model_parallel_process_group": None,
    "all_reduce_grads_across_model_parallel_group": False,
    "bit32_acc_for_bit16_reduce_scatter": False,
    "hpz_first_layers_num": 0,
    "is_trainable": True,
    "use_yccl": False,
    "use_yccl_padding": False,
    "yccl_intra_inter_expr": None,
    "yccl_all_gather_stages": None,
    "profile": False,
}


def _check_zero_stage(zero_stage) -> bool:
    """Returns reshard_after_forward."""
    if isinstance(zero_stage, bool) or zero_stage not in (2, 3):
        raise bad_argument(
            FRONTEND, "zero_stage", zero_stage, "3 (ZeRO-3, like FULL_SHARD) or 2 (ZeRO-2, "
            "like SHARD_GRAD_OP)", "Pass zero_stage=3 or zero_stage=2."
        )
    return zero_stage == 3


def _check_dtype(param_dtype) -> Optional[torch.dtype]:
    if param_dtype is None:
        return None
    if not isinstance(param_dtype, torch.dtype) or not param_dtype.is_floating_point:
        raise bad_argument(
            FRONTEND, "param_dtype", param_dtype, "a floating torch.dtype such as "
            "torch.bfloat16, torch.float16 or torch.float32",
            "Pass the dtype to gather and compute in, e.g. param_dtype=torch.bfloat16.",
            exc=TypeError if not isinstance(param_dtype, torch.dtype) else ValueError,
        )
    return param_dtype


def _check_not_wider(param_dtype: Optional[torch.dtype], model: nn.Module) -> None:
    """Mixed precision lowers the compute dtype; a wider one (float64 over fp32 parameters) is
    refused: YaFSDP casts no inputs, so the forward would fail on a dtype mismatch."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if param_dtype is None or not dtypes:
        return
    widest = max(dtypes, key=lambda d: d.itemsize)
    if param_dtype.itemsize <= widest.itemsize:
        return
    raise bad_argument(
        FRONTEND, "param_dtype", param_dtype, f"a dtype no wider than the model's parameters "
        f"({widest}): torch.bfloat16, torch.float16 or {widest}",
        f"To train in {param_dtype}, convert the model first (model.to({param_dtype})) and "
        "leave param_dtype None.",
    )


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise bad_argument(
            FRONTEND, "gradient_accumulation_steps", steps, "an int >= 1",
            "Pass the number of micro-batches per optimizer step (1 for none).",
        )
    return steps


def _named_modules_arg(
    argument: str, pairs: list[tuple[nn.Module, str]], paths: dict[int, str]
) -> list[str]:
    """Validate (module, name) pairs: each module inside the model, named by its path, once."""
    names: list[str] = []
    seen: dict[int, str] = {}
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise bad_argument(FRONTEND, f"{argument}[{index}]", pair, "a (module, name) pair",
                               "List each module with its name, e.g. (model.model.layers[0], "
                               "'model.layers.0').", exc=TypeError)
        module, name = pair
        if not isinstance(module, nn.Module) or id(module) not in paths:
            raise bad_argument(FRONTEND, f"{argument}[{index}]", pair, "a submodule of the "
                               "wrapped model", "List modules of the model you pass to YaFSDP.")
        if id(module) in seen:
            raise bad_argument(FRONTEND, f"{argument}[{index}]", pair, "each module listed once",
                               f"{type(module).__name__} at {paths[id(module)]!r} is already "
                               f"listed as {seen[id(module)]!r}; remove the duplicate.")
        if name != paths[id(module)]:
            raise bad_argument(FRONTEND, f"{argument}[{index}]", pair, "the module's path in the "
                               f"model, here {paths[id(module)]!r}", f"Name it "
                               f"{paths[id(module)]!r}: names become state-dict keys.")
        if name == "":
            raise bad_argument(FRONTEND, f"{argument}[{index}]", pair, "a submodule, not the "
                               "model itself", "The model is always the root unit; list its "
                               "layers.")
        seen[id(module)] = name
        names.append(name)
    return names


def _norm_modules(
    model: nn.Module, layer_norm_module_cls, rogue: Optional[dict], paths: dict[int, str]
) -> tuple[str, ...]:
    if layer_norm_module_cls is not None:
        classes = (
            tuple(layer_norm_module_cls)
            if isinstance(layer_norm_module_cls, (tuple, list))
            else (layer_norm_module_cls,)
        )
        if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
            raise bad_argument(FRONTEND, "layer_norm_module_cls", layer_norm_module_cls,
                               "an nn.Module subclass (or a tuple of them), e.g. LlamaRMSNorm",
                               "Pass the class itself, not an instance or a name.", exc=TypeError)
    else:
        classes = ()
    names = [name for name, module in model.named_modules() if classes and isinstance(module, classes)]
    if rogue:
        if not isinstance(rogue, dict):
            raise bad_argument(FRONTEND, "rogue_layer_norm_modules_with_names", rogue,
                               "a dict {module: name}", "e.g. {model.model.norm: 'model.norm'}.",
                               exc=TypeError)
        names += _named_modules_arg("rogue_layer_norm_modules_with_names", list(rogue.items()),
                                    paths)
    return tuple(dict.fromkeys(names))


def _check_units_are_not_norms(units: list[str], norms: tuple[str, ...], rogue, norm_cls) -> None:
    """A module is either a unit (its own flat buffer, gathered per layer) or in the resident
    norm group (gathered once per step with the root); both at once has no meaning."""
    rogue_names = list(rogue.values()) if isinstance(rogue, dict) else []
    for name in norms:
        if name not in units:
            continue
        if name in rogue_names:
            argument = f"rogue_layer_norm_modules_with_names[{rogue_names.index(name)}]"
            value = name
        else:
            argument, value = "layer_norm_module_cls", norm_cls
        raise bad_argument(FRONTEND, argument, value, "norm modules that are not also in "
                           f"modules_to_wrap_with_names (here {name!r} is at index "
                           f"{units.index(name)})", "Remove it from one of the two: norms "
                           "belong in the norm group, layers in modules_to_wrap_with_names.")


def ignored_notes(given: dict[str, Any]) -> tuple[str, ...]:
    """Warn once per ignored argument given a non-default value; return the notes. Flags must
    still be bools: "no" would read as a non-default value."""
    for name, value in given.items():
        if isinstance(IGNORED_DEFAULTS.get(name), bool):
            check_bool(FRONTEND, name, value)
    return tuple(
        TABLE.warn_ignored(name, value)
        for name, value in given.items()
        if name in IGNORED_DEFAULTS and value is not IGNORED_DEFAULTS[name]
        and value != IGNORED_DEFAULTS[name]
    )


def build_plan(
    module: nn.Module,
    *,
    zero_stage,
    param_dtype,
    modules_to_wrap_with_names,
    layer_norm_module_cls,
    gradient_accumulation_steps,
    rogue_layer_norm_modules_with_names=None,
    bit16_reduce_scatter: bool = False,
    sync_module_states: bool = False,
    notes: tuple[str, ...] = (),
) -> Plan:
    if not isinstance(module, nn.Module):
        raise bad_argument(FRONTEND, "module", module, "an nn.Module", "Pass the model.",
                           exc=TypeError)
    reshard = _check_zero_stage(zero_stage)
    dtype = _check_dtype(param_dtype)
    steps = _check_steps(gradient_accumulation_steps)
    paths = module_paths(module)
    if not isinstance(modules_to_wrap_with_names, (list, tuple)):
        modules_to_wrap_with_names = list(modules_to_wrap_with_names)
    unit_names = _named_modules_arg("modules_to_wrap_with_names", modules_to_wrap_with_names, paths)
    _check_not_wider(dtype, module)
    check_bool(FRONTEND, "bit16_reduce_scatter", bit16_reduce_scatter)
    check_bool(FRONTEND, "sync_module_states", sync_module_states)
    norms = _norm_modules(module, layer_norm_module_cls, rogue_layer_norm_modules_with_names, paths)
    _check_units_are_not_norms(unit_names, norms, rogue_layer_norm_modules_with_names,
                               layer_norm_module_cls)
    return Plan(
        units=tuple(UnitSpec(name, reshard) for name in unit_names) + (UnitSpec("", reshard),),
        mode=ShardingMode.SHARD,
        mixed_precision=MixedPrecision(
            param_dtype=dtype,
            # YaFSDP reduces in fp32 unless told to reduce in param_dtype.
            reduce_dtype=dtype if bit16_reduce_scatter and dtype is not None else torch.float32,
            cast_root_forward_inputs=False,  # YaFSDP casts nothing; inputs are token ids
        ),
        norm_modules=norms,
        gradient_accumulation_steps=steps,
        sync_module_states=bool(sync_module_states),
        frontend=FRONTEND,
        notes=notes,
    )
