"""accelerate's `Accelerator`, sharding the model with fsdp_bridge's `fully_shard`.

    from fsdp_bridge.integrations.accelerate import Accelerator  # was: from accelerate import ...

With an FSDP2 plugin (`accelerate launch` with `fsdp_version: 2`, or `fsdp_plugin=`),
`prepare(model, optimizer, ...)` shards the model as accelerate's FSDP2 path does: activation
checkpointing first, then `fully_shard` on each module the plugin's auto-wrap policy picks
(bottom-up), then on the root, with the plugin's `mixed_precision_policy`,
`reshard_after_forward`, `cpu_offload` and `ignored_modules` and the accelerator's mesh. It then
hands everything to accelerate's own `prepare`, which leaves a model that is already an
`FSDPModule` as it is. Unlike accelerate, the embeddings and the head are not carved into units
of their own: they stay with the root's (the numbers are the same).

[Note: optimizer by name] accelerate points the optimizer at the sharded parameters by each
tensor's `data_ptr`. A rank that holds no row of a parameter (fewer rows than ranks) has an
empty local shard whose `data_ptr` is 0, so two such parameters on one rank collide: the
optimizer would hold one of them twice and never step the other. This happens to models sharded
natively before `prepare` as well. Here the optimizer is pointed at the parameters by name,
before and again after accelerate's `prepare`.

[Note: FSDP on the CPU]
accelerate takes its FSDP path on accelerators only. On a CPU-only machine a launch with an FSDP
plugin (given, or from `accelerate launch`'s config) becomes plain multi-CPU data parallelism
with `cpu=True`, the plugin dropped without a word, and without it every rank runs alone, as if
it were the only process: either way each rank trains an unsharded copy. Our engine shards on
the CPU (gloo) as on GPUs, so under a launcher (torchrun, accelerate launch) on a machine without
an accelerator this Accelerator asks accelerate for its CPU distributed state (`cpu=True`), then
sets that state where a GPU launch has it (FSDP, with the plugin), and shards. One process
without a launcher cannot shard on any device; a warning says so.

Without an FSDP plugin this is accelerate's Accelerator, unchanged.
"""

from __future__ import annotations

from fsdp_bridge.extras import require_for

require_for(__name__, "accelerate")

import logging  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import accelerate  # noqa: E402
import torch  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, DynamoBackend, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.fsdp_utils import (  # noqa: E402
    fsdp2_apply_ac,
    fsdp2_canonicalize_names,
    fsdp2_prepare_auto_wrap_policy,
    get_module_children_bottom_up,
    get_parameters_from_modules,
)
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule  # noqa: E402

from fsdp_bridge.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard  # noqa: E402
from fsdp_bridge.translation import FsdpBridgeWarning, bad_argument  # noqa: E402

FRONTEND = "fsdp_bridge.integrations.accelerate.Accelerator"
logger = logging.getLogger(__name__)


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator whose FSDP2 `prepare` shards with fsdp_bridge's `fully_shard`
    (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        if _fsdp_asked(kwargs.get("fsdp_plugin")) and _launched_without_accelerator():
            kwargs["cpu"] = True  # see [Note: FSDP on the CPU]
        super().__init__(*args, **kwargs)
        shard_on_cpu(self, kwargs.get("fsdp_plugin"))
        check_fsdp_version(self)

    def prepare(self, *args, device_placement=None):
        check_fsdp_version(self)
        if not self.is_fsdp2:
            return super().prepare(*args, device_placement=device_placement)
        models = [arg for arg in args if isinstance(arg, nn.Module)]
        optimizers = [arg for arg in args if isinstance(arg, torch.optim.Optimizer)]
        if len(models) != 1:  # accelerate refuses these itself, in its own words
            return super().prepare(*args, device_placement=device_placement)
        model = models[0]
        names = _names_by_identity(model)
        if not isinstance(model, TorchFSDPModule):
            check_settings(self)
            shard_model(self, model)
        params = _point_optimizers_by_name(optimizers, names, model)
        plugin = self.state.fsdp_plugin
        # Activation checkpointing was applied before sharding; accelerate would wrap again.
        checkpointing, plugin.activation_checkpointing = plugin.activation_checkpointing, False
        try:
            result = super().prepare(*args, device_placement=device_placement)
        finally:
            plugin.activation_checkpointing = checkpointing
        _restore_params(optimizers, params)  # see [Note: optimizer by name]
        return result


def shard_on_cpu(accelerator: accelerate.Accelerator,
                 plugin: FullyShardedDataParallelPlugin | None = None) -> None:
    """When FSDP was asked for (`plugin`, or `accelerate launch`'s config) and accelerate fell
    back to CPU data parallelism, set its state to FSDP with the plugin, as a GPU launch has it
    (see [Note: FSDP on the CPU]); one process without torch.distributed gets a warning."""
    state = accelerator.state
    if not _fsdp_asked(plugin) or state.distributed_type == DistributedType.FSDP:
        return
    if state.distributed_type == DistributedType.MULTI_CPU:
        plugin = plugin or FullyShardedDataParallelPlugin()  # from accelerate launch's config
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.fsdp_plugin = plugin
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        logger.info("accelerate runs FSDP on accelerators only and chose CPU data parallelism; "
                    "%s shards on the CPU with the FSDP plugin instead", FRONTEND)
    elif state.distributed_type == DistributedType.NO:
        if _launched_without_accelerator():  # the state was made before, without cpu=True
            why = ("accelerate set this rank up alone, as if no other were launched: without an "
                   "accelerator it needs cpu=True to start the CPU ranks' process group")
            fix = ("Pass cpu=True (for the HF Trainer, TrainingArguments(use_cpu=True)), or let "
                   "this Accelerator build accelerate's state.")
        else:
            why = "this is one process without torch.distributed"
            fix = "Start one process per rank with accelerate launch or torchrun."
        warnings.warn(f"{FRONTEND}: an FSDP plugin was given, but {why}, so FSDP is off and the "
                      f"model is not sharded (as with accelerate's own Accelerator). {fix}",
                      FsdpBridgeWarning, stacklevel=3)


def _fsdp_asked(plugin) -> bool:
    """An FSDP plugin given, or `accelerate launch`'s config asking for FSDP."""
    return plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _launched_without_accelerator() -> bool:
    """Started by a launcher (one process per rank) on a machine without a GPU or other
    accelerator torch can use."""
    launched = "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched and not torch.accelerator.is_available()


def check_fsdp_version(accelerator: accelerate.Accelerator) -> None:
    """accelerate's FSDP1 path builds torch's FullyShardedDataParallel itself."""
    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP and state.fsdp_plugin.fsdp_version != 2:
        raise bad_argument(FRONTEND, "fsdp_plugin.fsdp_version", state.fsdp_plugin.fsdp_version,
                           "2 (accelerate's FSDP2 path, whose fully_shard this Accelerator "
                           "replaces by fsdp_bridge's)", "Set fsdp_version: 2 in the accelerate "
                           "config (FullyShardedDataParallelPlugin(fsdp_version=2)).")


def check_settings(accelerator: accelerate.Accelerator) -> None:
    """Refuse, by name, what this Accelerator cannot do as accelerate's FSDP2 would."""
    plugin = accelerator.state.fsdp_plugin
    refused = []
    if plugin.cpu_ram_efficient_loading:
        refused.append(("fsdp_plugin.cpu_ram_efficient_loading", True, "Load the weights on "
                        "every rank (cpu_ram_efficient_loading=False)."))
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        refused.append(("dynamo_plugin.backend", str(accelerator.state.dynamo_plugin.backend),
                        "Drop torch.compile from the accelerate config (dynamo_backend: no)."))
    config = accelerator.parallelism_config
    for name in ("tp_enabled", "cp_enabled", "sp_enabled"):
        if config is not None and getattr(config, name, False):
            refused.append((f"parallelism_config.{name}", True, "Use data parallelism only "
                            "(dp_shard_size / dp_replicate_size)."))
    if accelerator.state.mixed_precision == "fp8":
        refused.append(("mixed_precision", "fp8", "Use mixed_precision='bf16' or 'fp16'."))
    if refused:
        name, value, fix = refused[0]
        also = "".join(f" Also not accepted: {other}={other_value!r}. {other_fix}"
                       for other, other_value, other_fix in refused[1:])
        raise bad_argument(FRONTEND, name, value, "a setting fsdp_bridge's fully_shard runs as "
                           "accelerate's FSDP2 does", fix + also)


def shard_model(accelerator: accelerate.Accelerator, model: nn.Module) -> nn.Module:
    """`model` sharded in place as accelerate's FSDP2 shards it, by our `fully_shard`."""
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload or OffloadPolicy(),
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    if plugin.ignored_modules is not None:
        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model,
                                                               accelerator.device)
    if accelerator.mixed_precision != "no":
        _upcast_trainable(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and not isinstance(module, TorchFSDPModule):
                fully_shard(module, **kwargs)
    # The root resolves reshard_after_forward=None itself (False), as accelerate leaves it.
    kwargs.pop("reshard_after_forward")
    fully_shard(model, **kwargs)
    logger.info("%s: %s sharded by fsdp_bridge's fully_shard (auto-wrap policy %s)", FRONTEND,
                type(model).__name__, "none" if policy is None else "from the plugin")
    return model


def _upcast_trainable(model: nn.Module) -> None:
    """As accelerate under mixed precision: trainable parameters are fp32 master weights (the
    policy's param_dtype is what computes)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def _canonical_parameters(model: nn.Module) -> dict:
    """{name: parameter}, names without the wrappers' parts (activation checkpointing,
    torch.compile), so they match before and after sharding."""
    return fsdp2_canonicalize_names(dict(model.named_parameters()))


def _names_by_identity(model: nn.Module) -> dict:
    return {id(param): name for name, param in _canonical_parameters(model).items()}


def _point_optimizers_by_name(optimizers, names: dict, model: nn.Module) -> list:
    """Point each optimizer's groups at the model's current parameters of the same names;
    returns the new param lists (group by group) to restore after accelerate's prepare."""
    current = _canonical_parameters(model)
    restored = []
    for optimizer in optimizers:
        for index, group in enumerate(optimizer.param_groups):
            params = []
            for param in group["params"]:
                name = names.get(id(param))
                if name is None or name not in current:
                    raise bad_argument(FRONTEND, f"optimizer.param_groups[{index}]", "a tensor "
                                       f"of shape {tuple(param.shape)} that is not a parameter "
                                       "of the model passed with it", "the model's own "
                                       "parameters", "Build the optimizer from "
                                       "model.parameters() of the model given to prepare().")
                params.append(current[name])
            group["params"] = params
            restored.append(list(params))  # a copy: accelerate swaps the group's items in place
    return restored


def _restore_params(optimizers, params: list) -> None:
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    for group, kept in zip(groups, params):
        group["params"] = list(kept)
