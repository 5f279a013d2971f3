"""FSDP2's `fully_shard` over our engine.

[Note: sharding at fully_shard time]
As in FSDP2, each `fully_shard(module)` call turns the parameters it manages (those of
`module`'s subtree not taken by an earlier, inner call, minus `ignored_params`) into DTensors
sharded by rows over the mesh (`Shard(0)`; `(Replicate(), Shard(0))` on a 2-D mesh) at once,
on whatever device they are (meta included) and without communication. So everything user
code does between `fully_shard` and the first forward means what it means natively:
`to_empty()` + `reset_parameters()`, `distribute_tensor(full, p.device_mesh, p.placements)` +
`load_state_dict(assign=True)`, `model.parameters()` for an optimizer, `state_dict()`.

The engine's runtime (flat buffers, hooks) is built on first use: the first forward, or an
explicit `unshard()` & co. The module used first is the root; every `fully_shard`-ed module
below it is a unit. Building it *adopts* the DTensor parameters the modules hold then (see
[Note: row layout] in fsdp_bridge/engine/row_group.py): their values move into the engine's
flat shards and the Parameter objects stay the ones the user (and an optimizer) holds. Should
a submodule be used first (rare), the root releases it when it is itself first used and shards
everything together.

[Note: DTensor parameters]
Parameters and their gradients are DTensors, and `state_dict()` returns them (sharded, no
communication), so torch's own code is right on them: `clip_grad_norm_`, `get_total_norm`,
torch.distributed.checkpoint and its state-dict helpers, optimizers. `load_state_dict` also
takes full tensors and DTensors of another layout, converted per key to the parameter's layout
(a load pre-hook on each module that holds such parameters).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import threading
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_bridge import engine
from fsdp_bridge.engine.casting import cast_floating
from fsdp_bridge.engine.layout import FLATTENED_MARK, GATHERED_FORM, GatheredForm
from fsdp_bridge.engine.row_group import chunk_rows
from fsdp_bridge.fsdp import _fsdp2_translate as T
from fsdp_bridge.fsdp._stale_optimizer import mark_replaced
from fsdp_bridge.mixed_dialects import refuse_other_dialects, refuse_torch_fsdp1_around
from fsdp_bridge.translation import Shown

CONFIG = "_fsdp_bridge_fsdp2"  # per fully_shard-ed module: its FullyShardCall
SHARDED = "_fsdp_bridge_row_sharded"  # on each DTensor parameter fully_shard made
REPLACED_BY = "_fsdp_bridge_replaced_by"  # on an original parameter: its DTensor
# Per module whose parameters fully_shard replaced: {attribute: GatheredForm}. Its presence also
# says the module's loads are converted (one attribute, not two: every attribute added to a
# module's __dict__ costs memory for as long as the model lives).
FORMS = "_fsdp_bridge_gathered_forms"
# Whether this thread is building a model's runtime: the hooks of the modules being sharded then
# stand aside. Per thread, not per process: ranks of torch's threaded process group (one thread
# each) shard their models at the same time.
_BUILDING = threading.local()
# FSDP2's default mesh per (device type, default process group): each rank of a threaded world
# has a default group of its own, and a mesh records the rank that built it.
_DEFAULT_MESHES: dict = {}


@dataclasses.dataclass(eq=False)  # one per call, hashable by identity as FSDP2's states are
class FullyShardCall:
    """What one `fully_shard(...)` call asked for, recorded until the model is sharded."""

    modules: tuple  # the module(s) of the call (a list call groups several)
    mesh: Optional[DeviceMesh]
    reshard_after_forward: Any
    mp_policy: MixedPrecisionPolicy
    offload_policy: Any
    ignored_params: frozenset
    root_of: Optional[weakref.ref] = None  # the root module once sharded
    # Per-module settings made by FSDPModule's setters ({setting: value}), applied to the
    # call's unit whenever the engine's runtime is built: they may come before the first
    # forward, and a runtime built early for a submodule is rebuilt by its root.
    unit_settings: dict = dataclasses.field(default_factory=dict)
    # (module, attribute, first module, its attribute) for each parameter the call found under
    # several modules (a tied embedding and output weight): see _retie.
    ties: list = dataclasses.field(default_factory=list)
    # (module, attribute, the earlier call's DTensor) for each parameter tied to one an
    # earlier call manages: see [Note: ties across calls].
    shared_with_earlier: list = dataclasses.field(default_factory=list)
    # How many groups of processes the call's parameters are sharded over (FSDP2's parameter
    # groups: more than one when shard_placement_fn gives some a mesh of their own).
    param_groups: int = 1
    # `mesh` holds replicate dimensions alone (dp_mesh_dims without a shard name): FSDP2
    # replicates, DDP-style, all-reducing gradients.
    replicates_only: bool = False


class UnshardHandle:
    """Returned by `unshard(async_op=True)`; `wait()` blocks until the gather finished, then
    the module holds its unsharded parameters (as after a synchronous `unshard()`)."""

    def __init__(self, groups, on_done: Callable[[], None]):
        self._groups = list(groups)
        self._on_done = on_done

    def wait(self) -> None:
        for group in self._groups:
            group.wait_gather()
        self._groups = []
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


class FSDPModule(TorchFSDPModule):
    """Mixed into the class of every `fully_shard`-ed module (`FSDP<Class>`).

    [Note: isinstance checks] It subclasses torch's FSDPModule, so the test libraries and
    frameworks use to find FSDP2 modules (`isinstance(m, torch.distributed.fsdp.FSDPModule)`)
    finds ours, and their FSDP-only code paths run. Every public method of torch's class is
    defined here, so none of torch's implementations (which read torch's private FSDPState)
    is ever reached; code that reaches for that private state gets an error saying so."""

    _frontend = T.FRONTEND  # see fsdp_bridge/mixed_dialects.py

    # torch's `__new__` (used when a container is indexed: `self.__class__(...)`) builds the
    # original class found at this index of the MRO: FSDP<Class>, ours, torch's, Class.
    _orig_cls_mro_index = 3

    # -- lazy sharding ------------------------------------------------------------------------

    def _fsdp_root_state(self):
        _lazy_init(self)
        return _root_sharded(self)

    # -- FSDP2's methods ----------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        sharded = self._fsdp_root_state()
        path = _path_in_root(self, sharded)
        groups = engine.unshard_unit(sharded, path)
        handle = UnshardHandle(groups, lambda: engine.expose_unit(sharded, path))
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        sharded = self._fsdp_root_state()
        engine.reshard_unit(sharded, _path_in_root(self, sharded))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """Whether the units of this module (and of the fully_shard-ed modules below it, with
        `recurse`) reduce their gradients in the next backwards; the other units keep
        theirs, as FSDP2 sets it per module."""
        sync = T.flag("set_requires_gradient_sync", "requires_gradient_sync",
                      requires_gradient_sync)
        for module in _this_and_below(self, recurse):
            _set_on_unit(module, "requires_sync", sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP: whether the units of this module (and below it, with `recurse`) all-reduce
        their reduced gradients over the replicas in the next backwards (False: summed aside
        until a backward with True, as FSDP2)."""
        value = T.flag("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for module in _this_and_below(self, recurse):
            _set_on_unit(module, "requires_all_reduce", value)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        """Before the model's first forward (while the engine is not built), as if given to
        fully_shard for this module (and those below it, with `recurse`). Afterwards the
        units keep what they were built with and a warning names the call: it changes when
        weights are gathered, not the numbers."""
        T.check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        if _root_sharded(self) is not None:
            T.ignored_hint("set_reshard_after_forward", reshard_after_forward,
                           "after the first forward")
            return
        for module in _this_and_below(self, recurse):
            _call_of(module).reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        if not T.flag("set_reshard_after_backward", "reshard_after_backward",
                      reshard_after_backward):
            T.ignored_hint("set_reshard_after_backward", reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if not T.flag("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward):
            T.ignored_hint("set_unshard_in_backward", unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        if not T.flag("set_is_last_backward", "is_last_backward", is_last_backward):
            T.ignored_hint("set_is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        T.check_fsdp_modules("set_modules_to_forward_prefetch", modules, FSDPModule)
        if modules:
            T.ignored_hint("set_modules_to_forward_prefetch", _names(modules))

    def set_modules_to_backward_prefetch(self, modules) -> None:
        T.check_fsdp_modules("set_modules_to_backward_prefetch", modules, FSDPModule)
        if modules:
            T.ignored_hint("set_modules_to_backward_prefetch", _names(modules))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's reduced gradients are divided by `factor` (FSDP2: per module, not
        recursive; a module of a list call shares the factor of the unit it joined)."""
        T.check_factor(factor)
        _set_on_unit(self, "gradient_divide_factor", float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def reset_iter_state(self) -> None:
        pass

    def set_all_reduce_hook(self, hook, *, stream=None):
        """`hook(reduced)` runs on each of this module's reduced gradient shards (after the
        replicas' all-reduce under HSDP), averaged as FSDP2 averages them; with `stream`
        (FSDP without HSDP), inside that stream, as FSDP2 runs it."""
        _refuse_with_several_meshes(self, "set_all_reduce_hook", "hook")
        if not callable(hook):
            raise T.bad("hook", hook, "a callable taking the reduced gradient shard",
                        "e.g. set_all_reduce_hook(lambda reduced: ...).", exc=TypeError)
        if stream is not None:
            mesh = _call_of(self).mesh
            if mesh is not None and mesh.ndim == 2:
                raise ValueError("stream cannot be set when using native HSDP")
            hook = _on_stream(hook, stream, mesh.device_type if mesh is not None else "cpu")
        _set_on_unit(self, "all_reduce_hook", hook)

    def set_custom_all_gather(self, comm) -> None:
        """This module's unit gathers through `comm` (torch's AllGather: `allocate` and a
        call), as FSDP2 (per module, not recursive)."""
        _refuse_with_several_meshes(self, "set_custom_all_gather", "custom comm")
        T.check_comm("set_custom_all_gather", comm)
        _set_on_unit(self, "custom_all_gather", comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """This module's unit reduces its gradients through `comm` (torch's ReduceScatter),
        asked for a SUM (the engine divides afterwards)."""
        _refuse_with_several_meshes(self, "set_custom_reduce_scatter", "custom comm")
        T.check_comm("set_custom_reduce_scatter", comm)
        _set_on_unit(self, "custom_reduce_scatter", comm)

    def set_post_optim_event(self, event) -> None:
        # The engine issues the next step's gathers from the stream the optimizer ran on,
        # after its work (NCCL orders them behind it; gloo runs after the host code): they
        # never read parameters the optimizer is still writing, which is all the event is for.
        # None (what `record_event()` returns on a device without events) asks for nothing.
        if event is not None and not hasattr(event, "wait"):
            raise T.bad("event", event, "a torch.Event (e.g. torch.cuda.Event)",
                        "Pass the event recorded after optimizer.step().", exc=TypeError)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """True: parameters no backward reached get a zero gradient (reduced with the rest)
        instead of keeping `.grad` None, for the units of this module (and below it when
        `recurse`), as FSDP2 includes them in its reduce-scatter."""
        value = T.flag("set_reduce_scatter_unused_params", "reduce_scatter_unused_params",
                       reduce_scatter_unused_params)
        for module in _this_and_below(self, recurse):
            _set_on_unit(module, "reduce_unused_params", value)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        # The engine holds one unit's gradient on the network at a time; a larger cap is a
        # CUDA-stream tuning of FSDP2's own buffers.
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) \
                or max_input_buffers < 1:
            raise T.bad("max_input_buffers", max_input_buffers, "an int >= 1",
                        "e.g. set_reduce_scatter_max_input_buffers(2).")
        T.accepted_no_op("set_reduce_scatter_max_input_buffers", max_input_buffers, 1)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        T.accepted_no_op("set_separate_reduce_scatter_group",
                         T.flag("set_separate_reduce_scatter_group", "enable", enable), False)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        T.accepted_no_op("set_allocate_memory_from_process_group_for_comm",
                         T.flag("set_allocate_memory_from_process_group_for_comm", "enable",
                                enable), False)

    def set_symm_mem_for_comm(self, backend="NCCL") -> None:
        T.accepted_no_op("set_symm_mem_for_comm", backend, None)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        T.flag("_set_unshard_async_op", "async_op", async_op)

    def _get_fsdp_state(self) -> "ForwardHooks":
        # torch's register_fsdp_forward_method (which frameworks call, e.g. HF Trainer for
        # `generate`) reads only the pre/post-forward hooks of this state: see ForwardHooks.
        return ForwardHooks(self)

    def _apply(self, *args, **kwargs):
        # nn.Module's own `_apply` (torch's FSDPModule override reads its private state); the
        # engine checks casts and moves on its own at the next forward.
        return super(TorchFSDPModule, self)._apply(*args, **kwargs)

    def set_force_sum_reduction_for_comms(self, enable: bool):
        # The engine always reduces with SUM and divides once afterwards: the numbers FSDP2
        # computes with this flag set, whatever its value.
        T.flag("set_force_sum_reduction_for_comms", "enable", enable)


class ForwardHooks:
    """What `FSDPModule._get_fsdp_state()` returns: torch's `register_fsdp_forward_method`
    wraps a method in `state._pre_forward(module, args, kwargs)` and `state._post_forward(
    module, args, output)`, which here gather and release the module's unit as its forward
    does (nothing when the unit is running already, e.g. a method called inside forward).
    Any other member of torch's private FSDPState has no counterpart in this engine."""

    def __init__(self, module: nn.Module):
        self._module = module
        self._began = False
        self._forwards = 0

    @torch.compiler.disable  # see [Note: hooks outside the compiler] in engine/runtime.py
    def _pre_forward(self, module: nn.Module, args, kwargs):
        sharded = module._fsdp_root_state()
        path = _path_in_root(module, sharded)
        self._began = not engine.unit_in_use(sharded, path)
        if not self._began:
            return args, kwargs
        args, kwargs = engine.run_pre_forward(sharded, path, args, kwargs)
        self._forwards = engine.forwards_begun(sharded, path)
        return args, kwargs

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args, output):
        if not self._began:
            return output
        self._began = False
        sharded = module._fsdp_root_state()
        path = _path_in_root(module, sharded)
        output = engine.run_post_forward(sharded, path, args, output)
        engine.end_forward_method(sharded, path, self._forwards)
        return output

    def __getattr__(self, name: str):
        raise AttributeError(
            f"{type(self._module).__name__} was sharded by fsdp_bridge's fully_shard, which keeps "
            f"no torch FSDPState: its private member {name!r} does not exist here (only the "
            "_pre_forward/_post_forward that register_fsdp_forward_method calls do). Use the "
            "public FSDPModule methods, or native torch.distributed.fsdp.fully_shard where that "
            "code needs torch's internals.")


# -- helpers ----------------------------------------------------------------------------------


def _call_of(module: nn.Module) -> Optional[FullyShardCall]:
    """The fully_shard call made on `module` itself, read from its own attributes: a wrapper
    that forwards attribute lookups to the module it wraps (CheckpointWrapper) must not pass
    for that module, which would make `fully_shard(wrapper)` look like a second call."""
    return vars(module).get(CONFIG)


def _already_in_use(module: nn.Module) -> bool:
    """Whether `module` belongs to a model the engine has already sharded: it is a root, a
    unit, or a module inside one (its parameters then have an owner; submodules of a model
    that ran are not fully_shard-ed themselves, so only their parameters tell). A model that
    ran *inside* `module` does not count: `module`'s first use releases it and shards all."""
    if engine.get_sharded(module) is not None:
        return True
    if _call_of(module) is not None and _root_sharded(module) is not None:
        return True
    inside = {id(sub) for sub in module.modules()} - {id(module)}
    owners = {id(o): o for o in map(engine.owner_of, module.parameters()) if o is not None}
    return any(id(owner.module) not in inside for owner in owners.values())


def _root_sharded(module: nn.Module):
    call: FullyShardCall = _call_of(module)
    root = call.root_of() if call.root_of is not None else None
    return engine.get_sharded(root) if root is not None else None


def _refuse_with_several_meshes(module: nn.Module, method: str, what: str) -> None:
    """FSDP2 refuses a per-module communication setting for a module whose parameters are
    sharded over several meshes (a `shard_placement_fn` returning ShardPlacementResults): it
    would be ambiguous. So do we, in its words."""
    if _call_of(module).param_groups > 1:
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param mesh via "
            f"shard_placement_fn). The {what} would be ambiguous across groups with different "
            "meshes.")


def _on_stream(hook: Callable, stream, device_type: str) -> Callable:
    """`hook` run inside `stream` (FSDP2's `set_all_reduce_hook(stream=...)`): the stream
    first waits for the work queued so far (the reduction), and the current stream waits for
    the hook's work before anything reads the gradient."""
    backend = torch.get_device_module(device_type)

    def run(reduced: torch.Tensor) -> None:
        current = backend.current_stream()
        stream.wait_stream(current)
        with backend.stream(stream):
            hook(reduced)
        current.wait_stream(stream)

    return run


def _set_collective(kind: str, sharded, path: str, comm) -> None:
    engine.set_custom_collective(sharded, path, kind, comm)


_UNIT_SETTERS = {
    "gradient_divide_factor": engine.set_gradient_divide_factor,
    "reduce_unused_params": engine.set_reduce_unused_params,
    "all_reduce_hook": engine.set_all_reduce_hook,
    "custom_all_gather": functools.partial(_set_collective, "all_gather"),
    "custom_reduce_scatter": functools.partial(_set_collective, "reduce_scatter"),
    "requires_sync": engine.set_unit_gradient_sync,
    "requires_all_reduce": engine.set_unit_all_reduce,
}


def _this_and_below(module: nn.Module, recurse: bool) -> list:
    """The fully_shard-ed modules a per-module setter acts on: `module`, and with `recurse`
    every one below it, as FSDP2's setters."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)] if recurse else [module]


def _names(modules) -> Shown:
    return Shown("[" + ", ".join(type(m).__name__ for m in modules) + "]")


def _set_on_unit(module: nn.Module, setting: str, value) -> None:
    """Record a per-module setting on its call and apply it to its unit if the engine's
    runtime is built already (see FullyShardCall.unit_settings)."""
    _call_of(module).unit_settings[setting] = value
    sharded = _root_sharded(module)
    if sharded is not None:
        _UNIT_SETTERS[setting](sharded, _path_in_root(module, sharded), value)


def _apply_unit_settings(sharded, calls) -> None:
    for path, call in calls:
        for setting, value in call.unit_settings.items():
            _UNIT_SETTERS[setting](sharded, path, value)


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
    return [(paths[id(m)], m) for m in post_order(root) if _call_of(m) is not None]


def _lazy_init(module: nn.Module) -> None:
    """Shard the model rooted at `module` unless it already is (see [Note: lazy application])."""
    if _building():
        return
    call: FullyShardCall = _call_of(module)
    if call.root_of is not None and call.root_of() is not None:
        root = call.root_of()
        if engine.get_sharded(root) is not None:
            return
    # A wrapper of another dialect put inside since the fully_shard calls is refused too, and
    # torch's FSDP1 around it (it runs no code of ours until this first forward).
    refuse_other_dialects(T.FRONTEND, module)
    refuse_torch_fsdp1_around(T.FRONTEND, module)
    _BUILDING.active = True
    try:
        below = _fully_sharded_below(module)
        for _, sub in below:  # release submodules that were sharded as roots of their own
            sub_sharded = engine.get_sharded(sub)
            if sub_sharded is not None and sub is not module:
                engine.release(sub_sharded)
        _refuse_ties_across_calls(module, below)
        _restore_ties(module)
        calls = [(path, _call_of(sub)) for path, sub in below]
        _retie(calls)
        _check_materialised(module, below)
        _attach_forms(module)
        plan, topology = T.build_plan(module, calls)
        sharded = engine.shard_model(module, plan, shard_group=topology.shard_group,
                                     replicate_group=topology.replicate_group)
        _apply_unit_settings(sharded, calls)
        _hook_list_call_modules(sharded, below)
        ref = weakref.ref(module)
        for _, call_ in calls:
            call_.root_of = ref
    finally:
        _BUILDING.active = False


def _hook_list_call_modules(sharded, below) -> None:
    """The modules of a list call share their enclosing unit's groups; each still gathers them
    when called on its own, as under FSDP2 (see [Note: a module run on its own])."""
    unit_paths = {unit.name for unit in sharded.units}
    for path, member in below:
        if len(_call_of(member).modules) > 1 and path not in unit_paths:
            engine.hook_module_inside(sharded, path, member)


def _check_materialised(root: nn.Module, below) -> None:
    """Parameters still on meta when the model is first used were never initialised (no
    `to_empty()` + init, no `load_state_dict(assign=True)`): refuse, as FSDP2 does, rather than
    train on values nobody chose. As FSDP2, the error names the parameters of the first
    fully_shard call, in the model's module order (the root first), that has any; each call
    manages what its modules hold outside inner calls. `below` as `_fully_sharded_below`."""
    names = {id(param): name for name, param in root.named_parameters()}
    claimed: set[int] = set()
    managed = {}
    for _, module in below:  # inner calls first
        call = _call_of(module)
        mine = [p for m in call.modules for p in m.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        managed.setdefault(id(call), mine)
    for module in root.modules():
        call = _call_of(module)
        on_meta = [names[id(p)] for p in managed.get(id(call), ()) if id(p) in names
                   and isinstance(p, DTensor) and p.to_local().is_meta] if call else []
        if on_meta:
            raise RuntimeError(
                "fully_shard: FSDP parameters should be materialized from meta device before "
                f"training, but the following were still on meta device: {on_meta}\n"
                "Materialise and initialise them before the first forward (or unshard()), "
                "e.g. model.to_empty(device=device) then reset_parameters() on each module, "
                "or load_state_dict(full_state, assign=True).")


def _building() -> bool:
    return getattr(_BUILDING, "active", False)


# Building the runtime is plain Python over the model's tensors, once: under torch.compile it
# runs eagerly (tracing it would fake the parameters it re-points at the engine's shards).
@torch.compiler.disable
def _lazy_init_hook(module, args, kwargs):
    if _building():
        return None
    already = _root_sharded(module) is not None
    if already:
        return None
    _lazy_init(module)
    # The engine's own pre-forward hook was registered during this call: run it now.
    sharded = engine.get_sharded(module)
    return engine.run_pre_forward(sharded, "", args, kwargs)


_CLASS_CACHE: dict[type, type] = {}


def _refuse_deepcopy(module: nn.Module, memo: dict):
    """As FSDP2 (whose words these are): a sharded module's parameters are pieces of flat
    groups shared with the rest of its model, which a copy would not be part of."""
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for "
                         "serialization (fully_shard-ed modules cannot be copied: copy the "
                         "model before fully_shard, or build a new one and load a state dict).")


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                       {"__deepcopy__": _refuse_deepcopy})
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
        refuse_other_dialects(T.FRONTEND, m)
        if _already_in_use(m):
            raise T.bad("module", m, "a module whose model has not run yet: the sharding is "
                        "fixed at the model's first forward (or unshard()), for the fully_shard "
                        "calls made until then, and this module's model has already run",
                        "Call fully_shard on every module before the first forward.")
        if _call_of(m) is not None:
            raise T.bad("module", m, "a module not fully_shard-ed yet",
                        "Each distinct composable distributed API can only be applied to a "
                        "module once (FSDP2's words). Call fully_shard once per module.",
                        exc=T.AssertedByFsdp2)
    _check_one_dtype(modules, mp_policy, ignored_params or ())
    mesh = mesh if mesh is not None else _default_mesh()
    spmd = None
    if dp_mesh_dims is not None:  # see [Note: SPMD meshes]
        spmd = (mesh, dp_mesh_dims)
        mesh = T.dp_mesh_of(mesh, dp_mesh_dims)
    call = FullyShardCall(
        modules=tuple(modules),
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=frozenset(ignored_params or ()),
        replicates_only=spmd is not None and not dp_mesh_dims.shard_names,
    )
    # A parameter refused halfway (a scalar, a non-contiguous one) leaves nothing converted.
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(engine.restored_on_failure(m))
        mesh_infos: dict = {}
        _to_dtensor_params(modules, mesh, ignored_params or (), shard_placement_fn, call,
                           _shard_device(mesh, offload_policy), spmd, mesh_infos)
        call.param_groups = max(len(mesh_infos), 1)
        _check_reshard_int_per_mesh(reshard_after_forward, mesh_infos)
        for m in modules:
            object.__setattr__(m, CONFIG, call)
            _register_as_fully_shard(m)
            _swap_class(m)
            m.register_forward_pre_hook(_lazy_init_hook, with_kwargs=True, prepend=True)
            _cast_like_fsdp2(m, mp_policy, inputs=len(modules) > 1)
    return module


def _check_reshard_int_per_mesh(reshard_after_forward, mesh_infos: dict) -> None:
    """An int `reshard_after_forward` must divide the shard size of every mesh the call's
    parameters are sharded over, as FSDP2 checks each parameter group's (the call's own mesh
    is checked with the call)."""
    if isinstance(reshard_after_forward, bool) or not isinstance(reshard_after_forward, int):
        return
    for info in mesh_infos.values():
        if info is None:
            continue
        size = info.mesh.size(info.shard_mesh_dim)
        if size % reshard_after_forward:
            raise T.bad("reshard_after_forward", reshard_after_forward, f"an int >= 1 "
                        f"dividing the shard size {size} of every mesh the call shards over",
                        "If passing reshard_after_forward as an int, it should be a factor of "
                        f"{size}, not {reshard_after_forward} (FSDP2's words).")


def _register_as_fully_shard(module: nn.Module) -> None:
    """[Note: composable registry] torch's composable APIs mark the modules they manage in a
    registry on the module; `replicate()` skips the parameters of modules marked
    "fully_shard" (DDP-style replication around FSDP units) and would otherwise turn our
    DTensor parameters into plain tensors. Mark ours as FSDP2 marks its own."""
    registry = module.__dict__.setdefault(REGISTRY_KEY,
                                          collections.OrderedDict())
    registry.setdefault("fully_shard", RegistryItem())


def _cast_like_fsdp2(module: nn.Module, policy: MixedPrecisionPolicy, inputs: bool) -> None:
    """FSDP2 casts each fully_shard-ed module's outputs to `output_dtype` in a forward hook
    registered by fully_shard itself: one here too, so that hooks the user registers later
    see the cast outputs, as natively. `inputs`: a module of a list call, which runs inside
    the unit that gathers it, also gets FSDP2's cast of its inputs (the engine casts the
    inputs of units)."""
    # Eager, as FSDP2's own casts (see [Note: hooks outside the compiler] in engine/runtime.py).
    if inputs and policy.param_dtype is not None and policy.cast_forward_inputs:
        dtype = policy.param_dtype
        module.register_forward_pre_hook(torch.compiler.disable(
            lambda _, args, kwargs: cast_floating((args, kwargs), dtype)), with_kwargs=True)
    if policy.output_dtype is not None:
        out_dtype = policy.output_dtype
        module.register_forward_hook(torch.compiler.disable(
            lambda _, args, output: cast_floating(output, out_dtype)))


def _state(module: nn.Module) -> Optional[FullyShardCall]:
    """`fully_shard.state(module)`: what the fully_shard call that manages `module` recorded
    (its modules, mesh and policies), or None for a module no call was made on. FSDP2 returns
    its private FSDPState here; code that goes on to read that state's private members (its
    param groups, `_state_ctx`) has no counterpart in this engine."""
    return _call_of(module)


fully_shard.state = _state  # type: ignore[attr-defined]  # as FSDP2's contract decorator adds


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


# -- DTensor parameters ---------------------------------------------------------------------------


def _default_mesh() -> DeviceMesh:
    """FSDP2's default: one dimension over every rank, on the machine's accelerator when it has
    one (whatever the process group's backend: gloo carries CUDA tensors too), else the CPU."""
    if not dist.is_initialized():
        raise T.bad("mesh", None, "a DeviceMesh, or None once torch.distributed is initialised",
                    "Call torch.distributed.init_process_group() before fully_shard.",
                    exc=RuntimeError)
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device_type = accelerator.type if accelerator is not None else "cpu"
    # The key holds the group itself, so that a group torn down and replaced by a new one (at
    # the same address) never finds the old group's mesh.
    key = (device_type, dist.group.WORLD)
    if key not in _DEFAULT_MESHES:
        _DEFAULT_MESHES[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _DEFAULT_MESHES[key]


def _shard_device(mesh: DeviceMesh, offload_policy) -> Optional[torch.device]:
    """Where the shards of parameters built on the CPU go: as FSDP2, the mesh's accelerator
    (its current device), so that a model a framework built on the CPU and hands over (HF
    Trainer, Lightning, accelerate) trains there. None: they stay where they are (a CPU mesh,
    or CPUOffloadPolicy, which keeps shards on the host)."""
    if mesh.device_type == "cpu" or isinstance(offload_policy, CPUOffloadPolicy):
        return None
    backend = getattr(torch, mesh.device_type, None)  # torch.cuda, torch.xpu, ...
    index = backend.current_device() if hasattr(backend, "current_device") else None
    return torch.device(mesh.device_type, index)


def _to_dtensor_params(modules, mesh: DeviceMesh, ignored_params, shard_placement_fn,
                       call: FullyShardCall, device: Optional[torch.device] = None, spmd=None,
                       mesh_infos: Optional[dict] = None) -> None:
    """Replace every parameter this call manages by a DTensor parameter split over the mesh
    (see [Note: sharding at fully_shard time]), and record on its owner modules the form it
    gathers into (see [Note: gathered form] in fsdp_bridge/engine/layout.py). Parameters tied
    to modules outside the call are re-tied when the root is built (`_restore_ties`); ties
    inside the call are appended to `call.ties` (see `_retie`), ties to a parameter an earlier
    call manages to `call.shared_with_earlier` (see [Note: ties across calls]). `mesh_infos` collects the call's
    parameter groups (see _data_parallel_mesh)."""
    ignored = {id(p) for p in ignored_params}
    converted: dict[int, tuple[nn.Parameter, GatheredForm]] = {}
    first_owner: dict[int, tuple[nn.Module, str]] = {}
    for module in modules:
        for owner_name, owner in module.named_modules():
            for attr, param in list(owner._parameters.items()):
                if param is None or id(param) in ignored or getattr(param, SHARDED, False):
                    continue
                if id(param) not in converted:
                    name = f"{owner_name}.{attr}" if owner_name else attr
                    earlier = getattr(param, REPLACED_BY, None)
                    converted[id(param)] = _sharded(param, name, mesh, shard_placement_fn, device,
                                                    spmd, mesh_infos)
                    if earlier is not None:
                        call.shared_with_earlier.append((owner, attr, earlier))
                    else:
                        setattr(param, REPLACED_BY, converted[id(param)][0])
                        mark_replaced(param, name)
                    first_owner[id(param)] = (owner, attr)
                else:
                    call.ties.append((owner, attr, *first_owner[id(param)]))
                new, form = converted[id(param)]
                owner._parameters[attr] = new
                _forms_of(owner)[attr] = form


def _forms_of(owner: nn.Module) -> dict:
    """{attribute: GatheredForm} of the parameters fully_shard made on `owner`. Kept on the
    module: torch's `to_empty()` and `load_state_dict(assign=True)` give parameters new
    attribute dicts, so the forms are attached to them only when the engine is built."""
    _convert_loads_of(owner)
    return getattr(owner, FORMS)


def _attach_forms(root: nn.Module) -> None:
    for owner in root.modules():
        for attr, form in getattr(owner, FORMS, {}).items():
            param = owner._parameters.get(attr)
            if param is not None:
                setattr(param, GATHERED_FORM, form)


def _sharded(param: nn.Parameter, name: str, mesh: DeviceMesh, shard_placement_fn, device=None,
             spmd=None, mesh_infos: Optional[dict] = None):
    """(the DTensor parameter replacing `param`, its GatheredForm). A tensor subclass (FSDP2's
    all-gather extension point) stays one: its row chunk is cut by its own operations, as
    FSDP2 cuts it, and the engine runs its hooks (see [Note: all-gather extensions] in
    fsdp_bridge/engine/extension_group.py). `mesh_infos`: see _data_parallel_mesh."""
    placement, mesh_info = T.resolve_placement(shard_placement_fn, param)
    own_mesh = _data_parallel_mesh(mesh_info, mesh, shard_placement_fn, name,
                                   {} if mesh_infos is None else mesh_infos)
    target = own_mesh if own_mesh is not None else mesh
    if mesh_info is not None:  # the parameter's own mesh info says whether it is SPMD
        spmd = T.spmd_of_info(mesh_info, param)
    if spmd is not None:
        new, form = _sharded_spmd(param, name, *spmd, target, shard_placement_fn, placement)
    elif isinstance(param, DTensor):
        new, form = _sharded_tensor_parallel(param, name, target, shard_placement_fn, placement)
    else:
        dim = T.shard_dim(shard_placement_fn, placement, param, name, tuple(param.shape),
                          target.size(-1))
        new, form = _row_sharded(param, name, target, dim, device), GatheredForm(param.shape, dim)
    if own_mesh is not None:
        form = dataclasses.replace(form, shard_mesh=own_mesh)
    return new, form


def _data_parallel_mesh(mesh_info, call_mesh: DeviceMesh, shard_placement_fn, name: str,
                        mesh_infos: dict) -> Optional[DeviceMesh]:
    """The mesh a parameter whose `shard_placement_fn` result names `mesh_info` (a
    ShardPlacementResult's) is sharded over, when its groups are not the call's; None
    otherwise (see [Note: groups over other meshes] in fsdp_bridge/engine/layout.py).

    `mesh_infos` maps the (shard, replicate) groups of the call's parameters to the mesh info
    that named them (None: the call's own), as FSDP2 groups them: two mesh infos over the same
    groups are refused with FSDP2's error, and its size is the call's parameter group count."""
    mesh = call_mesh if mesh_info is None else T.mesh_of_info(mesh_info, shard_placement_fn,
                                                                name)
    key = T.groups_of(mesh)
    if mesh_infos.setdefault(key, mesh_info) is not mesh_info:
        raise T.bad("shard_placement_fn", shard_placement_fn, "one mesh info object per "
                    f"process group (it returned {mesh_info!r} for {name!r}, whose groups "
                    f"another parameter's {mesh_infos[key]!r} already names)", "Params "
                    "sharing the same process group must use the same FSDPMeshInfo object "
                    "(FSDP2's words): return the same FSDPMeshInfo for all of them.")
    if key == T.groups_of(call_mesh):
        return None
    return mesh


def _refuse_ties_across_calls(root: nn.Module, below) -> None:
    """[Note: ties across calls] A parameter tied between the modules of two fully_shard
    calls is sharded by each call, as two parameters that would train apart. As FSDP2, each
    call shards it (so the modules hold what they hold natively until then) and the model's
    first forward (or unshard()) refuses it, in FSDP2's words, when both calls are in the
    model being built. `below` as `_fully_sharded_below`."""
    held = {id(p): name for name, p in root.named_parameters(remove_duplicate=False)}
    for _, module in below:
        for owner, attr, earlier in _call_of(module).shared_with_earlier:
            param = owner._parameters.get(attr)
            if param is not None and id(param) in held and id(earlier) in held:
                raise ValueError(
                    f"Parameter '{held[id(param)]}' is shared with a parameter already managed "
                    "by another FSDP group. For shared/tied parameters, use "
                    "fully_shard([module_a, module_b]) to place them in the same FSDP group "
                    "(FSDP2's words), or shard them in their common parent's call.")


def _check_one_dtype(modules, mp_policy: MixedPrecisionPolicy, ignored_params) -> None:
    """Without a param_dtype, one call's trainable parameters must share a dtype (FSDP2
    refuses mixed dtypes too: their gradients are reduced as one buffer). Frozen parameters
    may differ (an fp8 frozen weight beside fp32 trainable ones), as natively: the engine
    groups them by dtype."""
    if mp_policy.param_dtype is not None:
        return
    ignored = {id(p) for p in ignored_params}
    dtypes = {}
    for module in modules:
        for name, param in module.named_parameters():
            if (id(param) not in ignored and not getattr(param, SHARDED, False)
                    and param.requires_grad):
                dtypes.setdefault(param.dtype, name)
    if len(dtypes) > 1:
        found = ", ".join(f"{dtype} ({name!r})" for dtype, name in dtypes.items())
        raise T.bad("module", f"trainable parameters of several dtypes: {found}",
                    "trainable parameters of one dtype per fully_shard call", "Cast the module "
                    "to one dtype, or set mp_policy=MixedPrecisionPolicy(param_dtype=...).")


def _placements(mesh: DeviceMesh, shard) -> tuple:
    """FSDP2's data-parallel placements over `mesh` (1-D: FSDP; 2-D: HSDP, replicate first),
    the shard dimension's being `shard` (a Shard, or a _StridedShard under tensor parallelism)."""
    return (shard,) if mesh.ndim == 1 else (Replicate(), shard)


def _sharded_tensor_parallel(param: DTensor, name: str, mesh: DeviceMesh, shard_placement_fn,
                             placement):
    """[Note: FSDP over tensor parallelism] A parameter `parallelize_module` made a DTensor on
    a tensor-parallel mesh: the data-parallel mesh's shard dimension splits this rank's local
    part of it, and the result is a DTensor on the meshes together (data-parallel dims first,
    HSDP's replicate dimension before its shard one) with the placements FSDP2 gives it, so its
    full value, state dict and checkpoints are FSDP2's. Gathered over the shard group, it is
    the tensor-parallel DTensor again; under HSDP its gradient is then all-reduced over the
    replicate group, as any HSDP gradient."""
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim not in (1, 2) or tp_mesh.ndim != 1 or any(p.is_partial()
                                                             for p in tp_placements):
        raise T.bad(f"parameter {name!r}", f"a DTensor on mesh {tp_mesh} with placements "
                    f"{tp_placements}, sharded over mesh {mesh}", "a DTensor on a 1-D "
                    "tensor-parallel mesh (Shard or Replicate), sharded over a 1-D "
                    "data-parallel mesh (FSDP) or a 2-D (replicate, shard) one (HSDP) of the "
                    "same device mesh", "Pass mesh=world_mesh['dp'] (or mesh=world_mesh["
                    "'dp_replicate', 'dp_shard']) after parallelize_module(model, "
                    "world_mesh['tp'], plan).")
    try:
        spmd_mesh = DeviceMesh._concatenate([mesh, tp_mesh])
    except Exception as error:  # noqa: BLE001 - reported with the fix
        raise T.bad("mesh", mesh, f"the data-parallel dimensions of the device mesh whose last "
                    f"dimension is parameter {name!r}'s tensor-parallel mesh {tp_mesh}",
                    "Slice both from one mesh: init_device_mesh(..., mesh_dim_names=('dp', "
                    f"'tp')), then mesh['dp'] and mesh['tp'] ({error}).") from error
    local = param.to_local().detach()
    shard = mesh.ndim - 1
    dim = T.shard_dim(shard_placement_fn, placement, param, name, tuple(local.shape),
                      mesh.size(shard))
    start, rows = chunk_rows(local.shape[dim], mesh.size(shard), mesh.get_local_rank(shard))
    chunk = local.narrow(dim, start, rows)
    if not chunk.is_meta:
        chunk = chunk.clone(memory_format=torch.contiguous_format)
    # The data-parallel split of a dim tensor parallelism already splits is strided: each
    # rank's rows are a slice of every tensor-parallel chunk (FSDP2's _StridedShard).
    splits = math.prod(tp_mesh.size(0) for p in tp_placements if p.is_shard(dim))
    dp_placement = _StridedShard(dim, split_factor=splits) if splits > 1 else Shard(dim)
    dtensor = DTensor.from_local(chunk, spmd_mesh, (*_placements(mesh, dp_placement),
                                                    *tp_placements),
                                 run_check=False, shape=param.shape, stride=param.stride())
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    setattr(new, SHARDED, True)
    setattr(new, FLATTENED_MARK, True)  # torch's FSDP1 leaves it to us: see the engine's note
    form = GatheredForm(local.shape, dim, tp_mesh, tp_placements, param.shape, param.stride())
    return new, form


def _sharded_spmd(param: nn.Parameter, name: str, spmd_mesh: DeviceMesh, dp_mesh_dims,
                  dp_mesh: DeviceMesh, shard_placement_fn, placement):
    """[Note: SPMD meshes] With `dp_mesh_dims` (torch >= 2.12; torchtitan's SPMD backend)
    every parameter is already a DTensor on the whole SPMD mesh, Replicate on its data-parallel
    dimensions. As FSDP2, the shard group (`dp_mesh`'s last dimension: the shard dimensions,
    flattened into one when several are named) splits this rank's local tensor, and each shard
    dimension's placement becomes Shard(d) (_StridedShard(d) when a later mesh dimension splits
    d too). The parameter stays on the SPMD mesh, or, with several shard dimensions, on FSDP2's
    mesh with their flattening in their place (after the replicate dimension under HSDP).
    With replication alone (DDP) nothing is split: the parameter keeps its placements and its
    gradient is all-reduced over the replicate group. Modules compute with the DTensor the
    parameter was, its gradient's Partial data-parallel part reduced by the engine."""
    names = spmd_mesh.mesh_dim_names
    if not isinstance(param, DTensor) or param.device_mesh != spmd_mesh:
        got = (f"a DTensor on mesh {param.device_mesh}" if isinstance(param, DTensor)
               else "a plain tensor")
        raise T.bad(f"parameter {name!r}", got, f"a DTensor on the SPMD mesh {spmd_mesh} "
                    "given to fully_shard", "When dp_mesh_dims is provided, all parameters "
                    "must be DTensors on the full SPMD mesh (e.g. via distribute_module) "
                    "(FSDP2's words).")
    placements = tuple(param.placements)
    shard_dims = tuple(names.index(n) for n in dp_mesh_dims.shard_names)
    dp_dims = shard_dims + tuple(names.index(n) for n in dp_mesh_dims.replicate_names)
    for index in dp_dims:
        if not placements[index].is_replicate():
            raise T.bad(f"parameter {name!r}", f"a DTensor with placements {placements}",
                        "Replicate() on every data-parallel dimension", f"Expected Replicate() "
                        f"on DP dim '{names[index]}' (index {index}) but got "
                        f"{placements[index]} (FSDP2's words).")
    local = param.to_local().detach()
    shard = dp_mesh.ndim - 1
    ranks, rank = ((dp_mesh.size(shard), dp_mesh.get_local_rank(shard)) if shard_dims
                   else (1, 0))
    dim = T.shard_dim(shard_placement_fn, placement, param, name, tuple(local.shape), ranks)
    start, rows = chunk_rows(local.shape[dim], ranks, rank)
    chunk = local.narrow(dim, start, rows)
    if not chunk.is_meta:
        chunk = chunk.clone(memory_format=torch.contiguous_format)
    new_placements = list(placements)
    for index in shard_dims:
        splits = math.prod(spmd_mesh.size(j) for j in range(index + 1, spmd_mesh.ndim)
                           if isinstance(placements[j], (Shard, _StridedShard))
                           and placements[j].dim == dim)
        new_placements[index] = _StridedShard(dim, split_factor=splits) if splits > 1 \
            else Shard(dim)
    mesh, new_placements = _flattened_shard_dims(spmd_mesh, dp_mesh_dims, dp_mesh,
                                                 new_placements)
    dtensor = DTensor.from_local(chunk, mesh, new_placements, run_check=False,
                                 shape=param.shape, stride=param.stride())
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    setattr(new, SHARDED, True)
    setattr(new, FLATTENED_MARK, True)
    form = GatheredForm(local.shape, dim, spmd_mesh, placements, param.shape, param.stride(),
                        data_parallel_dims=dp_dims)
    return new, form


def _flattened_shard_dims(spmd_mesh: DeviceMesh, dp_mesh_dims, dp_mesh: DeviceMesh,
                          placements: list) -> tuple:
    """(mesh, placements) of a sharded SPMD parameter, as FSDP2 lays it out: the SPMD mesh
    with one shard dimension; with several (consecutive, see check_dp_mesh_dims), `dp_mesh`
    in their place (its flattened shard dimension, after the replicate one under HSDP, whose
    own dimensions then go) and the other dimensions as they are."""
    shard_names = dp_mesh_dims.shard_names
    if len(shard_names) <= 1:
        return spmd_mesh, tuple(placements)
    hsdp = bool(dp_mesh_dims.replicate_names)
    meshes, out = [], []
    for index, name in enumerate(spmd_mesh.mesh_dim_names):
        if name == shard_names[0]:
            meshes.append(dp_mesh)
            out.extend((Replicate(), placements[index]) if hsdp else (placements[index],))
        elif name not in shard_names and name not in dp_mesh_dims.replicate_names:
            meshes.append(spmd_mesh[name])
            out.append(placements[index])
    return DeviceMesh._concatenate(meshes), tuple(out)


def _row_sharded(param: nn.Parameter, name: str, mesh: DeviceMesh, dim: int,
                 device: Optional[torch.device] = None) -> nn.Parameter:
    # FSDP2's own words are kept in each message, for code that matches them.
    if param.dim() == 0:
        raise T.bad(f"parameter {name!r}", "a scalar (shape ())", "parameters of at least one "
                    "dimension (they are split by rows)", f"fully_shard doesn't support scalar "
                    f"parameters. Change {name} to a 1D tensor with numel equal to 1. (Or pass "
                    "it in ignored_params.)")
    if not param.is_contiguous():
        raise T.bad(f"parameter {name!r}", f"a non-contiguous tensor of shape "
                    f"{tuple(param.shape)}, strides {param.stride()}", "contiguous parameters",
                    "FSDP does not support non-contiguous parameters yet: make the parameter "
                    "contiguous before fully_shard (e.g. a channels_last Conv2d: "
                    "module.to(memory_format=torch.contiguous_format)).",
                    exc=NotImplementedError)
    shard_dim = mesh.ndim - 1
    ranks, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    start, rows = chunk_rows(param.shape[dim], ranks, rank)
    if type(param.data) is not torch.Tensor and rows > 0 and not param.is_meta:
        # A tensor subclass (FSDP2's all-gather extension) is cut and copied by its own
        # operations, as FSDP2 cuts it: NF4 has no arbitrary slices, and its clone quantises
        # again (new values), where new_zeros + copy_ copies its blocks.
        chunk = torch.chunk(param.detach(), ranks, dim=dim)[rank]
        with torch.no_grad():
            local = chunk.new_zeros(chunk.shape)
            local.copy_(chunk)
        local = local.to(device) if device is not None and local.device.type == "cpu" \
            else local
    else:
        local = _plain_chunk(param, dim, start, rows, device)
    dtensor = DTensor.from_local(local, mesh, _placements(mesh, Shard(dim)), run_check=False,
                                 shape=param.shape, stride=param.stride())
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    setattr(new, SHARDED, True)
    setattr(new, FLATTENED_MARK, True)  # torch's FSDP1 leaves it to us: see the engine's note
    return new


def _plain_chunk(param: nn.Parameter, dim: int, start: int, rows: int,
                 device: Optional[torch.device]) -> torch.Tensor:
    local = param.detach().narrow(dim, start, rows)
    if not local.is_meta:
        # A contiguous storage of its own: the full tensor can be freed.
        local = local.clone(memory_format=torch.contiguous_format)
        if device is not None and local.device.type == "cpu":
            local = local.to(device)
    return local


def _restore_ties(root: nn.Module) -> None:
    """A parameter shared with a module outside its fully_shard call is still the original
    there: point that module at the DTensor too, so the tie holds."""
    for owner in root.modules():
        for attr, param in list(owner._parameters.items()):
            replacement = getattr(param, REPLACED_BY, None) if param is not None else None
            if replacement is not None:
                owner._parameters[attr] = replacement
                _convert_loads_of(owner)


def _retie(calls) -> None:
    """[Note: ties after loading] `load_state_dict(assign=True)` (the rank-0 broadcast recipe
    for meta init) assigns each key a parameter of its own, so a tied embedding and output
    weight come apart. As FSDP2, which sets a shared parameter on every module that held it
    whenever it unshards, every module of a tie is pointed back at the parameter its first
    module (in `named_modules()` order) holds now."""
    unique = {id(call): call for _, call in calls}  # a list call's modules share one call
    for call in unique.values():
        for owner, attr, first, first_attr in call.ties:
            current = first._parameters.get(first_attr)
            if current is not None and owner._parameters.get(attr) is not current:
                owner._parameters[attr] = current


def _convert_loads_of(owner: nn.Module) -> None:
    if hasattr(owner, FORMS):
        return
    owner.register_state_dict_pre_hook(_sharded_before_state_dict)
    owner.register_load_state_dict_pre_hook(_to_param_layouts)
    owner.register_load_state_dict_post_hook(_mark_assigned)
    object.__setattr__(owner, FORMS, {})


def _sharded_before_state_dict(module, prefix, keep_vars) -> None:
    engine.register_sharded(module)


def _to_param_layouts(module, state_dict, prefix, *args) -> None:
    """Load pre-hook: give each value for a DTensor parameter the parameter's layout."""
    engine.register_sharded(module)
    for attr, param in module._parameters.items():
        key = prefix + attr
        if key in state_dict and isinstance(param, DTensor):
            state_dict[key] = _in_layout_of(param, key, state_dict[key])


def _mark_assigned(module, incompatible_keys) -> None:
    # load_state_dict(assign=True) put new Parameter objects in place: they are ours too.
    for param in module._parameters.values():
        if isinstance(param, DTensor):
            setattr(param, SHARDED, True)


def _in_layout_of(param: DTensor, key: str, value):
    """`value` (a full tensor, or a DTensor of any layout on the parameter's mesh) as a
    DTensor laid out as `param`."""
    if not isinstance(value, torch.Tensor):
        return value  # torch's own loader reports it
    if tuple(value.shape) != tuple(param.shape):
        raise T.bad(f"state_dict[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                    f"shape {tuple(param.shape)} (the parameter's full shape)",
                    "Load a state dict of the same model.")
    if isinstance(value, DTensor):
        if value.device_mesh != param.device_mesh:
            raise T.bad(f"state_dict[{key!r}]", f"a DTensor on mesh {value.device_mesh}",
                        f"a full tensor, or a DTensor on the parameter's mesh "
                        f"{param.device_mesh}", "Call .full_tensor() on it first, or "
                        "distribute it over param.device_mesh.")
        if tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        return value
    # Every rank cuts its own part of the full value: no communication.
    return distribute_tensor(value.detach().to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)
