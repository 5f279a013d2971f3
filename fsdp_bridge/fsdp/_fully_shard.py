"""FSDP2's `fully_shard` over our engine.

[Note: lazy application]
`fully_shard` is applied bottom-up (layers, then the root) and each call is in place. Our engine
shards a whole model with one Plan, so a call only records its settings on the module and swaps
its class to `FSDP<Class>` (a subclass of `FSDPModule` and the original class, as FSDP2 does).
The model is sharded on first use: its first forward, or the first `parameters()` /
`named_parameters()` / `state_dict()` / `unshard()` on an `FSDPModule` (building the optimizer
is such a use). The module used first is the root; every `fully_shard`-ed module below it is a
unit. So FSDP2's meta-device recipe works unchanged: `fully_shard` on meta modules, then
`to_empty(device=...)` and `reset_parameters()` initialise full tensors, which are sharded
when the optimizer is built. Should a submodule be used first (rare), the root releases it
when it is itself first used and shards everything together.

[Note: DTensor-free parameters]
Parameters are 1-D local shards (not DTensors). The FSDP2 idioms that relied on DTensors keep
working: `torch.nn.utils.clip_grad_norm_(model.parameters(), x)` is redirected to the global
norm for our parameters (see `_install_clip_grad_norm`), and `state_dict()` returns full values
as replicated DTensors (so `.full_tensor()` and torch.distributed.checkpoint's
`get_/set_model_state_dict` work).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_bridge import engine
from fsdp_bridge.fsdp import _fsdp2_translate as T

CONFIG = "_fsdp_bridge_fsdp2"  # per fully_shard-ed module: its FullyShardCall
_INITIALIZING = [False]


@dataclasses.dataclass
class FullyShardCall:
    """What one `fully_shard(...)` call asked for, recorded until the model is sharded."""

    modules: tuple  # the module(s) of the call (a list call groups several)
    mesh: Optional[DeviceMesh]
    reshard_after_forward: Any
    mp_policy: MixedPrecisionPolicy
    offload_policy: Any
    ignored_params: frozenset
    root_of: Optional[weakref.ref] = None  # the root module once sharded


class UnshardHandle:
    """Returned by `unshard(async_op=True)`; `wait()` blocks until the gather finished."""

    def __init__(self, groups=()):
        self._groups = list(groups)

    def wait(self) -> None:
        for group in self._groups:
            group.wait_gather()
        self._groups = []


class FSDPModule:
    """Mixed into the class of every `fully_shard`-ed module (`FSDP<Class>`)."""

    # -- lazy sharding ------------------------------------------------------------------------

    def _fsdp_root_state(self):
        _lazy_init(self)
        return _root_sharded(self)

    def named_parameters(self, *args, **kwargs):
        _lazy_init(self)
        return super().named_parameters(*args, **kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if destination is not None or args:  # a parent's recursion (or the engine's own)
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        sharded = self._fsdp_root_state()
        full = engine.full_state_dict(sharded, cpu_offload=False)
        own = _path_in_root(self, sharded)
        mesh = _mesh_of(sharded)
        result = {}
        for key, value in full.items():
            if own and not key.startswith(own + "."):
                continue
            name = key[len(own) + 1:] if own else key
            result[prefix + name] = _replicated(value, mesh)
        if destination is not None:
            destination.update(result)
            return destination
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        sharded = self._fsdp_root_state()
        own = _path_in_root(self, sharded)
        values = {}
        for key, value in state_dict.items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            values[f"{own}.{key}" if own else key] = value
        if own:  # a submodule: complete with the current values of everything else
            current = engine.full_state_dict(sharded, cpu_offload=False)
            values = {**current, **values}
        engine.load_full_state_dict(sharded, values, strict=strict)
        return nn.modules.module._IncompatibleKeys([], [])

    # -- FSDP2's methods ----------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        sharded = self._fsdp_root_state()
        groups = engine.unshard_unit(sharded, _path_in_root(self, sharded))
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        sharded = self._fsdp_root_state()
        engine.reshard_unit(sharded, _path_in_root(self, sharded))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        T.check_bool("set_requires_gradient_sync", "requires_gradient_sync",
                     requires_gradient_sync)
        self._fsdp_root_state().set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        T.check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        T.accepted_no_op("set_requires_all_reduce", requires_all_reduce, True)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        T.check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        T.check_bool("set_reshard_after_backward", "reshard_after_backward",
                     reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        T.check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        T.check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        T.check_fsdp_modules("set_modules_to_forward_prefetch", modules, FSDPModule)

    def set_modules_to_backward_prefetch(self, modules) -> None:
        T.check_fsdp_modules("set_modules_to_backward_prefetch", modules, FSDPModule)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's reduced gradients are divided by `factor` (FSDP2: per module, not
        recursive; a module of a list call shares the factor of the unit it joined)."""
        T.check_factor(factor)
        sharded = self._fsdp_root_state()
        engine.set_gradient_divide_factor(sharded, _path_in_root(self, sharded), float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def reset_iter_state(self) -> None:
        pass

    def set_all_reduce_hook(self, hook, *, stream=None):
        raise T.unsupported("set_all_reduce_hook")

    def set_custom_all_gather(self, comm):
        raise T.unsupported("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm):
        raise T.unsupported("set_custom_reduce_scatter")

    def set_post_optim_event(self, event):
        raise T.unsupported("set_post_optim_event")

    def set_force_sum_reduction_for_comms(self, enable: bool):
        # The engine always reduces with SUM and divides once afterwards: the numbers FSDP2
        # computes with this flag set, whatever its value.
        T.check_bool("set_force_sum_reduction_for_comms", "enable", enable)


# -- helpers ----------------------------------------------------------------------------------


def _replicated(value: torch.Tensor, mesh: DeviceMesh):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _mesh_of(sharded) -> DeviceMesh:
    mesh = getattr(sharded, "_fsdp2_mesh", None)
    if mesh is None:
        mesh = init_device_mesh(sharded.device.type, (dist.get_world_size(),))
        sharded._fsdp2_mesh = mesh
    return mesh


def _root_sharded(module: nn.Module):
    call: FullyShardCall = getattr(module, CONFIG)
    root = call.root_of() if call.root_of is not None else None
    return engine.get_sharded(root) if root is not None else None


def _path_in_root(module: nn.Module, sharded) -> str:
    if module is sharded.module:
        return ""
    for name, sub in sharded.module.named_modules():
        if sub is module:
            return name
    raise AssertionError("module not in its root")


def _fully_sharded_below(root: nn.Module):
    """(path, module) of every fully_shard-ed module in root's tree, post-order, root last."""
    from fsdp_bridge.policies import post_order

    paths = {}
    for name, sub in root.named_modules():
        paths.setdefault(id(sub), name)
    return [(paths[id(m)], m) for m in post_order(root) if hasattr(m, CONFIG)]


def _lazy_init(module: nn.Module) -> None:
    """Shard the model rooted at `module` unless it already is (see [Note: lazy application])."""
    if _INITIALIZING[0]:
        return
    call: FullyShardCall = getattr(module, CONFIG)
    if call.root_of is not None and call.root_of() is not None:
        root = call.root_of()
        if engine.get_sharded(root) is not None:
            return
    _INITIALIZING[0] = True
    try:
        below = _fully_sharded_below(module)
        for _, sub in below:  # release submodules that were sharded as roots of their own
            sub_sharded = engine.get_sharded(sub)
            if sub_sharded is not None and sub is not module:
                engine.release(sub_sharded)
        calls = [(path, getattr(sub, CONFIG)) for path, sub in below]
        plan, mesh_groups, mesh = T.build_plan(module, calls)
        shard_group, replicate_group = mesh_groups
        sharded = engine.shard_model(module, plan, shard_group=shard_group,
                                     replicate_group=replicate_group)
        sharded._fsdp2_mesh = mesh
        ref = weakref.ref(module)
        for _, call_ in calls:
            call_.root_of = ref
    finally:
        _INITIALIZING[0] = False


def _lazy_init_hook(module, args, kwargs):
    if _INITIALIZING[0]:
        return None
    already = _root_sharded(module) is not None
    if already:
        return None
    _lazy_init(module)
    # The engine's own pre-forward hook was registered during this call: run it now.
    sharded = engine.get_sharded(module)
    return engine.run_pre_forward(sharded, "", args, kwargs)


_CLASS_CACHE: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls


def fully_shard(
    module: Union[nn.Module, list],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set] = None,
    dp_mesh_dims=None,
):
    """FSDP2's `fully_shard`: in place, returns the module(s). See [Note: lazy application]."""
    modules = T.check_call(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                           offload_policy, ignored_params, dp_mesh_dims)
    for m in modules:
        if engine.get_sharded(m) is not None or (hasattr(m, CONFIG) and
                                                 _root_sharded(m) is not None):
            raise T.bad("module", m, "a module whose model has not been used yet (fully_shard "
                        "is applied before the first forward / optimizer)",
                        "Call fully_shard on every module first, then build the optimizer.")
    call = FullyShardCall(
        modules=tuple(modules),
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=frozenset(ignored_params or ()),
    )
    for m in modules:
        object.__setattr__(m, CONFIG, call)
        _swap_class(m)
        m.register_forward_pre_hook(_lazy_init_hook, with_kwargs=True, prepend=True)
    _install_clip_grad_norm()
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` gather like `forward` does (e.g. `generate`)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise T.bad("method_name", method_name, f"the name of a method of "
                    f"{type(module).__name__}", "Register an existing method (e.g. 'generate').")
    method = getattr(module, method_name)
    if getattr(method, "_fsdp_bridge_wrapped", False):
        return

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        sharded = module._fsdp_root_state()
        return engine.run_as_forward(sharded, _path_in_root(module, sharded), method,
                                     args, kwargs)

    wrapped._fsdp_bridge_wrapped = True
    object.__setattr__(module, method_name, wrapped)


# -- torch.nn.utils.clip_grad_norm_ --------------------------------------------------------------

_ORIGINAL_CLIP = [None]


def _install_clip_grad_norm() -> None:
    """Redirect torch.nn.utils.clip_grad_norm_ to the global norm when its parameters include
    our local shards (native FSDP2 gets this from DTensor parameters); any other call goes to
    torch's own function unchanged."""
    if _ORIGINAL_CLIP[0] is not None:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    original = utils.clip_grad_norm_
    _ORIGINAL_CLIP[0] = original

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any(engine.owner_of(p) is not None for p in params):
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        total = engine.clip_grads_(params, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped.")
        return total

    utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_norm_ = clip_grad_norm_
