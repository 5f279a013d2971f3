"""TorchAcc's `Config` -> Plan (plus the data-parallel and FSDP sizes). Pure: the world size
is an argument.

TorchAcc's eager backend builds torch FSDP1 with `ModuleWrapPolicy(wrap_layer_cls)`,
FULL_SHARD (HYBRID_SHARD with groups (fsdp, dp) when dp > 1), `MixedPrecision(param=bf16|fp16,
reduce=fp32, buffer=fp32)` and outputs cast to fp32; we do the same on our engine. The module
tree stays one wrapper around the model: `accelerate` returns TorchAcc's own module, around
torch's FSDP1 (eager) or torch_xla's FSDP (lazy), and its checkpoint helpers
(`get_shard_metadata`, `consolidate_sharded_model_checkpoints`) are torch_xla's, which ours
follow (this rank's pieces under the original names), not FSDP1's per-unit wrappers.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_bridge import policies, translation
from fsdp_bridge.plan import MixedPrecision, Plan, ShardingMode, UnitSpec, UnsyncedGradSum
from fsdp_bridge.translation import (
    bad_argument,
    check_bool,
    ignored,
    module_paths,
    rejected,
    translated,
)

FRONTEND = "torchacc.Config"

TABLE = translation.register_table(
    translation.ArgumentTable(
        FRONTEND,
        (
            translated("dist.fsdp.size", "the shard-group size; dp = world / size: dp == 1 -> "
                       "mode shard (FULL_SHARD), dp > 1 -> mode hybrid (shard inside fsdp "
                       "groups of consecutive ranks, all-reduce across dp), size 1 -> replicate"),
            translated("dist.dp.size", "None -> world / fsdp.size; must satisfy dp x fsdp = world"),
            translated("dist.fsdp.wrap_layer_cls", "class names; every module of those classes is "
                       "a unit (ModuleWrapPolicy)"),
            translated("dist.fsdp.sync_module_states", "Plan.sync_module_states"),
            ignored("dist.fsdp.flatten_parameters", "True is what the engine does (one flat "
                    "buffer per unit); False is ignored: the engine always flattens, and "
                    "parameters keep their names, so per-parameter optimizer groups still work"),
            ignored("dist.fsdp.use_spmd", "XLA SPMD FSDPv2; the engine's sharding gives the same "
                    "numbers"),
            ignored("dist.fsdp.shard_output_callable", "XLA SPMD output sharding has no "
                    "meaning without XLA"),
            translated("compute.bf16 / compute.fp16", "MixedPrecision(param_dtype=bf16|fp16, "
                       "reduce_dtype=fp32, output_dtype=fp32), buffers kept fp32"),
            rejected("compute.bf16 and compute.fp16", "only one low-precision dtype"),
            ignored("compute.acc_scaled_dot_attn", "TorchAcc's flash-attention kernels are not "
                    "patched in"),
            translated("compute.disable_kernel_patches", "no kernels are patched either way"),
            ignored("memory.gc", "gradient checkpointing is not applied (use torch's "
                    "apply_activation_checkpointing)"),
            rejected("dist.tp.size / dist.pp.size / dist.sp.size > 1", "tensor, pipeline and "
                     "sequence parallelism are not supported"),
            translated("backend='eager'", "the default: what the engine runs"),
            ignored("backend", "'lazy' (XLA lazy tensors) is not available without torch_xla; "
                    "the model runs eagerly, which gives TorchAcc's eager-backend numbers"),
            ignored("dataloader.buckets", "batches are not padded to bucket lengths (bucketing "
                    "only spares XLA recompilations); each batch keeps the length the "
                    "dataloader gives it"),
            ignored("dataloader.num_buckets", "no bucketing (see dataloader.buckets)"),
            ignored("dataloader.max_length", "no bucketing (see dataloader.buckets)"),
            ignored("dataloader.pad_value_dict", "no bucketing, so no padding (see "
                    "dataloader.buckets)"),
            translated("accelerate(dataloader)", "each data-parallel rank gets its slice of "
                       "every batch (dim 0), moved to the model's device"),
        ),
    )
)


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_argument(FRONTEND, name, value, f"an int >= {minimum}",
                           f"e.g. config.{name} = {max(minimum, 2)}.")


def sizes(config, world: int) -> tuple[int, int]:
    """(dp, fsdp) sizes."""
    fsdp = config.dist.fsdp.size
    _check_int("dist.fsdp.size", fsdp)
    for name in ("tp", "pp", "sp"):
        size = getattr(config.dist, name).size
        if size != 1:
            raise bad_argument(FRONTEND, f"dist.{name}.size", size, "1 (only data parallelism "
                               "and FSDP are supported)", f"Set config.dist.{name}.size = 1.")
    if world % fsdp:
        raise bad_argument(FRONTEND, "dist.fsdp.size", fsdp, f"a divisor of the world size "
                           f"{world}", "e.g. config.dist.fsdp.size = world size.")
    dp = config.dist.dp.size
    if dp is None:
        dp = world // fsdp
    _check_int("dist.dp.size", dp)
    if dp * fsdp != world:
        raise bad_argument(FRONTEND, "dist.dp.size", dp, f"world / fsdp.size = {world // fsdp}",
                           "Leave dist.dp.size None to infer it.")
    return dp, fsdp


_FLAGS = ("compute.bf16", "compute.fp16", "compute.acc_scaled_dot_attn",
          "compute.disable_kernel_patches", "memory.gc", "dist.fsdp.flatten_parameters",
          "dist.fsdp.sync_module_states", "dist.fsdp.use_spmd")


def _part(config, path: str):
    for attribute in path.split("."):
        config = getattr(config, attribute)
    return config


def _backend_and_dataloader_notes(config) -> tuple[str, ...]:
    if config.backend not in ("eager", "lazy"):
        raise bad_argument(FRONTEND, "backend", config.backend, "'eager' or 'lazy'",
                           "Set config.backend = 'eager' (the default).")
    notes = ()
    if config.backend == "lazy":
        notes += (TABLE.warn_ignored("backend", "lazy"),)
    for field in ("buckets", "num_buckets", "max_length", "pad_value_dict"):
        value = getattr(config.dataloader, field)
        if value is not None:
            notes += (TABLE.warn_ignored(f"dataloader.{field}", value),)
    return notes


def build_plan(model: nn.Module, config, world: int) -> Plan:
    from fsdp_bridge.torchacc.config import Config

    if not isinstance(model, nn.Module):
        raise bad_argument(FRONTEND, "model", model, "an nn.Module", "Pass the model.",
                           exc=TypeError)
    if not isinstance(config, Config):
        raise bad_argument("torchacc.accelerate", "config", config, "a torchacc.Config",
                           "Build one with torchacc.Config() and set its fields.", exc=TypeError)
    dp, fsdp = sizes(config, world)
    for name in _FLAGS:
        part, field = name.rsplit(".", 1)
        check_bool(FRONTEND, name, getattr(_part(config, part), field))
    notes = _backend_and_dataloader_notes(config)
    compute = config.compute
    if compute.bf16 and compute.fp16:
        raise bad_argument(FRONTEND, "compute.fp16", compute.fp16, "False when compute.bf16 is "
                           "True", "Choose one of compute.bf16 and compute.fp16.")
    fc = config.dist.fsdp
    if not fc.flatten_parameters:
        notes += (TABLE.warn_ignored("dist.fsdp.flatten_parameters", False),)
    if fc.use_spmd:
        notes += (TABLE.warn_ignored("dist.fsdp.use_spmd", True),)
    if fc.shard_output_callable is not None:
        notes += (TABLE.warn_ignored("dist.fsdp.shard_output_callable", fc.shard_output_callable),)
    if compute.acc_scaled_dot_attn:
        notes += (TABLE.warn_ignored("compute.acc_scaled_dot_attn", True),)
    if config.memory.gc:
        notes += (TABLE.warn_ignored("memory.gc", True),)
    names = _wrap_layer_names(fc.wrap_layer_cls)
    present = {type(m).__name__ for m in model.modules()}
    unknown = sorted(set(names) - present)
    if unknown:
        raise bad_argument(FRONTEND, "dist.fsdp.wrap_layer_cls", set(names), "names of module "
                           "classes in the model (e.g. " + ", ".join(sorted(present)[:6]) + ")",
                           f"{unknown} not found; check the spelling.")
    paths = module_paths(model)
    units = [UnitSpec(paths[id(m)]) for m in policies.post_order(model)
             if m is not model and type(m).__name__ in names]
    dtype = torch.bfloat16 if compute.bf16 else torch.float16 if compute.fp16 else None
    precision = (MixedPrecision(cast_root_forward_inputs=False) if dtype is None else
                 MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32))
    mode = ShardingMode.REPLICATE if fsdp == 1 else (ShardingMode.HYBRID if dp > 1
                                                     else ShardingMode.SHARD)
    # TorchAcc's eager backend wraps with torch's FSDP1: its reductions, no_sync sums and kept
    # gradients follow FSDP1's arithmetic.
    return Plan(units=tuple(units) + (UnitSpec("", mode is not ShardingMode.REPLICATE),),
                mode=mode, mixed_precision=precision,
                sync_module_states=bool(fc.sync_module_states), divide_around_reduce=True,
                unsynced_grad_sum=UnsyncedGradSum.COMPUTE_DTYPE, rereduce_kept_grad=True,
                frontend=FRONTEND, notes=notes)



def _wrap_layer_names(value) -> set:
    """`dist.fsdp.wrap_layer_cls` as a set of class names, or a TypeError naming the fix. A
    class (or a set of classes) is the usual slip: TorchAcc takes the classes' names."""
    collection = isinstance(value, (set, frozenset, list, tuple))
    if collection and all(isinstance(name, str) for name in value):
        return set(value)
    items = value if collection else [value]
    classes = sorted(item.__name__ for item in items if isinstance(item, type))
    if classes:
        fix = f"Pass the classes' names: config.dist.fsdp.wrap_layer_cls = {set(classes)}."
    elif isinstance(value, str):
        fix = f"Put the name in a set: config.dist.fsdp.wrap_layer_cls = { {value} }."
    else:
        fix = "e.g. config.dist.fsdp.wrap_layer_cls = {'GPT2Block'}."
    raise bad_argument(FRONTEND, "dist.fsdp.wrap_layer_cls", value,
                       "a set of class names (strings)", fix, exc=TypeError)
