"""The engine at run time: hooks that gather before a unit runs, reduce after its backward,
and finish the step once the whole backward is done.

Order of events in one training step (ZeRO-3, units u0..u3 inside the root):

    root pre-forward   every gathered copy is marked stale (the optimizer moved the masters),
                       the root unit is gathered
    ui pre-forward     wait for ui's gather, install its views, prefetch u(i+1)
    ui post-forward    remove the views and free ui's gathered weights (the last unit's too)
    ui pre-backward    (hook on ui's outputs) wait for ui's gather, or gather it now; on CUDA
                       prefetch u(i-1) (see [Note: backward prefetch per device])
    ui post-backward   (Unflatten.backward) free ui's weights, prefetch u(i-1) (on the CPU, or
                       where the pre-backward could not), lay out the gradient and start its
                       reduction
    end of backward    finish the reductions; on the last micro-step divide once and expose
                       .grad; every gathered copy, the root's included, is freed
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_leaves

from fsdp_bridge.engine import init as engine_init
from fsdp_bridge.engine.autograd import Unflatten
from fsdp_bridge.engine.buffers import GatherBuffer
from fsdp_bridge.engine.casting import cast_floating
from fsdp_bridge.engine.comm import Comm
from fsdp_bridge.engine.device import (
    BackwardPrefetch,
    default_backward_prefetch,
    has_streams,
    select_device,
)
from fsdp_bridge.engine.extension_group import ExtensionGroup
from fsdp_bridge.engine.flat_group import FlatGroup, local_part
from fsdp_bridge.engine.layout import assign_groups, describe_layout, split_untied
from fsdp_bridge.engine.norms import clip_coefficient, fsdp1_grad_norm, scale_
from fsdp_bridge.engine.offload import GradOffload
from fsdp_bridge.engine.row_group import RowGroup
from fsdp_bridge.plan import MixedPrecision, ParamLayout, Plan, UnitSpec

if TYPE_CHECKING:
    from fsdp_bridge.engine.rollback import WrapRecord


class StepPhase(enum.Enum):
    """Where the model is in a training step, as the engine's hooks see it."""

    # From the end of one backward to the first backward hook of the next: forward, the
    # optimizer step, evaluation.
    FORWARD = "forward"
    # From the first backward hook (which queues the end-of-backward callback) to that
    # callback. A forward run in this phase is an activation-checkpoint recomputation.
    BACKWARD = "backward"


@dataclasses.dataclass
class PendingReduce:
    group: FlatGroup
    work: Any  # a c10d work handle or its future, or None when nothing was communicated
    output: Optional[torch.Tensor]
    # What the reduction reads from (the full gradient, or for a pair the other rank's part
    # of it), dropped once done.
    source: Optional[torch.Tensor]
    landed: bool = False  # added to the gradient shard by the collective's thread
    # Hybrid sharding: the replicate all-reduce of `output`, once started (see [Note: replica
    # all-reduce off the critical path]).
    replica_work: Any = None


class WrapStart(enum.Enum):
    """Where a unit's parameters were when the wrap reached it (what its init allocated)."""

    META = "meta"  # materialised by the wrap, on the engine's device
    REAL = "real"  # real on the engine's device; freed once sharded
    KEPT = "kept"  # real, kept until the wrap ends (sync_module_states, ranks other than 0)
    MOVED = "moved"  # on another device; copied to the engine's as they were flattened


@dataclasses.dataclass(frozen=True)
class UnitInit:
    """How a unit came to be sharded, for the wrap's memory estimate."""

    name: str
    start: WrapStart


class Unit:
    """A module named in the Plan, with the flat groups of the parameters it owns."""

    def __init__(self, spec: UnitSpec, module: nn.Module, groups: list[FlatGroup], is_root: bool,
                 plan_precision: MixedPrecision):
        self.name = spec.name
        self.mp = spec.mixed_precision or plan_precision
        self.module = module
        self.groups = groups
        self.is_root = is_root
        # The root is not resharded after forward unless asked: backward starts with it.
        self.reshard_after_forward = spec.reshard_after_forward and (
            not is_root or spec.reshard_as_root)
        self.in_use = False
        self.forwards = 0  # forwards begun (see [Note: the end of a forward method])
        self.backward_groups_left = 0
        # FSDP2's per-module `set_gradient_divide_factor`; None: the model's divisor.
        self.gradient_divide_factor: Optional[float] = None
        # FSDP2's `set_reduce_scatter_unused_params(True)`: unreached parameters of this unit
        # get a zero gradient even where the plan leaves `.grad` None.
        self.reduce_unused_params = False
        # FSDP2's `set_all_reduce_hook`: called on each reduced shard (see _finish_reduce).
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        # False: this unit's gradients are summed locally, not reduced, until a backward run
        # with True (FSDP1's `no_sync`, FSDP2's `set_requires_gradient_sync`, per module).
        self.requires_sync = True
        # FSDP2's `set_requires_all_reduce` (see [Note: reduce-scattered, not all-reduced]).
        self.requires_all_reduce = True

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [group for group in self.groups if group.requires_grad]


class ShardedModel:
    """The engine's state for one sharded model (attached to it as `_fsdp_bridge`)."""

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        comm: Comm,
        device: torch.device,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        record: Optional["WrapRecord"] = None,
    ):
        self.module = module
        self.plan = plan
        self.comm = comm
        self.device = device
        self.mp = plan.mixed_precision
        self.gradient_divide_factor: Optional[float] = None
        self.micro_step = 0
        self.forward_order: list[Unit] = []
        self.last_forward_order: list[Unit] = []
        self.pending_reduces: list[PendingReduce] = []
        self.phase = StepPhase.FORWARD

        select_device(device)
        self.backward_prefetch = default_backward_prefetch(device)
        # Hybrid sharding's replicate all-reduce runs here, beside compute (see
        # _track_reduce); without streams it starts once the reduce-scatter is done. Not on
        # gloo: a gloo future's `wait()` orders no CUDA stream, so an all-reduce issued on
        # a stream of its own could read the shard before the reduce-scatter wrote it.
        self.replica_stream = (torch.cuda.Stream(device) if has_streams(device)
                               and comm.replicate_size > 1 and comm.shard_size > 1
                               and not comm.wait_on_futures else None)
        self.replica_reduces: list[PendingReduce] = []  # summing over replicas
        # ids of the groups whose gather an explicit unshard started (see _begin_forward).
        self.unsharded_ahead: set[int] = set()
        self.grad_offload = GradOffload(device)
        engine_init.warn_unhonoured_offload(plan, device)
        # The layout is made from the model as given (meta tensors have shapes and dtypes), and
        # every rank agrees on it before the first collective.
        layouts = assign_groups(module, plan)
        engine_init.check_ranks_agree(plan, engine_init.describe_rank(module, device) + "\n"
                                      + describe_layout(layouts), comm, device)
        self.buffer_dtypes: dict[str, torch.dtype] = {}
        self.init_steps: list[UnitInit] = []
        self.mesh_comms: dict = {}  # see _comm_over
        self.units = self._build_units(layouts, param_init_fn, record)
        engine_init.sync_ignored_buffers(module, plan, comm, device)
        self.ignored_params = engine_init.ignored_parameters(module, plan)
        self.unit_of_group = {id(g): unit for unit in self.units for g in unit.groups}
        self._allocate_buffers()
        self._register_hooks()

    # -- construction -------------------------------------------------------------------------

    def _build_units(self, layouts, param_init_fn, record: Optional["WrapRecord"]) -> list[Unit]:
        """Unit by unit, in the Plan's order (see [Note: a unit at a time] in engine/init.py):
        materialise, move, broadcast, flatten and shard one unit, free its full parameters,
        then the next."""
        regions = engine_init.unit_regions(self.module, self.plan.unit_names,
                                            self.plan.ignored_modules)
        to_materialise = engine_init.materialisation_regions(
            self.module, self.plan.unit_names, self.plan.ignored_modules)
        meta_at_start = engine_init.meta_params(regions) if param_init_fn is not None else set()
        ignored = set(self.plan.ignored_params)
        ignored_on_meta = engine_init.ignored_on_meta(self.module, ignored)
        seen_buffers: set[int] = set()
        units: list[Unit] = []
        for spec in self.plan.units:
            region = regions[spec.name]
            materialised, error = engine_init.materialize_region(
                to_materialise[spec.name], self.device, param_init_fn, ignored)
            if materialised and error is None:
                engine_init.warn_broken_ties(split_untied(self.module, layouts, spec.name,
                                                          list(self.plan.unit_names)), self.plan)
            unit_layouts = [layout for layout in layouts if layout.unit_name == spec.name]
            if materialised and meta_at_start and param_init_fn is not None:
                later = [s.name for s in self.plan.units[len(units) + 1:]]
                engine_init.warn_if_reached_beyond(regions, later, meta_at_start, self.plan,
                                                   param_init_fn)
                meta_at_start = set()  # once: a function that reaches beyond does so at once
            for layout in unit_layouts:
                for slot in layout.slots:
                    slot.refresh()
            problem = (engine_init.region_problem(region, param_init_fn, ignored)
                       or engine_init.changed_slots(unit_layouts, param_init_fn)
                       or (self._overwritten_unit(units, spec.name, param_init_fn)
                           if materialised else None))
            slots = [slot for layout in unit_layouts for slot in layout.slots]
            engine_init.agree_on_unit(self.plan, engine_init.describe_unit(spec.name, slots,
                                                                           region),
                                      problem, error, self.comm, self.device)
            engine_init.move_region(region, ignored, self.device)
            self.buffer_dtypes.update(
                engine_init.prepare_region_buffers(region, self.plan, self.comm, seen_buffers))
            start = self._start_of(slots, materialised)
            mp = spec.mixed_precision or self.mp
            groups = [self._build_group(layout, mp, record) for layout in unit_layouts]
            module = self.module.get_submodule(spec.name)
            units.append(Unit(spec, module, groups, spec.name == "", self.mp))
            self.init_steps.append(UnitInit(spec.name, start))
        engine_init.warn_ignored_materialised(self.module, ignored_on_meta, self.plan,
                                              param_init_fn)
        return units

    def _start_of(self, slots, materialised: bool) -> WrapStart:
        if any(slot.param.device != self.device for slot in slots):
            return WrapStart.MOVED
        if materialised:
            return WrapStart.META
        return WrapStart.KEPT if self._keeps_originals else WrapStart.REAL

    @property
    def _keeps_originals(self) -> bool:
        """Whether this rank's original values outlive their sharding until the wrap ends:
        `sync_module_states` overwrites them in the shards of ranks other than the first, so
        a failed wrap could not give them back otherwise."""
        return self.plan.sync_module_states and self.comm.world_rank != 0

    def _build_group(self, layout, mp: MixedPrecision,
                     record: Optional["WrapRecord"]) -> FlatGroup:
        """One flat group, sharded now: its parameters become views of this rank's shard and
        their full tensors are freed (the rollback record lets go of them too)."""
        row_layout = self.plan.param_layout is ParamLayout.ROWS
        group_class = (ExtensionGroup if row_layout and layout.extension
                       else RowGroup if row_layout else FlatGroup)
        group = group_class(
            layout,
            self._comm_over(layout.mesh),
            self.device,
            compute_dtype=mp.param_dtype or layout.dtype,
            reduce_dtype=mp.effective_reduce_dtype(layout.dtype),
            sync_module_states=self.plan.sync_module_states,
            unsynced_grad_sum=self.plan.unsynced_grad_sum,
            rereduce_kept_grad=self.plan.rereduce_kept_grad,
        )
        if isinstance(group, ExtensionGroup):  # the pre-hook's `mp_policy`
            group.mp_policy = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype,
                                                   mp.output_dtype, mp.cast_forward_inputs)
        if self.plan.cpu_offload and not row_layout:
            group.offload_to_host()  # see [Note: CPU offload]
        if record is not None and not row_layout:  # row groups keep DTensor shards: small
            record.release_originals([slot.param for slot in group.slots],
                                     lambda: [value for _, value in
                                              group.split(group.gather_full_master())],
                                     keep=self._keeps_originals)
        return group

    def _comm_over(self, mesh) -> Comm:
        """The collectives of groups sharded over `mesh` (see [Note: groups over other meshes]
        in engine/layout.py): the model's for None; one Comm per other mesh, over its shard
        group (its last dimension) and, for a 2-D mesh, its replicate group, counted in the
        model's collective statistics."""
        if mesh is None:
            return self.comm
        if mesh not in self.mesh_comms:
            comm = Comm(mesh.get_group(mesh.ndim - 1),
                        mesh.get_group(0) if mesh.ndim == 2 else None,
                        self.comm.world_group, self.device.type)
            comm.stats = self.comm.stats
            self.mesh_comms[mesh] = comm
        return self.mesh_comms[mesh]

    @staticmethod
    def _overwritten_unit(done: list[Unit], unit_name: str, param_init_fn) -> Optional[str]:
        """A `param_init_fn` called on a module that contains units sharded already (inner
        units come first) must not give their parameters new storage (`to_empty` with
        `recurse=True`): their shards would no longer be what the model computes with."""
        if param_init_fn is None:
            return None
        for unit in done:
            if not (unit_name == "" or unit.name.startswith(unit_name + ".")):
                continue
            for group in unit.groups:
                master = group.master.untyped_storage().data_ptr()
                for slot in group.slots:
                    if local_part(slot.param).untyped_storage().data_ptr() != master:
                        return (
                            f"param_init_fn {engine_init.function_name(param_init_fn)} gave new "
                            f"storage to parameter {slot.fqn!r} of unit {unit.name!r}, which was "
                            f"already sharded, while unit {unit_name or '<root>'!r} was "
                            "materialised. Units are materialised and sharded one at a time, "
                            "inner units first; the function is called on each module with meta "
                            "tensors of its own and must materialise only that module's own "
                            "tensors, e.g. `lambda m: m.to_empty(device=device, recurse=False)` "
                            "followed by its init.")
        return None

    def _is_leaf(self, unit: Unit) -> bool:
        prefix = unit.name + "."
        return not any(other.name.startswith(prefix) for other in self.units)

    def _allocate_buffers(self) -> None:
        """A gather buffer of its own for every group (see [Note: gather buffers])."""
        self.transient_buffers: list[GatherBuffer] = []
        for unit in self.units:
            for group in unit.groups:
                group.buffer = GatherBuffer(group.padded_numel, group.compute_dtype, self.device)
                group.buffer.release()  # allocated at its first gather
                if unit.reshard_after_forward and self._is_leaf(unit) and group.requires_grad:
                    self.transient_buffers.append(group.buffer)
                else:
                    group.dedicated = True

    def _retype(self, group: FlatGroup) -> None:
        """The model was cast after wrapping (see FlatGroup.adopt_replaced_params): gather
        and reduce in the new master dtype, unless MixedPrecision fixes them."""
        dtype = group.master.dtype
        mp = self.unit_of_group[id(group)].mp
        group.compute_dtype = mp.param_dtype or dtype
        group.reduce_dtype = mp.effective_reduce_dtype(dtype)
        old = group.buffer
        group.buffer = GatherBuffer(group.padded_numel, group.compute_dtype, self.device)
        group.buffer.release()  # allocated at its next gather
        if old in self.transient_buffers:
            self.transient_buffers[self.transient_buffers.index(old)] = group.buffer

    def _register_hooks(self) -> None:
        self.hook_handles = []
        for unit in self.units:
            if not unit.groups and not unit.is_root:
                continue
            self.hook_handles.append(
                unit.module.register_forward_pre_hook(
                    self._make_pre_forward(unit), with_kwargs=True, prepend=True
                )
            )
            self.hook_handles.append(
                unit.module.register_forward_hook(self._make_post_forward(unit))
            )

    def hook_module_inside(self, unit: Unit, module: nn.Module) -> None:
        """Let `module`, inside `unit`'s flat groups (a module of an FSDP2 list call), run on
        its own: see [Note: a module run on its own]."""
        active: list = []

        @torch.compiler.disable  # see [Note: hooks outside the compiler]
        def pre_forward(_module, args, kwargs):
            if unit.in_use:  # inside the unit's own forward or backward: already gathered
                return None
            active.append(True)
            unit.in_use = True
            for group in unit.groups:
                self._ensure_gathered(group)
            self._install_views(unit)
            return None

        @torch.compiler.disable
        def post_forward(_module, args, output):
            if not active:
                return None
            active.pop()
            unit.in_use = False
            if unit.reshard_after_forward:
                self._remove_views(unit)
                self._release_buffers_of(unit)
            self._hook_backward(unit, output)
            return None

        self.hook_handles.append(
            module.register_forward_pre_hook(pre_forward, with_kwargs=True, prepend=True))
        self.hook_handles.append(module.register_forward_hook(post_forward))

    # -- forward ------------------------------------------------------------------------------

    # [Note: a module run on its own] FSDP2 registers its hooks on every module of a list call
    # (`fully_shard([norm, head])`), so `head(chunk)` called by itself after a backward (a
    # chunked loss) gathers the parameters again. Here such modules share their enclosing
    # unit's flat groups; outside that unit's forward their own hooks gather the unit, install
    # its views and hook its backward, without starting a new step (the root's pre-forward
    # would: its gathered copies and forward order belong to the step still under way).

    # [Note: hooks outside the compiler] A module compiled in place (`block.compile(
    # fullgraph=True)`, torchtitan's per-block compile) runs its forward hooks inside the
    # compiled call. The hooks wait on collectives, swap parameters on modules and keep the
    # step's bookkeeping: Python the compiler must not trace (with fullgraph it cannot: it
    # fails on the gather's wait). Every hook the engine registers on a module or a tensor is
    # left to run eagerly, as FSDP2 leaves its own (`_dynamo_disable`); the compiled graph holds
    # the module's own computation only.

    def _make_pre_forward(self, unit: Unit):
        @torch.compiler.disable
        def pre_forward(module, args, kwargs):
            recomputing = self.phase is StepPhase.BACKWARD
            if unit.is_root and not recomputing:
                self._begin_forward()
            unit.in_use = True
            for group in unit.groups:
                self._ensure_gathered(group)
            self._install_views(unit)
            if not recomputing:
                unit.forwards += 1
                self.forward_order.append(unit)
                self._prefetch(self._next_in_forward(unit))
            return self._cast_inputs(unit, args, kwargs)

        return pre_forward

    def _make_post_forward(self, unit: Unit):
        @torch.compiler.disable
        def post_forward(module, args, output):
            # A unit kept gathered after forward (the root) keeps computing with its gathered
            # parameters until the end of backward, as FSDP2 keeps its unsharded parameters
            # registered: a submodule the forward skipped can still be called on its own,
            # and its gradient joins the unit's.
            if unit.reshard_after_forward or self.phase is StepPhase.BACKWARD:
                self._remove_views(unit)
            unit.in_use = False
            # Every unit, the last of forward included, gives its weights back: backward
            # gathers them again, and none sit under the activations of the turn to backward.
            # (A forward run inside backward, an activation-checkpoint recomputation, keeps
            # its weights for the backward that follows it.)
            if unit.reshard_after_forward and self.phase is StepPhase.FORWARD:
                self._release_buffers_of(unit)
            self._hook_backward(unit, output)
            if unit.is_root and self.forward_order:
                # A prefetch for a unit this forward did not run must not hold its weights
                # through the turn to backward.
                self._release_transient_buffers()
                if self.mp.output_dtype is not None:
                    output = cast_floating(output, self.mp.output_dtype)
            return output

        return post_forward

    def _hook_backward(self, unit: Unit, output) -> None:
        """Gather `unit` again before the backward of `output` reaches it."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, self._make_pre_backward(unit), mode="any")

    def _begin_forward(self) -> None:
        # The optimizer may have moved the masters since the last forward: every gathered
        # copy is stale. (Within one forward, a gathered unit is reused across calls.)
        # An explicit unshard since then (FSDP2's `unshard()` ahead of forward) gathered the
        # masters as they are now: its gather, finished or in flight, is the forward's.
        kept, self.unsharded_ahead = self.unsharded_ahead, set()
        for group in self.flat_groups():
            if id(group) in kept:
                group.hide_full()  # the forward installs its own views of the gather
            else:
                group.invalidate()
            if group.adopt_replaced_params():
                self._retype(group)
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order = []

    def _release_transient_buffers(self) -> None:
        for buffer in self.transient_buffers:
            buffer.release()

    def _release_all_buffers(self) -> None:
        for group in self.flat_groups():
            if group.buffer is not None:
                group.buffer.release()

    def _release_buffers_of(self, unit: Unit) -> None:
        for group in unit.groups:
            if not group.dedicated and group.buffer is not None:
                group.buffer.release()

    def _install_views(self, unit: Unit, counted: bool = True) -> None:
        """Make the unit's modules compute with its gathered parameters. `counted`: the unit's
        backward is expected to reach these views (see post_backward)."""
        for group in unit.groups:
            if group.requires_grad and torch.is_grad_enabled():
                views = Unflatten.apply(group.gate, group, self)
                unit.backward_groups_left += counted
            else:
                views = group.full_views()
            group.show_views(views)

    def _remove_views(self, unit: Unit) -> None:
        for group in unit.groups:
            group.hide_views()

    def _cast_inputs(self, unit: Unit, args, kwargs):
        dtype = unit.mp.param_dtype
        cast = unit.mp.cast_root_forward_inputs if unit.is_root else unit.mp.cast_forward_inputs
        if dtype is None or not cast:
            return args, kwargs
        return cast_floating((args, kwargs), dtype)

    # -- gathering and prefetch ---------------------------------------------------------------

    def _ensure_gathered(self, group: FlatGroup) -> None:
        if not group.is_gathered:
            group.start_gather()
        group.wait_gather()

    def _prefetch(self, unit: Optional[Unit]) -> None:
        """Start gathering `unit` now so that it overlaps the current unit's compute; not while
        two units' transient buffers already hold weights (in backward the unit just run may
        not have released them yet): at most two are gathered at once, as with a buffer pair."""
        if unit is None or sum(b.holds_memory for b in self.transient_buffers) >= 2:
            return
        for group in unit.groups:
            if not group.is_gathered:
                group.start_gather()

    def expected_forward_order(self) -> list[Unit]:
        """The last forward's order; before any forward, the Plan's."""
        return self.last_forward_order or [u for u in self.units if not u.is_root]

    def _next_in_forward(self, unit: Unit) -> Optional[Unit]:
        order = self.expected_forward_order()
        for index, candidate in enumerate(order[:-1]):
            if candidate is unit:
                following = order[index + 1]
                return None if following.is_root else following
        return order[0] if unit.is_root and order else None

    def _previous_in_forward(self, unit: Unit) -> Optional[Unit]:
        order = self.forward_order
        for index in range(len(order) - 1, 0, -1):
            if order[index] is unit:
                previous = order[index - 1]
                return None if previous.is_root else previous
        return None

    # -- backward -----------------------------------------------------------------------------

    def _make_pre_backward(self, unit: Unit):
        @torch.compiler.disable  # see [Note: hooks outside the compiler]
        def pre_backward(grads):
            self._queue_end_of_backward()
            unit.in_use = True
            for group in unit.groups:
                self._ensure_gathered(group)
            if self.backward_prefetch is BackwardPrefetch.PRE_BACKWARD:
                # See [Note: backward prefetch per device]: before this unit's backward is
                # queued, so that the gather runs beside it.
                self._prefetch(self._next_to_gather_in_backward(unit))
            # [Note: recomputation in backward] Activation checkpointing runs the unit's
            # forward again inside backward, often without its hooks (Hugging Face checkpoints
            # `forward`, inside `__call__`). So the modules hold gathered parameters through
            # the unit's backward, as views whose gradients reach the reduction: a reentrant
            # recomputation backpropagates through them (its first forward ran without
            # gradients, so nothing else would), a non-reentrant one only reads their values.
            # Not counted: a backward that never uses them must still finish the unit. They
            # stay until the end of backward: the root's (the resident norm group) are used by
            # recomputations of the units inside it after its own gradient may be complete.
            with torch.enable_grad():
                self._install_views(unit, counted=False)

        return pre_backward

    def post_backward(self, group: FlatGroup, grads: tuple) -> None:
        """Called by Unflatten.backward once the group's gradient is complete."""
        self._queue_end_of_backward()
        unit = self.unit_of_group[id(group)]
        group.note_grads(grads)
        unit.backward_groups_left -= 1
        unit_done = unit.backward_groups_left <= 0
        if unit_done:
            unit.in_use = False
            # Every use of its parameters in this backward has run: free its weights before
            # the full gradient is laid out, and start gathering the next unit backward
            # needs, to overlap this unit's reduction. [Note: no prefetch beside a unit's
            # backward] Not earlier on the CPU: a unit's backward is heaviest at its start
            # (for the first unit of backward, with every activation of the step still
            # saved), and on gloo a gather in flight also holds a full-size output of its
            # own. (On NCCL the pre-backward has started it already, where it could: see
            # [Note: backward prefetch per device].)
            if unit.reshard_after_forward:
                self._release_buffers_of(unit)
            self._prefetch(self._next_to_gather_in_backward(unit))
        if unit.requires_sync:
            self._reduce(group, grads)
        else:
            group.accumulate_unsynced(grads)  # no communication inside no_sync

    def _reduce(self, group: FlatGroup, grads: tuple) -> None:
        # [Note: gradient buffers] A unit's gradient, laid out for the network, lives in a
        # buffer of its own from here until its reduction has finished. The reduction before
        # it had this unit's whole backward to run: finish it and free its buffer first, so
        # that at most one unit's gradient waits on the network at a time, as in FSDP2.
        self._finish_pending_scatters()
        predivide = self._reduce_factors(group)[0]
        self._track_reduce(group, *group.start_reduce_of_grads(grads, predivide))

    def _next_to_gather_in_backward(self, unit: Unit) -> Optional[Unit]:
        """The first unit after `unit` in backward order that is not gathered yet."""
        candidate = self._previous_in_forward(unit)
        for _ in range(len(self.forward_order)):  # bounded: a unit may run several times
            if candidate is None or not all(g.is_gathered for g in candidate.groups):
                return candidate
            candidate = self._previous_in_forward(candidate)
        return None

    def _track_reduce(self, group: FlatGroup, work, output: torch.Tensor,
                      source: torch.Tensor) -> None:
        pending = PendingReduce(group, work, output, source)
        hooked = self.unit_of_group[id(group)].all_reduce_hook is not None
        comm = group.comm
        if (work is not None and self.replica_stream is not None
                and self.unit_of_group[id(group)].requires_all_reduce
                and group.partial_reduce is None):
            pending.replica_work = comm.all_reduce_replicas_after(work, output,
                                                                  self.replica_stream)
        if (work is not None and comm.wait_on_futures and comm.replicate_size == 1
                and not hooked  # a user's hook runs on the main thread
                and output.device.type == "cpu"):  # see [Note: no tensor work in gloo's callbacks on CUDA] in comm.py
            # [Note: reductions land early] On gloo the reduction runs on the process group's
            # thread while backward goes on. Its result is added to the gradient shard there,
            # as soon as it is summed, and what it read from freed with it, rather than held
            # until the next unit's gradient is ready: the next unit's backward, where the
            # memory of a step is highest, does not carry it.
            pending.work = work.then(lambda _: self._land(pending))
        self.pending_reduces.append(pending)

    def _land(self, pending: PendingReduce) -> None:
        assert pending.output is not None
        self._divide_reduced(pending.group, pending.output)
        pending.group.accumulate(pending.output)
        pending.landed = True
        pending.output = pending.source = None

    @staticmethod
    def _hybrid(group: FlatGroup) -> bool:
        return group.comm.shard_size > 1 and group.comm.replicate_size > 1

    def _finish_pending_scatters(self) -> None:
        """Wait for the reduce-scatters in flight. [Note: replica all-reduce off the critical
        path] Under hybrid sharding a post-backward waits only for the reduce-scatter before
        it, as FSDP2 does: each reduced shard's all-reduce over the replicas (started beside
        compute on CUDA, else here) is collected once, at the end of backward. Each shard is
        summed, hooked and accumulated in the same order as before: only the waiting moves."""
        for pending in self.pending_reduces:
            if not self._hybrid(pending.group):
                self._finish_reduce(pending)
                continue
            if pending.work is not None:
                pending.work.wait()
            if pending.replica_work is None:
                output = pending.output
                assert output is not None
                if not self.unit_of_group[id(pending.group)].requires_all_reduce:
                    pending.group.keep_partial_reduce(output)
                    pending.work = pending.output = pending.source = None
                    continue
                if output._base is not None:  # a slice of the full gradient: free the rest
                    output = pending.output = output.clone()
                pending.group.add_partial_reduce_into(output)
                pending.replica_work = pending.group.comm.all_reduce_replicas(output)
                if (pending.replica_work is not None and pending.group.comm.wait_on_futures
                        and output.device.type == "cpu"):
                    # See [Note: gloo gather input]: the future lets gloo free its scratch
                    # copy once done. On CUDA the work is kept: its wait() is what makes the
                    # compute stream wait for gloo's copy back into the shard.
                    pending.replica_work = pending.replica_work.get_future()
            pending.work = pending.source = None
            self.replica_reduces.append(pending)
        self.pending_reduces.clear()

    def _finish_pending_reduces(self) -> None:
        """Every reduction started in this backward is done and joined its gradient shard."""
        self._finish_pending_scatters()
        for pending in self.replica_reduces:
            self._finish_reduce(pending)
        self.replica_reduces.clear()
        self.grad_offload.land()

    def _finish_reduce(self, pending: PendingReduce) -> None:
        for work in (pending.work, pending.replica_work):
            if work is not None:
                work.wait()
        if not pending.landed:
            assert pending.output is not None
            self._divide_and_run_hook(pending.group, pending.output)
            self.grad_offload.accumulate(pending.group, pending.output)
        # Drop the work handles, the reduced shard and its source now: gloo's work
        # keeps a full-size scratch copy of its input alive as long as the handle lives.
        pending.work = pending.replica_work = pending.output = pending.source = None

    def _divide_and_run_hook(self, group: FlatGroup, output: torch.Tensor) -> None:
        """[Note: all-reduce hook] FSDP2 calls the hook on each reduced shard, averaged over
        the data-parallel ranks (or divided by the module's divide factor), before it joins
        the gradient. A unit with a hook is divided here, micro-step by micro-step as FSDP2
        divides, so the hook sees FSDP2's values; `finalize_grads` then divides it by 1.
        fp16 reductions are divided here too (see _reduce_factors)."""
        self._divide_reduced(group, output)
        unit = self.unit_of_group[id(group)]
        if unit.all_reduce_hook is not None:
            unit.all_reduce_hook(output)

    def _divide_reduced(self, group: FlatGroup, output: torch.Tensor) -> None:
        """Divide one reduced shard by what is left of its divisor, where reductions are
        divided one by one (see _reduce_factors)."""
        if self._divides_each_reduce(group):
            post = self._reduce_factors(group)[1]
            if post != 1:
                output.div_(post)

    def _divides_each_reduce(self, group: FlatGroup) -> bool:
        """Whether `group`'s reduced gradients are divided reduce by reduce (rather than once
        when the step's gradient is complete): always, but under declared accumulation steps
        (YaFSDP) in another dtype than fp16 without an all-reduce hook."""
        unit = self.unit_of_group[id(group)]
        return (unit.all_reduce_hook is not None or group.reduce_dtype == torch.float16
                or self.plan.divide_around_reduce or self.plan.gradient_accumulation_steps == 1)

    def _reduce_factors(self, group: FlatGroup) -> tuple[float, float]:
        """(divide before the reduction, divide after it) for `group`.

        [Note: fp16 reductions] fp16's range is narrow: a sum over many ranks can overflow
        and a mean taken at the end can underflow. As FSDP1 and FSDP2 do, each rank's gradient
        is divided before the reduction by the largest power of two at most the square root of
        the divisor that divides it, and the reduced shard by the rest after it, in fp16, one
        reduction at a time. FSDP1 does so in every dtype (`Plan.divide_around_reduce`): in
        bf16 the division after the reduction rounds to bf16, so only the same split gives
        FSDP1's gradients bit for bit. Other dtypes are summed and divided after each
        reduction, in the reduce dtype, as FSDP2's averaging reduction does: dividing the sum
        of several micro-steps' reductions once instead rounds differently (in fp32 too), and
        so does a bf16 sum divided in fp32. Under declared accumulation steps (YaFSDP) they
        are divided once, when the step's gradient is complete. An all-reduce hook sees each
        reduction divided (see [Note: all-reduce hook])."""
        if not self._divides_each_reduce(group):
            return 1.0, 1.0  # divided once, by finalize_grads
        factor = self._divisor_of(group)
        if group.reduce_dtype != torch.float16 and not self.plan.divide_around_reduce:
            return 1.0, factor
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre

    def _divisor_of(self, group: FlatGroup) -> float:
        """What a group's summed gradients are divided by: its unit's divide factor, the
        model's, or the group's data-parallel size (see [Note: groups over other meshes] in
        engine/layout.py) times the micro-steps."""
        unit = self.unit_of_group[id(group)]
        steps = self.plan.gradient_accumulation_steps
        return (unit.gradient_divide_factor or self.gradient_divide_factor
                or group.comm.data_parallel_size * steps)

    def _queue_end_of_backward(self) -> None:
        if self.phase is StepPhase.FORWARD:
            self.phase = StepPhase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        assert self.phase is StepPhase.BACKWARD, "end of backward outside a backward"
        # Units that synchronise this backward (FSDP2 may turn units off one by one).
        synced = [unit for unit in self.units if unit.requires_sync]
        # Groups that accumulated inside no_sync but took no part in this backward.
        for unit in synced:
            for group in unit.trainable_groups:
                if group.unsynced_grad is not None:
                    full = group.take_unsynced_grad()
                    work, output = group.start_reduce(full, self._reduce_factors(group)[0])
                    self._track_reduce(group, work, output, full)
        self._finish_pending_reduces()
        self.micro_step += 1
        steps = self.plan.gradient_accumulation_steps
        # A unit whose replicas were not all-reduced has no gradient to expose yet.
        synced = [unit for unit in synced if unit.requires_all_reduce
                  or not any(self._hybrid(group) for group in unit.groups)]
        if synced and self.micro_step % steps == 0:
            without_grad = self._params_without_grad(synced)
            for unit in synced:
                for group in unit.trainable_groups:
                    # See [Note: all-reduce hook].
                    divisor = 1.0 if self._divides_each_reduce(group) else self._divisor_of(group)
                    group.finalize_grads(divisor, without_grad.get(id(group), frozenset()),
                                         self.plan.post_accumulate_grad_hooks)
            self.micro_step = 0
        for unit in self.units:
            unit.in_use = False
            unit.backward_groups_left = 0
            self._remove_views(unit)
            # A prefetch nobody uses this step must not stay in flight past it: the step may
            # be the last before the script tears its process group down.
            for group in unit.groups:
                group.wait_gather()
        # The next forward gathers every unit again (the masters move): no gathered weights
        # are worth holding through the optimizer step, nor is an unshard of this step.
        self._release_all_buffers()
        self.unsharded_ahead.clear()
        self.phase = StepPhase.FORWARD

    def _params_without_grad(self, units: list[Unit]) -> dict[int, frozenset]:
        """{id(group): indices of its parameters that no backward of this step reached on any
        rank}, for the groups of `units`, for plans that leave their `.grad` None (else
        empty).

        [Note: parameters without a gradient] Autograd hands the engine None for a parameter
        a backward did not reach (a branch not taken, a module skipped). The reduction still
        sums a zero for it (the flat layout has no holes), so its value is right either way;
        what differs between dialects is `.grad`: FSDP1 exposes the zero, FSDP2 leaves None,
        and an optimizer moves a parameter with a zero gradient (momentum, weight decay) but
        skips one without. Ranks decide together, with one small all-reduce (MAX) per step:
        a parameter reached on any rank has a gradient, as in a single process on the global
        batch. (Native FSDP2 assumes the ranks agree: it reduce-scatters only the gradients a
        rank holds.)"""
        if not self.plan.unused_grad_is_none:
            return {}
        groups = [group for unit in units if not unit.reduce_unused_params
                  for group in unit.trainable_groups]
        seen = [flag for group in groups for flag in group.grads_seen or [False] * len(group.slots)]
        if not seen:
            return {}
        reached = self._reached_on_any_rank(seen)
        if reached is None:
            return {}
        without, start = {}, 0
        for group in groups:
            count = len(group.slots)
            without[id(group)] = frozenset(i for i in range(count) if not reached[start + i])
            start += count
        return without

    def _reached_on_any_rank(self, seen: list[bool]) -> Optional[list[bool]]:
        """Per flag, whether any rank set it; None when every flag is set. [Note: flags
        without a host sync] Alone, a rank needs no tensor at all. With others it takes part
        in the all-reduce (which reconciles ranks that reached different parameters), its
        flags built on the device without a blocking copy; the result is read back (a wait
        for the device) only when this rank missed some parameter: if it reached them all,
        the maximum over ranks is all set too."""
        group = self.comm.world_group
        if group is None or dist.get_world_size(group) == 1:
            return None if all(seen) else seen
        flags = self._flags_on_device(seen)
        self.comm.any_rank(flags)
        return None if all(seen) else [bool(flag) for flag in flags.tolist()]

    def _flags_on_device(self, seen: list[bool]) -> torch.Tensor:
        if all(seen):  # the usual case: made on the device, nothing copied
            return torch.ones(len(seen), dtype=torch.uint8, device=self.device)
        flags = torch.tensor(seen, dtype=torch.uint8)
        if self.device.type == "cuda":
            return flags.pin_memory().to(self.device, non_blocking=True)
        return flags.to(self.device)

    # -- public operations --------------------------------------------------------------------

    @property
    def requires_sync(self) -> bool:
        """Whether every unit reduces its gradients in the next backward."""
        return all(unit.requires_sync for unit in self.units)

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """FSDP-style accumulation, for every unit (see `unit_verbs` for one unit): while
        False, backward communicates nothing; each group's full gradient is summed locally
        (FSDP's memory cost: one unsharded gradient per unit) and reduced together with the
        gradient of the next backward run with True."""
        for unit in self.units:
            unit.requires_sync = bool(requires_sync)

    @contextlib.contextmanager
    def no_sync(self):
        previous = [unit.requires_sync for unit in self.units]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit, flag in zip(self.units, previous):
                unit.requires_sync = flag

    def flat_groups(self) -> list[FlatGroup]:
        """Every flat group, unit by unit in the Plan's order: what callers outside the engine
        walk (state dicts, memory estimates) instead of reaching through the units."""
        return [group for unit in self.units for group in unit.groups]

    def managed_parameters(self) -> list[nn.Parameter]:
        return [p for group in self.flat_groups() for p in group.local_params]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        whole_shards: bool = False) -> torch.Tensor:
        """Clip the gradients of every parameter by their true global norm; return the norm,
        computed as FSDP1 computes it (see [Note: FSDP1's norm] in engine/norms.py), units in
        FSDP1's order (the root first, then the others as the model lists them).
        `whole_shards`: each group's gradient shard is one tensor (FSDP1's flat parameter,
        `use_orig_params=False`) rather than one per parameter."""
        norm_type = float(norm_type)
        if self.comm.shard_size == 1 and not whole_shards:  # as FSDP1 when nothing is sharded:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        # By identity: front-ends may have put wrapper modules in the tree since the wrap.
        order = {id(module): index for index, module in enumerate(self.module.modules())}
        sharded = [g for unit in sorted(self.units, key=lambda u: order[id(u.module)])
                   for group in unit.groups
                   for g in (group.whole_grad_shard() if whole_shards else None)
                   or group.local_grads()]
        local = [local_part(p.grad) for p in self.ignored_params if p.grad is not None]
        if self.comm.shard_size == 1:
            # torch's own norm, as FSDP1 computes it then, over its flat parameters' gradients.
            total = torch.nn.utils.get_total_norm(sharded + local, norm_type)
        else:
            total = fsdp1_grad_norm(sharded, local, norm_type, self.comm, self.device)
        scale_(sharded + local, clip_coefficient(max_norm, total))
        return total

    def collective_stats(self):
        return self.comm.stats
