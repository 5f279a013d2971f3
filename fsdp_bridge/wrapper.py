"""The FSDP1-style wrapper module shared by the front-ends that return one (FSDP1's
`FullyShardedDataParallel`, Zeta's `fsdp()`, TorchAcc's `accelerate()`).

It holds the user's module as `_fsdp_wrapped_module` (as FSDP1 does), delegates `forward`,
attributes and indexing to it, and exposes FSDP1's behaviour on top of the engine: `no_sync`,
`clip_grad_norm_`, state dicts by `state_dict_type` (FULL / SHARDED / LOCAL), `summon_full_params`,
optimizer state dicts. Front-ends subclass it and add their constructor (the translation).

[Note: SHARDED_STATE_DICT is what DCP can save]
Native FSDP1's SHARDED_STATE_DICT gives, per original parameter, a tensor sharded on dim 0 (a
ShardedTensor, or a DTensor with a device mesh): the unit is gathered and chunked as torch.chunk
does. Scripts hand it to `torch.distributed.checkpoint` (`dcp.save(...)`, then `dcp.load` into
`{"model": model.state_dict()}` and `model.load_state_dict`), which needs each rank's piece
described with its offset. Our flat shards are arbitrary element ranges, and a plain tensor is
taken by DCP as a whole, replicated value: one rank's piece is saved as if it were everything,
and a load meets a different size on every rank. So SHARDED here gives what
`fsdp_bridge.state_dicts.model_state` gives torch's helpers: `Shard(0)` DTensors of the gathered
rows (see [Note: sharded state dicts are DTensors over the rows] there), and loads any sharded
or full form, from any world size, gathering each value before keeping this rank's range.
Optimizer state dicts follow the same rule (keyed by parameter name, as native FSDP1's).

[Note: one wrapper per unit]
Torch's FSDP1 builds one FullyShardedDataParallel instance per unit: with an auto-wrap policy
each unit's module is replaced in its parent by a wrapper around it, and hand-nested wrappers
stay where the user put them. Training code walks that tree (`FSDP.fsdp_modules`, a `check_fn`
of `isinstance(m, FSDP)` for activation checkpointing, per-unit state dicts, names with
`_fsdp_wrapped_module.`), so front-ends whose native library builds it (`_wrapper_per_unit`)
build it too: one engine shards the whole model with the units of its Plan, and once it has,
each non-root unit's module is put under a wrapper of the root's class, in its place. Such a
unit wrapper holds no engine state of its own: it is a face of its unit in the root's engine
(`_unit`), and its methods act on that unit and the units inside it (state dicts with keys
relative to it, `summon_full_params`); `clip_grad_norm_` and `no_sync` are the root's alone, as
natively. When a wrapper is built over a module that already contains wrappers (FSDP1 manual
wrapping, `enable_wrap`/`wrap`), they are taken out of the tree and their engines released,
the outer wrapper shards everything with them as units, and the same wrapper objects are put
back as the faces of those units. The engine's walks of the model by state-dict key pass
through the unit wrappers (see [Note: reading what the modules hold] in engine/state_dict.py).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM

from fsdp_bridge import engine
from fsdp_bridge.mixed_dialects import refuse_taken_over
from fsdp_bridge.state_dicts import (
    below_root,
    flat_optim,
    fsdp1_optim,
    model_state,
    optim_state,
    parts,
    torch_helpers,
)
from fsdp_bridge.state_dicts.torch_helpers import called_by_torch_helpers
from fsdp_bridge.translation import bad_argument, check_bool, truth_of

WRAPPED = "_fsdp_wrapped_module"


def shard_flat(module: nn.Module, plan, **kwargs):
    """`engine.shard_model` for the front-ends whose parameters are flat 1-D local pieces
    (FSDP1, YaFSDP, Zeta, TorchAcc). Such pieces mean nothing to torch's
    `torch.distributed.checkpoint.state_dict` helpers as they are, so these models and their
    optimizers describe themselves to those helpers (see [Note: answering torch's state-dict
    helpers] in fsdp_bridge/state_dicts/torch_helpers.py); FSDP2 models hold DTensors already."""
    torch_helpers.watch_optimizers()
    return engine.shard_model(module, plan, **kwargs)


def hidden_child_names(inner: nn.Module, hidden: str) -> dict:
    """`_fqn_modifiers` of a wrapper that hides its child `hidden` from state-dict names: every
    name directly inside the child is reached through it."""
    names = list(inner._modules) + list(inner._parameters) + list(inner._buffers)
    return {name: hidden for name in names}


def placed(result: dict, destination: Optional[dict], prefix: str) -> dict:
    """A wrapper's own state dict as `nn.Module.state_dict` hands it back: under `prefix`,
    and into `destination` when the parent module passes one."""
    if destination is None:
        return result if not prefix else {prefix + k: v for k, v in result.items()}
    destination.update((prefix + k, v) for k, v in result.items())
    return destination


# Each state-dict type's config classes (model, optimizer), as torch's FSDP1 requires them.
_CONFIG_TYPES = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def _default_config(state_dict_type: StateDictType):
    model_config, optim_config = _CONFIG_TYPES[state_dict_type]
    return model_config(), optim_config()


def _check_config_types(frontend: str, state_dict_type: StateDictType, state_dict_config,
                        optim_state_dict_config) -> None:
    """Configs of exactly the classes of `state_dict_type` (None: its defaults), as torch's
    FSDP1 requires, with its exception type (RuntimeError): a FULL_STATE_DICT with a
    ShardedStateDictConfig would otherwise save in a form nobody asked for."""
    for argument, config, expected in zip(("state_dict_config", "optim_state_dict_config"),
                                          (state_dict_config, optim_state_dict_config),
                                          _CONFIG_TYPES[state_dict_type]):
        if config is not None and type(config) is not expected:
            raise bad_argument(
                frontend, argument, config, f"None or a {expected.__name__} with "
                f"{state_dict_type} (torch's FSDP1 requires that exact class, not "
                f"{type(config).__name__})", f"Pass {expected.__name__}(...) (or None for its "
                "defaults), or the state_dict_type that goes with "
                f"{type(config).__name__}.", exc=RuntimeError)


def _warn_legacy(name: str, replacement: str) -> None:
    """torch's FSDP1 warns for its legacy optimizer state-dict methods: so do we, by name."""
    warnings.warn(f"FullyShardedDataParallel.{name} is deprecated in torch; use "
                  f"FullyShardedDataParallel.{replacement} instead.", FutureWarning, stacklevel=3)


def _refuse_torch_fsdp1_inside(module: nn.Module) -> None:
    """FSDP1's static state-dict methods of ours called on a model that torch's FSDP1 wraps:
    they would leave its settings as they were; torch's own method sets them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1

    if any(isinstance(sub, TorchFSDP1) for sub in module.modules()):
        raise bad_argument(ShardedWrapper._frontend, "module", module, "a model wrapped by "
                           "fsdp_bridge.fsdp.FullyShardedDataParallel (this one is wrapped by "
                           "torch.distributed.fsdp.FullyShardedDataParallel)", "Call the "
                           "static method of the class that wrapped it: torch.distributed.fsdp."
                           "FullyShardedDataParallel.state_dict_type(...) for torch's.")


def _frontend_of(module) -> str:
    """The dialect an error about `module` names: its first wrapper's, else FSDP1's (a module
    without a wrapper does not say which dialect it was meant for)."""
    if isinstance(module, nn.Module):
        for sub in module.modules():
            if isinstance(sub, ShardedWrapper):
                return sub._frontend
    return ShardedWrapper._frontend


def _outermost(wrappers: list) -> list:
    """The wrappers of `wrappers` that are not inside another of them."""
    inside = {id(sub) for wrapper in wrappers for sub in wrapper._modules[WRAPPED].modules()}
    return [wrapper for wrapper in wrappers if id(wrapper) not in inside]


def _refuse_grads_of_flat_params(module: nn.Module, models: list) -> None:
    """Native FSDP1 cannot summon gradients with `use_orig_params=False`: refuse it too."""
    if any(engine.exposes_flat_params(sharded) for sharded in models):
        raise bad_argument(_frontend_of(module), "with_grads", True, "False with "
                           "use_orig_params=False (as torch's FSDP1, which raises "
                           "NotImplementedError)", "Wrap with use_orig_params=True to summon "
                           "gradients, or read the flat parameters' .grad.",
                           exc=NotImplementedError)


class ShardedWrapper(nn.Module):
    """Base of our wrapper modules; `_frontend` names the dialect in messages."""

    _frontend = "FullyShardedDataParallel"
    _hidden_child = WRAPPED  # the inner attribute state-dict names leave out

    # -- construction -------------------------------------------------------------------------

    # Whether each non-root unit is a wrapper of this class in the module tree (see [Note: one
    # wrapper per unit]); front-ends whose native library wraps the model once keep False.
    _wrapper_per_unit = False

    def _attach(self, module: nn.Module, sharded, kwargs: dict,
                unit_wrappers: Optional[dict] = None) -> None:
        """Wrap `module`, which `sharded` shards, as the root; with `_wrapper_per_unit`, put a
        wrapper above every other unit (`unit_wrappers`: FQN -> a wrapper to reuse)."""
        self._modules[WRAPPED] = module
        self._bind(sharded, sharded.units[-1], kwargs)
        if self._wrapper_per_unit:
            self._wrap_units(unit_wrappers or {})

    def _bind(self, sharded, unit, kwargs: dict) -> None:
        object.__setattr__(self, "_sharded", sharded)
        object.__setattr__(self, "_unit", unit)  # the engine's unit this wrapper stands for
        object.__setattr__(self, "_fsdp_kwargs", kwargs)
        self._set_state_dict_settings(StateDictSettings(StateDictType.FULL_STATE_DICT,
                                                        *_default_config(StateDictType.FULL_STATE_DICT)))
        # A root's loads through a parent module cover the units' wrappers inside it (and a
        # root wrapped by hand inside another becomes a unit's wrapper).
        handles = self.__dict__.pop("_parent_load_hooks", ())
        if unit.is_root:
            self.__dict__["_parent_load_hooks"] = handles or below_root.hook_into_parent_loads(self)
        else:
            for handle in handles:
                handle.remove()

    def _wrap_units(self, reuse: dict) -> None:
        """Put a wrapper above each non-root unit's module, in its parent, inner units first."""
        sharded = self._sharded
        for unit in sharded.units[:-1]:  # post-order: a unit's path holds no wrapper yet
            parent_name, _, attr = unit.name.rpartition(".")
            parent = sharded.module.get_submodule(parent_name)
            if parent._modules.get(attr) is not unit.module:
                continue  # a module the model holds under another name first
            wrapper = reuse.get(unit.name)
            if wrapper is None:
                wrapper = type(self).__new__(type(self))
                nn.Module.__init__(wrapper)
                wrapper._modules[WRAPPED] = unit.module
                kwargs = self._unit_wrapper_kwargs(unit)
            else:  # a wrapper the user built keeps the arguments it was given
                kwargs = wrapper._fsdp_kwargs
            assert wrapper._modules[WRAPPED] is unit.module
            wrapper._bind(sharded, unit, kwargs)
            parent._modules[attr] = wrapper

    def _unit_wrapper_kwargs(self, unit) -> dict:
        """The constructor arguments a unit's wrapper reports (the root's, by default)."""
        return self._fsdp_kwargs

    @staticmethod
    def take_out_wrappers(module: nn.Module) -> tuple[tuple[tuple[str, dict], ...], dict]:
        """Take every wrapper of ours out of `module`'s tree, putting the module each wraps in
        its place, and release their engines (see [Note: one wrapper per unit]). Returns
        (FQN in `module`, kwargs) for each unit they stood for, inner units first, and
        FQN -> wrapper, to put the same objects back above the new units."""
        found: list[tuple[str, dict]] = []
        wrappers: dict[str, ShardedWrapper] = {}
        released: list = []

        def visit(parent: nn.Module, prefix: str) -> None:
            for name, child in list(parent.named_children()):
                path = f"{prefix}{name}"
                if not isinstance(child, ShardedWrapper):
                    visit(child, path + ".")
                    continue
                inner = child._modules[WRAPPED]
                parent._modules[name] = inner
                if all(child._sharded is not done for done in released):
                    engine.release(child._sharded)
                    released.append(child._sharded)
                wrappers[path] = child
                visit(inner, path + ".")
                found.append((path, child._unit_kwargs()))

        visit(module, "")
        return tuple(found), wrappers

    def _unit_kwargs(self) -> dict:
        """The settings a unit made from this wrapper keeps when an outer wrapper adopts it
        (the outer one refuses those it cannot honour per unit: see `build_plan`)."""
        keys = ("sharding_strategy", "mixed_precision", "use_orig_params")
        return {k: self._fsdp_kwargs[k] for k in keys if k in self._fsdp_kwargs}

    def _groups(self, recurse: bool = True) -> list:
        """The flat groups of the units inside this wrapper; without `recurse`, only of those
        that no wrapper inside it stands for (its own unit, with a wrapper per unit)."""
        inner = self._modules[WRAPPED]
        units = engine.units_within(self._sharded, inner)
        if not recurse:
            nested = [sub._modules[WRAPPED] for sub in inner.modules()
                      if isinstance(sub, ShardedWrapper)]
            theirs = {id(unit) for sub in nested
                      for unit in engine.units_within(self._sharded, sub)}
            units = [unit for unit in units if id(unit) not in theirs]
        return [group for unit in units for group in unit.groups]

    # -- the wrapped model --------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        return self._modules[WRAPPED]

    @property
    def plan(self):
        return self._sharded.plan

    def forward(self, *args, **kwargs):
        if self._unit.is_root:  # a unit's wrapper runs inside the root's forward
            refuse_taken_over(self._frontend, self._sharded)
        return self._modules[WRAPPED](*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[WRAPPED], name)

    def __getitem__(self, key):
        return self._modules[WRAPPED].__getitem__(key)

    def check_is_root(self) -> bool:
        return self._unit.is_root

    def _only_on_root(self, method: str) -> None:
        """A unit's wrapper (see [Note: one wrapper per unit]) refuses what torch's FSDP1
        refuses on its non-root instances."""
        if not self._unit.is_root:
            raise RuntimeError(
                f"{self._frontend}.{method}() should only be called on the root instance: "
                f"this one wraps the unit {self._unit.name!r} inside another. Call "
                f"root.{method}(...) on the outermost wrapper, which covers every unit (torch's "
                "FSDP1 refuses it on inner instances too).")

    # -- training -----------------------------------------------------------------------------

    def no_sync(self):
        self._only_on_root("no_sync")
        return self._sharded.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._only_on_root("clip_grad_norm_")
        # FSDP1's flat parameters (use_orig_params=False) have one gradient per unit.
        whole = self._fsdp_kwargs.get("use_orig_params") is False
        return self._sharded.clip_grad_norm_(max_norm, norm_type, whole_shards=whole)

    def register_comm_hook(self, state: object, hook) -> None:
        raise NotImplementedError(
            f"{self._frontend}.register_comm_hook is not supported by fsdp_bridge: the engine "
            "runs its own reduce-scatter / all-reduce. Remove the hook (the default hooks "
            "compute the same mean), or use set_gradient_divide_factor-style scaling."
        )

    # -- state dicts --------------------------------------------------------------------------

    def _set_state_dict_settings(self, settings: StateDictSettings) -> None:
        object.__setattr__(self, "_state_dict_settings", settings)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        inner = self._modules[WRAPPED]
        if engine.reading_held_tensors():  # see [Note: reading what the modules hold]
            return inner.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        settings = self._state_dict_settings
        if called_by_torch_helpers():  # see [Note: answering torch's state-dict helpers]
            result = model_state.get_model_state_dict(self)
        elif settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            result = self._sharded_state_dict(settings)
        elif settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            offload = getattr(settings.state_dict_config, "offload_to_cpu", False)
            if self._local_is_full():
                result = engine.full_state_dict(self._sharded, cpu_offload=offload, module=inner)
            else:
                result = engine.local_state_dict(self._sharded, cpu_offload=offload, module=inner)
        else:
            config = settings.state_dict_config
            result = engine.full_state_dict(
                self._sharded,
                rank0_only=getattr(config, "rank0_only", False),
                cpu_offload=getattr(config, "offload_to_cpu", False),
                module=inner,
            )
        return placed(result, destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        inner = self._modules[WRAPPED]
        if called_by_torch_helpers():
            if engine.exposes_flat_params(self._sharded):
                # torch's helpers add what they find registered (the flat parameters, under
                # `..._flat_param`) to a full state dict they load: not the model's keys.
                state_dict = {key: value for key, value in state_dict.items()
                              if key.rpartition(".")[2] != FLAT_PARAM}
            return self._load_rows_state_dict(state_dict, strict)
        if self._state_dict_settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            return self._load_sharded_state_dict(state_dict, strict)
        if self._state_dict_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            if self._local_is_full():
                engine.load_full_state_dict(self._sharded, state_dict, strict=strict,
                                            module=inner)
                return nn.modules.module._IncompatibleKeys([], [])
            missing, unexpected = engine.load_local_state_dict(self._sharded, state_dict,
                                                               strict, module=inner)
            return nn.modules.module._IncompatibleKeys(missing, unexpected)
        engine.load_full_state_dict(self._sharded, state_dict, strict=strict, module=inner)
        return nn.modules.module._IncompatibleKeys([], [])

    def _load_overlap(self, state_dict: dict) -> tuple[list, list]:
        """Load what `state_dict` holds of this model through a parent's load (see [Note:
        loaded through a parent module] in fsdp_bridge/state_dicts/below_root.py); return
        (missing, unexpected) keys. LOCAL keys are our own: the load itself reports them."""
        local = self._state_dict_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT
        if local and self._sharded.comm.shard_size > 1 and not called_by_torch_helpers():
            result = self.load_state_dict(state_dict, strict=False)
            return list(result.missing_keys), list(result.unexpected_keys)
        return below_root.load_overlap(self, state_dict)

    def _local_is_full(self) -> bool:
        """With one rank per shard (NO_SHARD) native FSDP1 gives and takes the full state dict
        under LOCAL_STATE_DICT, and warns: so do we (the same keys and values as native's)."""
        if self._sharded.comm.shard_size > 1:
            return False
        warnings.warn(f"{self._frontend}: with NO_SHARD (one rank per shard), "
                      "LOCAL_STATE_DICT gives and loads the full state dict, as torch's FSDP1.",
                      UserWarning, stacklevel=3)
        return True

    def _fqn_modifiers(self) -> dict:
        return hidden_child_names(self._modules[WRAPPED], WRAPPED)

    def _load_rows_state_dict(self, state_dict: dict, strict: bool):
        return model_state.set_model_state_dict(self, state_dict, strict=strict)

    def _sharded_state_dict(self, settings: StateDictSettings) -> dict:
        """SHARDED_STATE_DICT's values (see [Note: SHARDED_STATE_DICT is what DCP can save])."""
        return model_state.get_model_state_dict(
            self, cpu_offload=getattr(settings.state_dict_config, "offload_to_cpu", False))

    def _load_sharded_state_dict(self, state_dict: dict, strict: bool):
        return self._load_rows_state_dict(state_dict, strict)

    # -- FSDP1's static helpers ---------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["ShardedWrapper"]:
        return [m for m in module.modules()
                if isinstance(m, ShardedWrapper) and (not root_only or m.check_is_root())]

    @staticmethod
    def set_state_dict_type(
        module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
        optim_state_dict_config=None,
    ) -> StateDictSettings:
        frontend = _frontend_of(module)
        if not isinstance(state_dict_type, StateDictType):
            raise bad_argument(
                frontend, "state_dict_type", state_dict_type,
                "a StateDictType (FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT)",
                "Pass a member of torch.distributed.fsdp.StateDictType.")
        _check_config_types(frontend, state_dict_type, state_dict_config,
                            optim_state_dict_config)
        default_config, default_optim = _default_config(state_dict_type)
        settings = StateDictSettings(state_dict_type, state_dict_config or default_config,
                                     optim_state_dict_config or default_optim)
        for argument, config in (("state_dict_config", settings.state_dict_config),
                                 ("optim_state_dict_config", settings.optim_state_dict_config)):
            for field in ("offload_to_cpu", "rank0_only"):
                if hasattr(config, field):  # read by truth value, as torch's FSDP1 reads them
                    truth_of(frontend, f"{argument}.{field}", getattr(config, field))
        wrappers = ShardedWrapper.fsdp_modules(module)
        if not wrappers:
            _refuse_torch_fsdp1_inside(module)
            # As torch's FSDP1: a model without FSDP instances keeps its plain state dicts.
            return StateDictSettings(None, None, None)
        previous = wrappers[0]._state_dict_settings
        for wrapper in wrappers:
            wrapper._set_state_dict_settings(settings)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> Optional[StateDictSettings]:
        """The settings of the wrappers in `module`; None without any, as torch's FSDP1."""
        wrappers = ShardedWrapper.fsdp_modules(module)
        return wrappers[0]._state_dict_settings if wrappers else None

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config=None, optim_state_dict_config=None):
        previous = ShardedWrapper.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                      optim_state_dict_config)
        try:
            yield
        finally:
            for wrapper in ShardedWrapper.fsdp_modules(module):
                wrapper._set_state_dict_settings(previous)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """FSDP1's `summon_full_params`: the units of the wrappers in `module` (each with the
        units inside it; with `recurse=False`, the outermost wrappers' own units only) hold
        their full parameters. Inside, `named_parameters()` / `named_buffers()` of a wrapper
        give clean names (no `_fsdp_wrapped_module.`), as FSDP1's do. `module` may also be a
        submodule of a wrapped model without a wrapper in it: the whole model it belongs to
        is gathered then (a collective over its ranks either way)."""
        for name, value in (("recurse", recurse), ("writeback", writeback),
                            ("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu),
                            ("with_grads", with_grads)):
            check_bool(f"{_frontend_of(module)}.summon_full_params", name, value)
        if rank0_only and writeback:
            raise bad_argument(_frontend_of(module), "writeback", writeback, "False when "
                               "rank0_only=True", "Other ranks hold no full parameters to write "
                               "back; pass writeback=False (as torch's FSDP1 requires).")
        wrappers = ShardedWrapper.fsdp_modules(module)
        summoned: list[tuple] = []  # (engine state, its groups to gather or None for all)
        for wrapper in _outermost(wrappers):
            groups = wrapper._groups(recurse)
            for index, (sharded, known) in enumerate(summoned):
                if sharded is wrapper._sharded:
                    summoned[index] = (sharded, known + [g for g in groups if g not in known])
                    break
            else:
                summoned.append((wrapper._sharded, groups))
        if not wrappers:  # a module inside a wrapped model: its owner, found by its parameters
            for param in module.parameters():
                owner = engine.owner_of(param)
                if owner is not None and all(owner is not s for s, _ in summoned):
                    summoned.append((owner, None))
        if with_grads:
            _refuse_grads_of_flat_params(module, [sharded for sharded, _ in summoned])
        with contextlib.ExitStack() as stack:
            for sharded, groups in summoned:
                ordered = None if groups is None else [g for g in sharded.flat_groups()
                                                       if g in groups]
                stack.enter_context(engine.summon_full_params(
                    sharded, writeback=writeback, rank0_only=rank0_only,
                    with_grads=with_grads, offload_to_cpu=offload_to_cpu, groups=ordered))
            for wrapper in wrappers:
                wrapper.__dict__["_summoning"] = wrapper.__dict__.get("_summoning", 0) + 1
                stack.callback(wrapper.__dict__.__setitem__, "_summoning",
                               wrapper.__dict__["_summoning"] - 1)
            yield

    def named_parameters(self, *args, **kwargs):
        """Inside `summon_full_params`, names without the wrapper prefix (as FSDP1); torch's
        state-dict helpers name native FSDP1's parameters that way too."""
        clean = self.__dict__.get("_summoning", 0) > 0 or called_by_torch_helpers()
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(WRAPPED + ".", "") if clean else name), param

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """Asked by torch's state-dict helpers, without `_fsdp_wrapped_module` (see
        fsdp_bridge/state_dicts/below_root.py)."""
        clean = below_root.named_modules(self, memo, prefix, remove_duplicate)
        return clean if clean is not None else super().named_modules(memo, prefix,
                                                                     remove_duplicate)

    def named_buffers(self, *args, **kwargs):
        clean = self.__dict__.get("_summoning", 0) > 0 or called_by_torch_helpers()
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(WRAPPED + ".", "") if clean else name), buffer

    def apply(self, fn):
        """`fn` on every module, with full parameters: each wrapper gathers its own unit while
        `nn.Module.apply` reaches it (as torch's FSDP1), so no unit is gathered twice."""
        with ShardedWrapper.summon_full_params(self, recurse=False, writeback=True):
            return nn.Module.apply(self, fn)

    @staticmethod
    def _root(model: nn.Module) -> "ShardedWrapper":
        wrappers = ShardedWrapper.fsdp_modules(model)
        if not wrappers:
            raise bad_argument("FullyShardedDataParallel", "model", model, "the wrapped model",
                               "Pass the FullyShardedDataParallel instance.")
        return wrappers[0]

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: Optional[dict] = None, group=None) -> dict:
        """[Note: the optimizer of a model holding the wrapper]
        `model` may hold the wrapper (a module around it, or torch's `checkpoint_wrapper`):
        the optimizer then also steps parameters outside it, and native FSDP1 names every one
        from `model`. So does this (`body.embed.weight`, `extra.weight`); the wrapper's own
        names would leave those parameters' state out of the checkpoint."""
        root = ShardedWrapper._root(model)
        settings = root._state_dict_settings
        if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:  # as native's
            return optim_state.get_optimizer_state_dict(
                model, [optim],
                cpu_offload=getattr(settings.optim_state_dict_config, "offload_to_cpu", False))
        rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
        return ShardedWrapper._full_optim(model, root, optim, rank0_only)

    @staticmethod
    def _full_optim(model: nn.Module, root: "ShardedWrapper", optim, rank0_only: bool) -> dict:
        """FSDP1's full optimizer state dict, named from `model` (see [Note: the optimizer of
        a model holding the wrapper])."""
        if model is root:
            return engine.full_optim_state_dict(root._sharded, flat_optim.pieces_of(optim),
                                                rank0_only=rank0_only)
        full = optim_state.get_optimizer_state_dict(model, [optim], full_state_dict=True)
        return {} if rank0_only and parts.world_rank() != 0 else full

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict, is_named_optimizer: bool = False,
                                 load_directly: bool = False, group=None) -> dict:
        root = ShardedWrapper._root(model)
        settings = root._state_dict_settings
        if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:  # as native's
            # Name-keyed DTensors (or native FSDP1's ShardedTensors) of any world size.
            result = optim_state.optimizer_states_to_load(model, [optim], optim_state_dict)[0]
        else:
            if getattr(settings.optim_state_dict_config, "rank0_only", False):
                optim_state_dict = fsdp1_optim.from_rank0(optim_state_dict, group)
            if model is not root:  # see [Note: the optimizer of a model holding the wrapper]
                result = optim_state.optimizer_states_to_load(model, [optim],
                                                              optim_state_dict)[0]
            else:
                pieces = flat_optim.pieces_of(optim)
                result = flat_optim.for_optimizer(pieces, engine.optim_state_dict_to_load(
                    root._sharded, pieces, optim_state_dict))
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input=None,
                              rank0_only: bool = True, group=None) -> dict:
        return ShardedWrapper._full_optim(model, ShardedWrapper._root(model), optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group=None) -> dict:
        """FSDP1's legacy sharded optimizer state dict: keyed by parameter name, each
        per-parameter state a `Shard(0)` DTensor of the full shape (native FSDP1 gives
        ShardedTensors, or DTensors with a device mesh); loads back through
        `flatten_sharded_optim_state_dict` at any world size."""
        _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
        ShardedWrapper._root(model)  # refuses a model without a wrapper, by name
        return optim_state.get_optimizer_state_dict(model, [optim])

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict:
        """What `optim.load_state_dict` takes, from `sharded_optim_state_dict`'s form (ours or
        native FSDP1's ShardedTensors). A collective; the optimizer is not loaded."""
        _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        ShardedWrapper._root(model)  # refuses a model without a wrapper, by name
        return optim_state.optimizer_states_to_load(model, [optim], sharded_optim_state_dict)[0]

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict, model: nn.Module,
                                    optim_input=None, optim=None) -> dict:
        """This rank's part of a full optimizer state dict, keyed as `optim` numbers its
        parameters; without `optim`, as FSDP1 does, by position in `model.parameters()`
        (for an optimizer then built on `model.parameters()`)."""
        if optim_input is not None:
            raise bad_argument(_frontend_of(model), "optim_input", optim_input, "None",
                               "Pass optim=optimizer (optim_input is deprecated in torch too).")
        root = ShardedWrapper._root(model)
        if optim is None:
            return fsdp1_optim.by_model_order(model, root._sharded, root._frontend,
                                              full_optim_state_dict)
        if model is not root:  # see [Note: the optimizer of a model holding the wrapper]
            return optim_state.optimizer_states_to_load(model, [optim], full_optim_state_dict)[0]
        pieces = flat_optim.pieces_of(optim)
        return flat_optim.for_optimizer(pieces, engine.optim_state_dict_to_load(
            root._sharded, pieces, full_optim_state_dict))

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: Optional[dict], model: nn.Module,
                                      optim_input=None, optim=None, group=None) -> dict:
        """`shard_full_optim_state_dict` of rank 0's full dict (the other ranks' argument is
        ignored, as FSDP1's; they may pass None)."""
        full = fsdp1_optim.from_rank0(full_optim_state_dict, group)
        return ShardedWrapper.shard_full_optim_state_dict(full, model, optim_input, optim=optim)
