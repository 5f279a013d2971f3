"""Lightning's FSDP strategy on fsdp_bridge's engine.

    import fsdp_bridge.integrations.lightning  # registers the strategy name "fsdp_bridge"
    trainer = L.Trainer(strategy="fsdp_bridge", ...)  # was: strategy="fsdp"

or `strategy=FSDPStrategy(...)` from this module with the arguments of Lightning's
`FSDPStrategy` (auto_wrap_policy, mixed precision, sharding_strategy, cpu_offload,
activation_checkpointing_policy, ...). The model is wrapped by fsdp_bridge's
`FullyShardedDataParallel` (the FSDP1 front-end) with those arguments; checkpoints are full
state dicts (`state_dict_type="full"`, Lightning's default) saved and loaded through our
wrapper. A checkpoint of Lightning's own FSDPStrategy (optimizer states keyed by parameter
index) is rekeyed by name on load.

For Fabric: `Fabric(strategy="fsdp_bridge")` (or `FabricFSDPStrategy(...)` with the arguments of
Fabric's `FSDPStrategy`) wraps `setup_module` with our `FullyShardedDataParallel`, and
`clip_gradients` / `no_backward_sync` reach our wrapper; `fabric.save` / `fabric.load` write and
read one full checkpoint file laid out as Fabric's own FSDPStrategy writes it with
`state_dict_type="full"` (model and optimizer states by key, the rest as given); sharded
checkpoints are refused by name.

Lightning's `ModelParallelStrategy` needs nothing of this module: shard with
`fsdp_bridge.fsdp.fully_shard` in `LightningModule.configure_model`.
"""

from __future__ import annotations

from fsdp_bridge.extras import require_for

require_for(__name__, "lightning")

from contextlib import contextmanager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy as FabricLightningFSDPStrategy  # noqa: E402
from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing  # noqa: E402
from lightning.fabric.strategies.strategy import (  # noqa: E402
    _apply_filter,
    _BackwardSyncControl,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.load import _move_state_into  # noqa: E402
from lightning.fabric.utilities.types import _Stateful  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import FSDPPrecision  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from torch.distributed.fsdp import (  # noqa: E402
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictType,
)

from fsdp_bridge.fsdp import FullyShardedDataParallel  # noqa: E402
from fsdp_bridge.fsdp.wrap import enable_wrap  # noqa: E402
from fsdp_bridge.translation import bad_argument  # noqa: E402

FRONTEND = "fsdp_bridge.integrations.lightning.FSDPStrategy"
FABRIC_FRONTEND = "fsdp_bridge.integrations.lightning.FabricFSDPStrategy"
# The parts wrappers add to parameter names (FSDP1 units, activation checkpointing).
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _wrapped(strategy, module: torch.nn.Module, kwargs: dict) -> torch.nn.Module:
    """`module` wrapped by our FullyShardedDataParallel with a Lightning FSDP strategy's
    arguments (unless the user wrapped it already), activation checkpointing after, as
    Lightning does."""
    if not any(isinstance(sub, FullyShardedDataParallel) for sub in module.modules()):
        module = FullyShardedDataParallel(
            module=module, cpu_offload=strategy.cpu_offload,
            mixed_precision=strategy.mixed_precision_config,
            sharding_strategy=strategy.sharding_strategy,
            device_id=strategy.root_device.index, **kwargs)
    _setup_activation_checkpointing(module, strategy._activation_checkpointing_kwargs)
    return module


def _wrap_context(strategy, kwargs: dict):
    """`wrap(...)` inside it builds our wrapper (Lightning's `model_sharded_context`)."""
    return enable_wrap(wrapper_cls=FullyShardedDataParallel, cpu_offload=strategy.cpu_offload,
                       mixed_precision=strategy.mixed_precision_config,
                       sharding_strategy=strategy.sharding_strategy,
                       device_id=strategy.root_device.index, **kwargs)


def _full_state_dicts(model, rank0_only: bool = True):
    return FullyShardedDataParallel.state_dict_type(
        model, StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only))


def _optimizer_keyed_by_name(state: dict, model: torch.nn.Module) -> dict:
    """Lightning's own FSDP strategies may save optimizer states keyed by parameter index (the
    order of the model's parameters); ours are keyed by name."""
    if not state["state"] or not isinstance(next(iter(state["state"])), int):
        return state
    names = [_clean(name) for name, _ in model.named_parameters()]
    groups = [dict(group, params=[names[i] for i in group["params"]])
              for group in state["param_groups"]]
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": groups}


def _check_full(frontend: str, state_dict_type: str) -> None:
    if state_dict_type != "full":
        raise bad_argument(frontend, "state_dict_type", state_dict_type, "'full' (one file; "
                           "sharded checkpoints are not supported by this strategy yet)",
                           "Pass state_dict_type='full'.")


def _check_root(module, what: str) -> None:
    if not isinstance(module, FullyShardedDataParallel):
        raise bad_argument(FABRIC_FRONTEND, "module", module, "the module Fabric's setup "
                           "returned (wrapped by FullyShardedDataParallel)", "Pass the set-up "
                           f"module to {what}.", exc=TypeError)


class FSDPStrategy(LightningFSDPStrategy):
    """Lightning's FSDPStrategy, wrapping with fsdp_bridge's FullyShardedDataParallel."""

    strategy_name = "fsdp_bridge"
    _registered_strategies: list = []  # its own list: Lightning's names its FSDP (GPU only)

    def __init__(self, *args, state_dict_type: str = "full", **kwargs):
        _check_full(FRONTEND, state_dict_type)
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    @property
    def precision_plugin(self) -> FSDPPrecision:
        return LightningFSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if isinstance(plugin, FSDPPrecision) and not isinstance(plugin, _NormClippingPrecision):
            plugin = _NormClippingPrecision(plugin.precision, plugin.scaler, lambda: self.model)
        LightningFSDPStrategy.precision_plugin.fset(self, plugin)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return _wrapped(self, model, self.kwargs)

    @contextmanager
    def model_sharded_context(self):
        with _wrap_context(self, self.kwargs):
            yield

    def _full_state_dicts(self, rank0_only: bool = True):
        return _full_state_dicts(self.model, rank0_only)

    def lightning_module_state_dict(self) -> dict:
        with self._full_state_dicts():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        """The full optimizer state dict, keyed by parameter name."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        with self._full_state_dicts():
            return FullyShardedDataParallel.optim_state_dict(self.model, optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            raise bad_argument(FRONTEND, "checkpoint_path", str(path), "a file holding a full "
                               "checkpoint (state_dict_type='full')", "Pass the .ckpt file.")
        checkpoint = torch.load(path, map_location="cpu", weights_only=bool(weights_only))
        with self._full_state_dicts(rank0_only=False):
            self.model.load_state_dict(checkpoint.pop("state_dict"),
                                       strict=self.lightning_module.strict_loading)
        states = checkpoint.get("optimizer_states")
        if states is None or self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        if len(states) != len(self.optimizers):
            raise RuntimeError(f"{len(self.optimizers)} optimizers are configured but the "
                               f"checkpoint holds {len(states)} optimizer states: resume with "
                               "the same number of optimizers.")
        with self._full_state_dicts(rank0_only=False):
            for optimizer, state in zip(self.optimizers, states):
                state = FullyShardedDataParallel.optim_state_dict_to_load(
                    self.model, optimizer, _optimizer_keyed_by_name(state, self.lightning_module))
                optimizer.load_state_dict(state)
        return checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Fully Sharded Data "
                                   "Parallel on fsdp_bridge's engine", override=True)
        cls._registered_strategies.append(cls.strategy_name)


class _NormClippingPrecision(FSDPPrecision):
    """Lightning's FSDP precision, whose norm clipping (`gradient_clip_algorithm="norm"`, the
    default) runs the root wrapper's `clip_grad_norm_` over every shard, as FSDP requires;
    Lightning's own refuses it, holding no reference to the root."""

    def __init__(self, precision, scaler, root):
        super().__init__(precision, scaler)
        self._root = root

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        self._root().clip_grad_norm_(clip_val)


class FabricFSDPStrategy(FabricLightningFSDPStrategy):
    """Fabric's FSDPStrategy, wrapping with fsdp_bridge's FullyShardedDataParallel. Its
    checkpoints are full (Fabric's defaults to "sharded", which this strategy refuses)."""

    def __init__(self, *args, state_dict_type: str = "full", **kwargs):
        _check_full(FABRIC_FRONTEND, state_dict_type)
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)
        self._backward_sync_control = _NoSyncOfOurs()

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return _wrapped(self, module, self._fsdp_kwargs)

    def module_sharded_context(self):
        return _wrap_context(self, self._fsdp_kwargs)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite=True):
        _check_root(module, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        return module.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        """`fabric.save`: one full checkpoint file, written by rank 0."""
        if storage_options is not None:
            raise bad_argument(FABRIC_FRONTEND, "storage_options", storage_options, "None (the "
                               "file is written with torch.save)", "Drop storage_options.",
                               exc=TypeError)
        path = Path(self.broadcast(path))
        if path.is_dir():
            raise bad_argument(FABRIC_FRONTEND, "path", str(path), "a file path (checkpoints are "
                               "full state dicts in one file)", "Pass a file name.")
        _, model = _the_model(state, "fabric.save")
        full: dict = {}
        with _full_state_dicts(model):
            for key, obj in state.items():
                if isinstance(obj, torch.nn.Module):
                    converted = obj.state_dict()
                elif isinstance(obj, torch.optim.Optimizer):
                    converted = FullyShardedDataParallel.optim_state_dict(model, obj)
                else:
                    converted = obj.state_dict() if isinstance(obj, _Stateful) else obj
                _apply_filter(key, filter or {}, converted, full)
        if self.global_rank == 0:
            torch.save(full, path)
        self.barrier()

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        """`fabric.load`: a full checkpoint file (ours, or Fabric's FSDPStrategy's with
        state_dict_type="full") into the set-up model, its optimizers and the rest of `state`."""
        path = Path(self.broadcast(path))
        if not path.is_file():
            raise bad_argument(FABRIC_FRONTEND, "path", str(path), "a file holding a full "
                               "checkpoint (state_dict_type='full')", "Pass the checkpoint file.")
        checkpoint = torch.load(path, map_location="cpu", weights_only=bool(weights_only))
        if isinstance(state, torch.nn.Module):  # the file is the model's raw state dict
            _, model = _the_model({"model": state}, "fabric.load")
            with _full_state_dicts(model, rank0_only=False):
                model.load_state_dict(checkpoint, strict=strict)
            return {}
        key, model = _the_model(state or {}, "fabric.load")
        with _full_state_dicts(model, rank0_only=False):
            model.load_state_dict(checkpoint.pop(key), strict=strict)
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        for optim_key, optimizer in optimizers.items():
            with _full_state_dicts(model, rank0_only=False):
                loaded = _optimizer_keyed_by_name(checkpoint.pop(optim_key), model)
                optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(
                    model, optimizer, loaded))
        requested = state.keys() - {key} - optimizers.keys()
        _validate_keys_for_strict_loading(requested, checkpoint.keys(), strict=strict)
        _move_state_into(source=checkpoint, destination=state, keys=requested)
        return checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("fsdp_bridge", cls, description="Fully Sharded Data "
                                   "Parallel on fsdp_bridge's engine", override=True)


def _the_model(state: dict, what: str):
    """(key, module) of the one model our wrapper set up in a Fabric checkpoint's state."""
    models = [(key, obj) for key, obj in state.items()
              if isinstance(obj, torch.nn.Module)
              and any(isinstance(sub, FullyShardedDataParallel) for sub in obj.modules())]
    if len(models) != 1:
        raise bad_argument(FABRIC_FRONTEND, "state", sorted(state), "a dict holding exactly one "
                           "model set up by this strategy, e.g. {'model': model, 'optimizer': "
                           f"optimizer}}; found {len(models)}", f"Pass one set-up model to {what} "
                           "(save several models to separate files).")
    return models[0]


class _NoSyncOfOurs(_BackwardSyncControl):
    """`fabric.no_backward_sync(module)`: our wrapper's `no_sync()`."""

    def no_backward_sync(self, module, enabled: bool):
        if not enabled:
            return nullcontext()
        _check_root(module, "fabric.no_backward_sync")
        return module.no_sync()


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


FSDPStrategy.register_strategies(StrategyRegistry)
FabricFSDPStrategy.register_strategies(FABRIC_STRATEGIES)
