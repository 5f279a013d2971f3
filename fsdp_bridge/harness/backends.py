"""Backends: how one recipe is sharded and trained.

A backend wraps the recipe's model in one dialect (FSDP1, FSDP2, YaFSDP) from one implementation
(torch's own, or fsdp-bridge's front-ends), and knows that dialect's way to skip gradient sync
during accumulation and to produce a full state dict. The `bridge-*` backends are the `torch-*`
ones with the dialect's module swapped, written against the front-end APIs only; each imports its
front-end lazily and `check_available` turns a missing one into a clear error.

| backend        | implementation                              | runs on           |
|----------------|---------------------------------------------|-------------------|
| reference      | plain module, global batch                  | rank 0 alone      |
| torch-fsdp1    | torch.distributed.fsdp.FullyShardedDataParallel | every rank    |
| torch-fsdp2    | torch.distributed.fsdp.fully_shard          | every rank        |
| bridge-fsdp1   | fsdp_bridge.fsdp.FullyShardedDataParallel   | every rank        |
| bridge-fsdp2   | fsdp_bridge.fsdp.fully_shard                | every rank        |
| bridge-yafsdp  | fsdp_bridge.ya_fsdp.YaFSDP                  | every rank        |

[Note: the reference under mixed precision]
FSDP with `param_dtype=bf16` computes forward and backward with bf16 copies of fp32 master
weights and reduces gradients in fp32. The reference does the same on one process: its forward
runs `functional_call` with parameters cast to the compute dtype (the cast is differentiable, so
gradients arrive in fp32 on the masters), and floating inputs are cast like FSDP's root does.
Low-precision gradients of a whole batch round differently from the fp32 mean of per-rank
low-precision gradients, so under mixed precision the reference runs every rank's micro-batch
as a chunk of its own and accumulates the chunks' gradients in fp32, as the reduction does
(runner.py). In fp32 it runs each global micro-batch at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import warnings
from typing import Iterator, Optional, Union

import torch
from torch import nn

from fsdp_bridge.harness.recipes import Recipe


class BackendUnavailable(RuntimeError):
    """The implementation behind a backend cannot be imported in this build."""


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """Where a backend runs: this rank, the world size and the compute device."""

    rank: int
    world_size: int
    device: torch.device


class Backend:
    """Base class; subclass it to add a backend (tests subclass it to inject bugs)."""

    name = "backend"
    distributed = True  # False: trains on rank 0 alone, on the global batch
    module_name: Optional[str] = None  # the dialect's module, imported lazily
    required: tuple[str, ...] = ()  # names that module must provide
    user_divides_loss = True  # False: the engine divides by the accumulation steps (YaFSDP)

    # -- availability ----------------------------------------------------------------------

    def dialect(self):
        """The dialect's module (lazily imported), or BackendUnavailable naming what is missing."""
        if self.module_name is None:
            return None
        try:
            module = importlib.import_module(self.module_name)
        except ImportError as exc:
            raise BackendUnavailable(
                f"backend {self.name} needs {self.module_name}, not available in this build "
                f"({type(exc).__name__}: {exc})."
            ) from exc
        missing = [name for name in self.required if not hasattr(module, name)]
        if missing:
            raise BackendUnavailable(
                f"backend {self.name} needs {self.module_name}.{missing[0]}, not available in "
                f"this build ({self.module_name} has no {', '.join(missing)})."
            )
        return module

    def check_available(self) -> None:
        self.dialect()

    # -- training --------------------------------------------------------------------------

    def build_model(self, recipe: Recipe, env: RankEnv) -> nn.Module:
        """The unwrapped model (the recipe's, seeded); `wrap` shards it."""
        return recipe.build_model()

    def wrap(self, model: nn.Module, recipe: Recipe, env: RankEnv) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, recipe: Recipe, env: RankEnv):
        return recipe.build_optimizer(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context for every micro-batch but the last: accumulate without reducing."""
        return contextlib.nullcontext()

    def before_step(self, model: nn.Module, step: int, env: RankEnv) -> None:
        """Called before each step's first forward (a place for tests to inject faults)."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of `max_norm`; the total norm before clipping.
        The default is torch's function (FSDP1 models override it with their method)."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def after_step(self, model: nn.Module, optimizer, recipe: Recipe, env: RankEnv,
                   step: int) -> tuple:
        """Called after each optimizer step; returns the (model, optimizer) to go on with (a
        backend that checkpoints and resumes returns new ones)."""
        return model, optimizer

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict (collective); only rank 0's result is used."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def _mp_dtype(recipe: Recipe) -> Optional[torch.dtype]:
    return None if recipe.mp == "fp32" else recipe.compute_dtype


def _unit_modules(model: nn.Module, recipe: Recipe) -> list[tuple[str, nn.Module]]:
    """Modules that become their own unit, children before parents, the root excluded."""
    classes = tuple(recipe.unit_classes)
    found = [(name, m) for name, m in model.named_modules() if name and classes
             and isinstance(m, classes)]
    return list(reversed(found))


def _cpu_fp32(state: dict) -> dict[str, torch.Tensor]:
    return {key: value.detach().to("cpu", torch.float32) if value.is_floating_point()
            else value.detach().cpu() for key, value in state.items()}


# --- the reference --------------------------------------------------------------------------


class _CastForward(nn.Module):
    """Runs `module` with its parameters cast to `dtype` (see [Note: the reference ...])."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        cast = functools.partial(_cast_floating, dtype=self.dtype)
        params = {name: p.to(self.dtype) for name, p in self.module.named_parameters()}
        args, kwargs = torch.utils._pytree.tree_map(cast, (args, kwargs))
        return torch.func.functional_call(self.module, params, args, kwargs)


def _cast_floating(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class ReferenceBackend(Backend):
    """One process on the global batch: mathematically what DDP computes."""

    name = "reference"
    distributed = False

    def wrap(self, model, recipe, env):
        model = model.to(env.device)
        dtype = _mp_dtype(recipe)
        return model if dtype is None else _CastForward(model, dtype)

    def build_optimizer(self, model, recipe, env):
        inner = model.module if isinstance(model, _CastForward) else model
        return recipe.build_optimizer(inner.parameters())

    def full_state_dict(self, model):
        inner = model.module if isinstance(model, _CastForward) else model
        return _cpu_fp32(inner.state_dict())

# Each FSDP dialect runs the same backend code imported from torch or from fsdp_bridge.
TORCH_FSDP, BRIDGE_FSDP = "torch.distributed.fsdp", "fsdp_bridge.fsdp"


# --- FSDP1 ----------------------------------------------------------------------------------

_STRATEGY_FSDP1 = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP",
                   "no_shard": "NO_SHARD"}


class FSDP1Backend(Backend):
    """`FullyShardedDataParallel` with `transformer_auto_wrap_policy` over the unit classes."""

    required = ("FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision",
                "StateDictType", "FullStateDictConfig")

    def wrap(self, model, recipe, env):
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        fsdp = self.dialect()
        policy = None
        if recipe.unit_classes:
            policy = functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls=set(recipe.unit_classes))
        dtype = _mp_dtype(recipe)
        mixed = None if dtype is None else fsdp.MixedPrecision(param_dtype=dtype,
                                                                reduce_dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD deprecation
            return fsdp.FullyShardedDataParallel(
                model,
                sharding_strategy=getattr(fsdp.ShardingStrategy,
                                          _STRATEGY_FSDP1[recipe.strategy]),
                auto_wrap_policy=policy,
                mixed_precision=mixed,
                device_id=env.device,  # FSDP1 requires it on CPU
            )

    def no_sync(self, model):
        return model.no_sync()

    def clip_grad_norm(self, model, max_norm):
        return model.clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        fsdp = self.dialect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # state_dict_type deprecation
            with fsdp.FullyShardedDataParallel.state_dict_type(
                model, fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullStateDictConfig()
            ):
                return _cpu_fp32(model.state_dict())


class TorchFSDP1Backend(FSDP1Backend):
    name, module_name = "torch-fsdp1", TORCH_FSDP


class BridgeFSDP1Backend(FSDP1Backend):
    name, module_name = "bridge-fsdp1", BRIDGE_FSDP


# --- FSDP2 ----------------------------------------------------------------------------------

_RESHARD_FSDP2 = {"full_shard": None, "shard_grad_op": False, "no_shard": None}


class FSDP2Backend(Backend):
    """`fully_shard` on every unit module (children first), then on the root."""

    required = ("fully_shard", "MixedPrecisionPolicy")

    def mesh(self, recipe: Recipe, env: RankEnv):
        from torch.distributed.device_mesh import init_device_mesh

        if recipe.strategy == "no_shard":  # HSDP with shard groups of one: replication
            return init_device_mesh(env.device.type, (env.world_size, 1),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(env.device.type, (env.world_size,))

    def wrap(self, model, recipe, env):
        fsdp = self.dialect()
        model = model.to(env.device)
        dtype = _mp_dtype(recipe)
        kwargs = dict(
            mesh=self.mesh(recipe, env),
            reshard_after_forward=_RESHARD_FSDP2[recipe.strategy],
            mp_policy=fsdp.MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=None if dtype is None else torch.float32),
        )
        for _, module in _unit_modules(model, recipe):
            fsdp.fully_shard(module, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        return model

    @contextlib.contextmanager
    def no_sync(self, model) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_state_dict(self, model):
        state = {key: value.full_tensor() if hasattr(value, "full_tensor") else value
                 for key, value in model.state_dict().items()}
        return _cpu_fp32(state)


class TorchFSDP2Backend(FSDP2Backend):
    name, module_name = "torch-fsdp2", TORCH_FSDP


class BridgeFSDP2Backend(FSDP2Backend):
    name, module_name = "bridge-fsdp2", BRIDGE_FSDP


# --- YaFSDP ---------------------------------------------------------------------------------

_ZERO_STAGE = {"full_shard": 3, "shard_grad_op": 2}


class BridgeYaFSDPBackend(Backend):
    """YaFSDP's constructor: explicit units, a norm class, accumulation steps up front."""

    name = "bridge-yafsdp"
    module_name = "fsdp_bridge.ya_fsdp"
    required = ("YaFSDP",)
    user_divides_loss = False  # YaFSDP divides by world size x gradient_accumulation_steps

    def wrap(self, model, recipe, env):
        if recipe.strategy not in _ZERO_STAGE:
            raise ValueError(f"strategy={recipe.strategy!r} has no YaFSDP form: use "
                             f"{' or '.join(_ZERO_STAGE)} with backend {self.name}.")
        if not recipe.unit_classes or not recipe.norm_classes:
            raise ValueError(f"recipe {recipe.name!r} names no unit_classes/norm_classes: "
                             f"backend {self.name} needs both (YaFSDP's modules_to_wrap_with_names"
                             " and layer_norm_module_cls).")
        ya_fsdp = self.dialect()
        model = model.to(env.device)
        units = [(module, name) for name, module in reversed(_unit_modules(model, recipe))]
        norm_cls = recipe.norm_classes[0]
        inside = tuple(name + "." for _, name in units)
        rogue = {module: name for name, module in model.named_modules()
                 if isinstance(module, norm_cls) and not name.startswith(inside)}
        return ya_fsdp.YaFSDP(
            model,
            zero_stage=_ZERO_STAGE[recipe.strategy],
            param_dtype=recipe.compute_dtype,
            modules_to_wrap_with_names=units,
            layer_norm_module_cls=norm_cls,
            gradient_accumulation_steps=recipe.micro_batches,
            rogue_layer_norm_modules_with_names=rogue,
            device_id=env.device.index if env.device.type == "cuda" else None,
        )

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)  # YaFSDP's gradients are persistent buffers

    def clip_grad_norm(self, model, max_norm):
        return model.clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        return _cpu_fp32(model.state_dict())


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (ReferenceBackend(), TorchFSDP1Backend(), TorchFSDP2Backend(),
                    BridgeFSDP1Backend(), BridgeFSDP2Backend(), BridgeYaFSDPBackend())
}


def get_backend(backend: Union[str, Backend]) -> Backend:
    """A backend by name, or the given Backend instance."""
    if isinstance(backend, Backend):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown: use one of {', '.join(BACKENDS)}, "
                         "or pass a Backend instance.")
    return BACKENDS[backend]
