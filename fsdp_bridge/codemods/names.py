"""The qualified names the codemods look for, and where the rewritten code imports from.

Codemods match torch/YaFSDP/Zeta/TorchAcc names by *qualified name* (libcst's
qualified names, from its scope analysis), never by text; these tables say which names count.
"""

from __future__ import annotations

import re

# Where the runtime helpers live (the rewritten code imports them from here).
RUNTIME_MODULE = "fsdp_bridge.migrate.runtime"
YAFSDP_MODULE = "fsdp_bridge.ya_fsdp"

FSDP1 = "FullyShardedDataParallel"
FSDP = "torch.distributed.fsdp"  # where FSDP2's public names are imported from
DCP = "torch.distributed.checkpoint.state_dict"
PARTIAL = "functools.partial"

# The modules whose public names are FSDP1's (and FSDP2's, which live next to them).
FSDP_MODULES = (
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
)

# Private FSDP1 internals: there is no translation, only a TODO.
PRIVATE_FSDP_PREFIX = "torch.distributed.fsdp._"
# torch's own FSDP2 implementation lives under a private name too; it is not FSDP1's internals.
FSDP2_PRIVATE_PREFIX = "torch.distributed.fsdp._fully_shard"
PRIVATE_ATTRIBUTES = frozenset(
    {"_fsdp_wrapped_module", "_flat_param", "_handle", "_handles", "_all_handles", "_lazy_init", "_fsdp_state",
     "_is_flat_param", "_fsdp_flattened", "check_is_root"}
)
# Public attributes of FSDP1's wrapper that the new class lacks: flagged where the object is
# known to be the wrapper (a tested isinstance, or a receiver assigned FSDP(...)).
FSDP1_WRAPPER_ATTRIBUTES = frozenset({"params", "check_is_root", "training_state", "compute_device", "process_group"})

# Builtins a codemod resolves (type checks); every other name must come from an import.
BUILTINS_WE_MATCH = frozenset({"isinstance", "issubclass", "type", "getattr", "hasattr",
                               "sum", "len", "zip", "sorted", "enumerate", "map", "filter", "min", "max"})
ATTRIBUTE_BY_NAME = frozenset({"builtins.getattr", "builtins.hasattr"})
TYPE_CHECKS = frozenset({"builtins.isinstance", "builtins.issubclass"})

# FSDP1's `state_dict_type` context and the module methods it configures.
STATE_DICT_TYPE = f"{FSDP1}.state_dict_type"
STATE_DICT_METHODS = ("state_dict", "load_state_dict")

# FSDP1's resume of a sharded optimizer state (ShardedTensors), by its qualified names.
LOAD_SHARDED_OPTIMIZER = frozenset({
    "torch.distributed.checkpoint.load_sharded_optimizer_state_dict",
    "torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict",
})
# FSDP1's static methods, which code also reaches through an instance (`model.optim_state_dict_to_load(...)`).
FSDP1_STATIC_METHODS = frozenset({
    "optim_state_dict", "full_optim_state_dict", "optim_state_dict_to_load", "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict", "sharded_optim_state_dict", "flatten_sharded_optim_state_dict",
    "rekey_optim_state_dict", "fsdp_modules", "state_dict_type", "set_state_dict_type", "get_state_dict_type",
})

# Names that show code already speaks FSDP2 (dual-dialect detection).
FSDP2_NAMES = {"FSDPModule", "fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"}
FSDP2_MARKERS = {"fsdp_version"}
# Names that show a function handles DTensors, hence FSDP2 modules (`param.full_tensor()`).
DTENSOR_MARKERS = frozenset({"full_tensor", "DTensor"})

# Owners of a `clip_grad_norm_` that is not FSDP1's (accelerate, AMP, DeepSpeed, Lightning...).
NOT_FSDP1_CLIP = re.compile(r"accelerat|scaler|engine|trainer|strategy|fabric|optim|utils", re.IGNORECASE)

# Frameworks that wrap a model in torch's own FSDP1 themselves (HF Trainer, accelerate, Lightning):
# a file that imports one may test models that no migrated constructor built.
FSDP1_FRAMEWORKS = ("transformers", "accelerate", "trl", "lightning", "pytorch_lightning")

# Libraries that wrap the model in FSDP themselves when configured to.
HF_CONFIG_CALLS = {
    "transformers.TrainingArguments",
    "transformers.training_args.TrainingArguments",
    "transformers.Seq2SeqTrainingArguments",
    "trl.SFTConfig",
}
ACCELERATE_PLUGIN = {"accelerate.FullyShardedDataParallelPlugin", "accelerate.utils.FullyShardedDataParallelPlugin"}

# What FSDP(...) becomes through the runtime helpers: their arguments are FSDP1's, translated
# when the script runs (a second run must not flag them).
RUNTIME_CONSTRUCTORS = {f"{RUNTIME_MODULE}.fsdp1_fully_shard", f"{RUNTIME_MODULE}.fsdp1_to_yafsdp"}


def is_private_fsdp1(qualified: str) -> bool:
    """`torch.distributed.fsdp._runtime_utils...` (FSDP1 internals), not `..._fully_shard` (FSDP2)."""
    name = qualified + "."
    return name.startswith(PRIVATE_FSDP_PREFIX) and not name.startswith(FSDP2_PRIVATE_PREFIX + ".")


def fsdp_module(module: str) -> bool:
    """True for an FSDP module path (`torch.distributed.fsdp`, `...fsdp.wrap`, ...)."""
    return module in FSDP_MODULES


def fsdp_name(qualified: str) -> str | None:
    """`torch.distributed.fsdp.wrap.ModuleWrapPolicy` -> `ModuleWrapPolicy` (None if not FSDP's)."""
    for module in FSDP_MODULES:
        if qualified.startswith(module + ".") and not qualified.startswith(PRIVATE_FSDP_PREFIX):
            return qualified[len(module) + 1 :]
    return None
