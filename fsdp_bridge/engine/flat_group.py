"""A flat group: the parameters of one unit (of one dtype and requires_grad) packed into one
flat buffer, padded to a multiple of the shard-group size, of which this rank keeps one slice.

[Note: what the user sees]
Each original parameter stays registered on its module, under its name, and stays the very
`nn.Parameter` object the user created: its `.data` becomes a view into this rank's slice of
the flat fp32 master (FSDP1's `use_orig_params` layout): 1-D, holding only the elements that
fall in this rank's slice (possibly none). So `named_parameters()` keeps the original names,
optimizers built on `model.parameters()` (before or after wrapping) or on name-based groups
update the masters in place, and `.grad` is a view into the flat gradient shard. While a unit
runs, the full parameters are views of its gathered buffer, installed in the owner module's
`__dict__`, which shadows `_parameters` for attribute lookup.

[Note: flattened, as torch's FSDP1 reads it]
Each of these parameters also carries torch FSDP1's own mark of a parameter already flattened
into some FSDP unit's shards (`_fsdp_flattened`, FLATTENED_MARK), as FSDP1 marks its own nested
units' parameters (fully_shard's DTensor parameters carry it too). torch's FSDP1 applied around
a model of ours then leaves them alone instead of flattening them again: our pieces differ in
size between ranks whenever a unit's size does not divide by the world size, and its first
all-gather of such pieces fails inside torch (gloo aborts a rank; NCCL may hang) before any
code of ours runs; fully_shard's DTensors make its wrap fail with torch's own message. Left
alone, they reach our first forward, which refuses the mix on every rank, naming both
wrappers (fsdp_bridge/mixed_dialects.py).

[Note: CPU offload]
With `offload_to_host`, the master shard (and so the parameters the optimizer steps, its state,
and the gradient shard that `.grad` views) lives in host memory, pinned where CUDA can copy from
it asynchronously, as FSDP2's CPUOffloadPolicy: only gathered weights and the gradients on their
way to a reduction are on the compute device (`self.device`). A gather copies the shard to the
device (cast for compute) as its input; a reduced shard is copied to the host when it joins the
gradient. Collectives that read the master directly (full state dicts) send a device copy.
Neither direction blocks the host: a gather copies the pinned master to the device as it is
and casts it there (`_gather_input`); a reduced shard goes back on a stream of its own and lands
once, at the end of backward (see [Note: gradients to the host without blocking] in offload.py).
TODO(offload speed): the host-to-device copy is queued on the compute stream, ahead of the
gather; FSDP2 issues it, and its all-gather, on a stream of their own.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Optional

import torch
from torch import nn

from fsdp_bridge.engine.buffers import GatherBuffer
from fsdp_bridge.engine.comm import Comm
from fsdp_bridge.engine.layout import FLATTENED_MARK, HIDDEN_ORIGINALS, GroupLayout
from fsdp_bridge.plan import UnsyncedGradSum


class GradCycle(enum.Enum):
    """Where a group is in its gradient accumulation cycle (the reductions of the micro-steps
    of one optimizer step). CLOSED -> OPEN when the cycle's first reduction lands; OPEN ->
    CLOSED when `finalize_grads` exposes the result as `.grad`. A cycle is open exactly while
    the group has an accumulator (see `FlatGroup.grad_cycle`)."""

    CLOSED = "closed"  # no reduced gradient held; `.grad` (if any) is the user's
    OPEN = "open"  # reductions are being summed into the accumulator


@dataclasses.dataclass
class ShownFlat:
    """A group shown as FSDP1's flat parameter (see [Note: flat parameters] in
    flat_params.py)."""

    param: nn.Parameter  # over the master shard: the same storage
    resting: list[torch.Tensor]  # per parameter, what its owners hold outside forward


class FlatGroup:
    # FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter` (torch's AllGather /
    # ReduceScatter objects) for this group, set by the runtime; None: the engine's own
    # collectives. See [Note: custom collectives].
    custom_all_gather: Any = None
    custom_reduce_scatter: Any = None

    def __init__(
        self,
        layout: GroupLayout,
        comm: Comm,
        device: torch.device,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        sync_module_states: bool,
        unsynced_grad_sum: UnsyncedGradSum = UnsyncedGradSum.REDUCE_DTYPE,
        rereduce_kept_grad: bool = False,
    ):
        self.unit_name = layout.unit_name
        self.slots = layout.slots
        self.requires_grad = layout.requires_grad
        self.comm = comm
        # Also says where the group computes (`device`); the master may be on the host.
        self.gate = torch.empty(0, device=device, requires_grad=True)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.unsynced_grad_sum = unsynced_grad_sum
        self.rereduce_kept_grad = rereduce_kept_grad
        self.numels = [slot.numel for slot in self.slots]
        self._init_layout()
        self.master = self._build_master(device, sync_module_states)
        self.local_params = self._register_local_params()

        # Set by the runtime: where the gathered parameters live.
        self.buffer: Optional[GatherBuffer] = None
        self.dedicated = False
        self.pending_gather = None  # the handle of an in-flight gather (work or future)
        # Gradient state of the current accumulation cycle.
        self.grad_shard: Optional[torch.Tensor] = None  # during a cycle; then .grad views
        self.grad_shard_ref: Optional[weakref.ref] = None  # after it (see _begin_cycle)
        self.accumulator: Optional[torch.Tensor] = None  # set while a cycle is open
        self.unsynced_grad: Optional[torch.Tensor] = None  # local sum of no_sync gradients
        # Sum of reduce-scattered shards not yet all-reduced over the replicas (hybrid).
        self.partial_reduce: Optional[torch.Tensor] = None
        # Per parameter, whether a backward of the cycle gave it a gradient (None: no
        # backward yet). See [Note: parameters without a gradient].
        self.grads_seen: Optional[list[bool]] = None
        # FSDP1's flat parameter over the master, if shown (see engine/flat_params.py).
        self.shown_flat: Optional[ShownFlat] = None

    # Derived, not stored: each attribute an instance stores counts against the key-sharing
    # dict CPython gives instances of one class (30 keys), and past that every group pays for
    # a dict of its own for as long as the model lives.
    @property
    def device(self) -> torch.device:
        """Where the group computes and reduces (its master may live on the host)."""
        return self.gate.device

    @property
    def unsynced_dtype(self) -> torch.dtype:
        """The dtype of the sum of gradients accumulated without synchronisation (see [Note:
        gradients summed without synchronisation])."""
        if self.unsynced_grad_sum is UnsyncedGradSum.COMPUTE_DTYPE:
            return self.compute_dtype
        return self.reduce_dtype

    @property
    def flat_param(self) -> Optional[nn.Parameter]:
        return self.shown_flat.param if self.shown_flat is not None else None

    @property
    def resting(self) -> Optional[list[torch.Tensor]]:
        return self.shown_flat.resting if self.shown_flat is not None else None

    @property
    def numel(self) -> int:
        """Elements of the group's parameters together, without padding."""
        return sum(self.numels)

    @property
    def shard_start(self) -> int:
        """Where this rank's shard starts in the padded flat buffer."""
        return self.comm.shard_rank * self.shard_numel

    # -- construction -------------------------------------------------------------------------

    def _init_layout(self) -> None:
        """Where each parameter lies in the full flat buffer (`offsets`), and the sizes of the
        full buffer and of one rank's shard of it."""
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        size = self.comm.shard_size
        self.padded_numel = -(-self.numel // size) * size
        self.shard_numel = self.padded_numel // size

    def _build_master(self, device: torch.device, sync_module_states: bool) -> torch.Tensor:
        if not sync_module_states:
            return self._shard_of_originals(device)
        full = self._flatten_originals(device)
        self.comm.broadcast_from_first(full)
        return full[self.shard_start : self.shard_start + self.shard_numel].clone()

    def _shard_of_originals(self, device: torch.device) -> torch.Tensor:
        """This rank's shard, copied from the original parameters' pieces that fall in it:
        no full flat copy of the unit is made (only `sync_module_states` needs one, to
        broadcast), so the wrap's peak is one unit's originals and its shard."""
        shard = torch.zeros(self.shard_numel, dtype=self.slots[0].param.dtype, device=device)
        for index, slot in enumerate(self.slots):
            lo, hi = self.local_range(index)
            if hi > lo:
                start = self.shard_start + lo - self.offsets[index]
                shard[lo:hi].copy_(slot.param.detach().reshape(-1)[start : start + hi - lo])
        return shard

    def adopt_replaced_params(self) -> bool:
        """Take in a cast of the model since the last forward (`model.half()`,
        `model.to(torch.float64)`): torch's `Module.to` keeps the Parameter objects but gives
        each new `.data`, which no longer aliases the master. The casted values become the
        master, in their dtype, as native FSDP1 casts its flat parameters; the parameters
        (and gradients kept across the cast) become views of it again. Returns whether the
        master's dtype changed: the runtime then rebuilds this group's buffers."""
        if self.flat_param is not None:
            return self._adopt_cast_flat_param()
        master_ptr = self.master.untyped_storage().data_ptr()
        moved = [index for index, slot in enumerate(self.slots)
                 if slot.param.untyped_storage().data_ptr() != master_ptr
                 or slot.param.dtype != self.master.dtype]
        if not moved:
            return False
        self._check_castable(moved)
        if self.grad_cycle is GradCycle.OPEN or self.unsynced_grad is not None:
            raise ValueError(
                f"fsdp_bridge: parameter {self.slots[moved[0]].fqn!r} was cast in the middle "
                "of a gradient accumulation cycle (gradients of earlier micro-steps are held "
                f"in {self.master.dtype}); accepted: a cast between optimizer steps. Cast the "
                "model before the first micro-step of a cycle.")
        dtype = self.slots[moved[0]].param.dtype
        master = torch.zeros(self.shard_numel, dtype=dtype, device=self.master.device,
                             pin_memory=self._pins_master)
        grads = torch.zeros_like(master) if any(
            slot.param.grad is not None for slot in self.slots) else None
        for index, slot in enumerate(self.slots):
            lo, hi = self.local_range(index)
            master[lo:hi] = slot.param.detach()
            if grads is not None and slot.param.grad is not None:
                grads[lo:hi] = slot.param.grad
        retyped = dtype != self.master.dtype
        self.invalidate()
        self.master = master
        for index in range(len(self.slots)):
            self._point_at_master(index)
        self.grad_shard = self.accumulator = self.grad_shard_ref = None
        if grads is not None:  # held by the `.grad` views only, as after any cycle
            self.grad_shard = grads
            for index, param in enumerate(self.local_params):
                param.grad = self._grad_of(index)
            self.grad_shard_ref, self.grad_shard = weakref.ref(grads), None
        return retyped

    def _adopt_cast_flat_param(self) -> bool:
        """`adopt_replaced_params` for a group shown as one flat parameter: the cast reached
        the flat parameter (and its gradient), whose new values become the master."""
        flat = self.flat_param
        assert flat is not None
        if (flat.untyped_storage().data_ptr() == self.master.untyped_storage().data_ptr()
                and flat.dtype == self.master.dtype):
            return False
        problem = None
        if flat.device != self.master.device:
            problem = f"moved to {flat.device} (sharded on {self.master.device})"
        elif tuple(flat.shape) != (self.shard_numel,):
            problem = f"given shape {tuple(flat.shape)} (its shard has {(self.shard_numel,)})"
        elif self.grad_cycle is GradCycle.OPEN or self.unsynced_grad is not None:
            problem = "cast in the middle of a gradient accumulation cycle"
        if problem is not None:
            raise ValueError(
                f"fsdp_bridge: the flat parameter of unit {self.unit_name or '<root>'!r} was "
                f"{problem} after wrapping; accepted: a cast of the whole model to one floating "
                "dtype between optimizer steps (e.g. model.half()). Move the model before "
                "wrapping it (device_id), and load new values with load_state_dict.")
        retyped = flat.dtype != self.master.dtype
        self.invalidate()
        self.master = flat.detach()
        for index in range(len(self.slots)):
            self._point_at_master(index)
        self.grad_shard = self.accumulator = self.grad_shard_ref = None
        return retyped

    def _check_castable(self, moved: list[int]) -> None:
        """A cast is taken in only when it leaves the group whole: one dtype, the same device
        and the same local shapes. Anything else is refused by name (never guessed)."""
        dtypes = {self.slots[i].param.dtype for i in range(len(self.slots))}
        for index in moved:
            slot = self.slots[index]
            lo, hi = self.local_range(index)
            problem = None
            if slot.param.device != self.master.device:
                problem = (f"moved to {slot.param.device} (sharded on {self.master.device})",
                           "Move the model before wrapping it (device_id), not after.")
            elif tuple(slot.param.shape) != (hi - lo,):
                problem = (f"given shape {tuple(slot.param.shape)} (its local shard has "
                           f"{(hi - lo,)})", "Load new values with load_state_dict, or inside "
                           "summon_full_params.")
            elif len(dtypes) > 1:
                found = ", ".join(sorted(str(d) for d in dtypes))
                problem = (f"cast to {slot.param.dtype} while parameters flattened with it "
                           f"(unit {self.unit_name or '<root>'!r}) are now {found}",
                           "Cast the whole wrapped model (e.g. model.half()), or use "
                           "MixedPrecision(param_dtype=...).")
            if problem is not None:
                raise ValueError(
                    f"fsdp_bridge: parameter {slot.fqn!r} was {problem[0]} after wrapping; "
                    "accepted: a cast of whole units to one floating dtype on their device. "
                    f"{problem[1]}")

    def _flatten_originals(self, device: torch.device) -> torch.Tensor:
        parts = [slot.param.detach().reshape(-1).to(device) for slot in self.slots]
        padding = self.padded_numel - self.numel
        dtype = self.slots[0].param.dtype
        parts.append(torch.zeros(padding, dtype=dtype, device=device))
        return torch.cat(parts)

    def local_range(self, index: int) -> tuple[int, int]:
        """The part of parameter `index` that lies in this rank's shard, as shard offsets."""
        start = max(self.offsets[index], self.shard_start)
        end = min(self.offsets[index] + self.numels[index], self.shard_start + self.shard_numel)
        if end <= start:
            return 0, 0
        return start - self.shard_start, end - self.shard_start

    def _register_local_params(self) -> list[nn.Parameter]:
        """The user's own Parameter objects become the local shards: their `.data` is pointed
        at their piece of the master (and the full original is freed), so an optimizer built
        before wrapping, which holds these very objects, updates the masters (as native FSDP1
        with `use_orig_params=True`, whose original parameters stay live the same way)."""
        for index, slot in enumerate(self.slots):
            self._point_at_master(index)
            # How many ranks hold this same piece (replicas of a shard), so layout-independent
            # digests (the equivalence harness) count it once.
            setattr(slot.param, "_fsdp_bridge_replicas", self.comm.replicate_size)
            setattr(slot.param, FLATTENED_MARK, True)
            for module, attr in slot.owners:
                module._parameters[attr] = slot.param
        return [slot.param for slot in self.slots]

    def offload_to_host(self) -> None:
        """Keep the master shard in host memory (see [Note: CPU offload])."""
        if self.master.device.type == "cpu":
            return
        host = torch.empty(self.master.shape, dtype=self.master.dtype, device="cpu",
                           pin_memory=self.device.type == "cuda")
        host.copy_(self.master)
        self.master = host
        for index in range(len(self.slots)):
            self._point_at_master(index)
        if self.flat_param is not None:
            self.flat_param.data = self.master

    @property
    def _pins_master(self) -> bool:
        """Whether the master lives in pinned host memory: offloaded from a CUDA device (the
        only case where pinning exists and pays: see [Note: CPU offload])."""
        return self.master.device.type == "cpu" and self.device.type == "cuda"

    def _point_at_master(self, index: int) -> None:
        lo, hi = self.local_range(index)
        param = self.slots[index].param
        param.grad = None  # a full-shaped gradient would not fit the shard
        param.data = self.master[lo:hi]

    def make_flat_param(self) -> nn.Parameter:
        """This group as one parameter over its master shard, and the storage-less tensors
        its owners hold outside forward (see [Note: flat parameters] in flat_params.py)."""
        flat = nn.Parameter(self.master, requires_grad=self.requires_grad)  # same storage
        setattr(flat, "_fsdp_bridge_replicas", self.comm.replicate_size)
        setattr(flat, FLATTENED_MARK, True)
        setattr(flat, HIDDEN_ORIGINALS, tuple(self.local_params))
        self.shown_flat = ShownFlat(flat, [_storage_less(slot.shape, self.master.dtype,
                                                         self.device) for slot in self.slots])
        for param in self.local_params:
            param.grad = None
        return flat

    # -- gathering ----------------------------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        return self.buffer is not None and self.buffer.owner is self

    def gathered_flat(self) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer.view_for(self.padded_numel)

    def start_gather(self) -> None:
        """Start gathering this rank's shard into the group's own buffer."""
        assert self.buffer is not None and self.buffer.owner in (None, self)
        self.buffer.owner = self
        target = self._gather_target()
        self.pending_gather = self._all_gather(target, self._gather_input(target))

    # [Note: custom collectives] FSDP2 lets a module replace its all-gather and reduce-scatter
    # by objects of its own (torch's AllGather / ReduceScatter: `allocate(size, dtype=,
    # device=)` and a call). A group with one calls it where the engine would run its own
    # collective, over the shard group, with the tensors the engine lays out (the gather
    # output allocated by it), synchronously (`async_op=False`), as FSDP2 calls them. The
    # reduce-scatter is asked for a SUM: the engine divides afterwards, as it does with its
    # own (FSDP2 asks for AVG in fp32 and bf16; for a collective that honours `op` the
    # numbers are the same). A shard group of one has nothing to communicate.

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor):
        custom = self.custom_all_gather
        if custom is None or self.comm.shard_size == 1:
            return self.comm.all_gather(output, shard)
        self.comm.stats.record("all_gather", output)
        work = custom(output_tensor=output.data, input_tensor=shard,
                      group=self.comm.shard_group, async_op=False)
        return work  # waited for by wait_gather (None: done)

    def _allocate_for_comm(self, custom, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if custom is None:
            return torch.empty(numel, dtype=dtype, device=self.device)
        return custom.allocate((numel,), dtype=dtype, device=self.device)

    def _gather_input(self, target: torch.Tensor) -> torch.Tensor:
        """What this rank sends. Cast for compute, it is written straight into its own place in
        the gather's output (gathered rank after rank), as FSDP2 does, rather than into a copy
        that the collective would keep alive beside the output until it finishes. In a shard
        group of one that place is the whole output: one copy (cast on the way) is the gather."""
        if (self.master.dtype == self.compute_dtype and self.master.device == target.device
                and self.comm.shard_size > 1):
            return self.master  # sent as it is
        start = self.comm.shard_rank * self.shard_numel
        own_place = target.data[start : start + self.shard_numel]
        source = self.master
        if source.device != own_place.device and source.dtype != own_place.dtype:
            # From the host (see [Note: CPU offload]): a copy that also casts would be cast
            # on the CPU through a pageable temporary and block; copy the pinned master as it
            # is without blocking, and cast on the device.
            source = source.to(own_place.device, non_blocking=True)
        own_place.copy_(source, non_blocking=True)
        return own_place

    def _gather_target(self) -> torch.Tensor:
        """Where the all-gather writes: in this layout, straight into the buffer."""
        return self.gathered_flat()

    def wait_gather(self) -> None:
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None
        self._finish_gather()

    def _finish_gather(self) -> None:
        """Runs once a gather has landed (nothing to do in this layout)."""

    def invalidate(self) -> None:
        """The masters changed (or will): the gathered copy is stale."""
        self.wait_gather()
        if self.buffer is not None and self.buffer.owner is self:
            self.buffer.owner = None

    def hide_full(self) -> None:
        """The owner modules hold the sharded parameters again, the gathered copy stays (a
        forward uses an explicit unshard's gather); nothing to do in this layout, which never
        exposes the full parameters."""

    def split(self, flat: torch.Tensor):
        """(slot, view of its parameter in `flat`) for every parameter of a full flat buffer."""
        for slot, offset, numel in zip(self.slots, self.offsets, self.numels):
            yield slot, flat[offset : offset + numel].view(slot.shape)

    def full_views(self) -> list[torch.Tensor]:
        return [view for _, view in self.split(self.gathered_flat())]

    def compute_views(self, views) -> list:
        """The gathered views as modules compute with them (a row group may wrap some)."""
        return list(views)

    def show_views(self, views) -> None:
        """Let the owner modules compute with `views` of the gathered parameters: set in
        each owner's `__dict__`, where they shadow the registered (sharded) parameters."""
        for slot, view in zip(self.slots, self.compute_views(views)):
            for owner, attr in slot.owners:
                owner.__dict__[attr] = view

    def hide_views(self) -> None:
        for index, slot in enumerate(self.slots):
            for owner, attr in slot.owners:
                if self.resting is None:
                    owner.__dict__.pop(attr, None)
                else:
                    owner.__dict__[attr] = self.resting[index]

    # -- gradients ----------------------------------------------------------------------------

    def grads_to_reduce(self, grads: tuple) -> tuple:
        """The gradients of one backward as the reduction takes them (here as they come)."""
        return grads

    def note_grads(self, grads: tuple) -> None:
        """Record which parameters this backward gave a gradient (None: unused)."""
        seen = self.grads_seen or [False] * len(grads)
        self.grads_seen = [before or grad is not None for before, grad in zip(seen, grads)]

    def write_full_grad(self, grads: tuple, out: torch.Tensor) -> None:
        """Lay the per-parameter gradients of one backward into `out` (`padded_numel` long),
        part after part as the shard group's ranks hold them."""
        self._write_grad_parts(grads, range(self.comm.shard_size), out)

    def part_pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Where shard-group rank `rank`'s part of a full buffer comes from: (parameter index,
        first and end element in the flattened parameter, offset in the part) for every
        parameter that has elements there; the rest of the part is padding."""
        start, end = rank * self.shard_numel, (rank + 1) * self.shard_numel
        pieces = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                pieces.append((index, lo - offset, hi - offset, lo - start))
        return pieces

    def write_grad_part(self, grads: tuple, rank: int, out: torch.Tensor) -> None:
        """Lay out only rank `rank`'s part of the full gradient of `grads` into `out`
        (`shard_numel` long)."""
        self._write_grad_parts(grads, [rank], out)

    def _write_grad_parts(self, grads: tuple, ranks, out: torch.Tensor) -> None:
        """The parts of `ranks`, one after another, into `out` with one copy: unused
        parameters (None) and padding contribute zero."""
        def zeros(numel: int) -> torch.Tensor:
            return torch.zeros(numel, dtype=out.dtype, device=out.device)

        parts = []
        for rank in ranks:
            filled = 0
            for index, lo, hi, at in self.part_pieces(rank):
                if at > filled:
                    parts.append(zeros(at - filled))
                grad = grads[index]
                parts.append(zeros(hi - lo) if grad is None
                             else self._flat_piece(grad, index, lo, hi))
                filled = at + hi - lo
            if filled < self.shard_numel:
                parts.append(zeros(self.shard_numel - filled))
        if parts:
            torch.cat(parts, out=out)

    def grad_part_pieces(self, grads: tuple, rank: int) -> list[tuple[int, torch.Tensor]]:
        """(offset in the part, gradient piece) for rank `rank`'s part of `grads`, to be added
        into a part of the reduce dtype later: a parameter that lies wholly in the part is kept
        as it is, a piece of one that crosses the part's edge is copied out, so that nothing
        outside the part stays alive. A gradient the reduce dtype cannot hold exactly is cast
        now, so that it is rounded as a laid-out gradient would be before the sum."""
        kept = []
        for index, lo, hi, at in self.part_pieces(rank):
            grad = grads[index]
            if grad is None:
                continue
            piece = self._flat_piece(grad, index, lo, hi)
            if torch.promote_types(piece.dtype, self.reduce_dtype) != self.reduce_dtype:
                kept.append((at, piece.to(self.reduce_dtype)))
            elif hi - lo == grad.numel():
                kept.append((at, piece))
            else:
                kept.append((at, piece.clone()))
        return kept

    def _flat_piece(self, grad: torch.Tensor, index: int, lo: int, hi: int) -> torch.Tensor:
        """Elements lo:hi of parameter `index`'s gradient as the parts lay it out."""
        return grad.reshape(-1)[lo:hi]

    def accumulate_unsynced(self, grads: tuple) -> None:
        """Inside no_sync: add this backward's full gradient to a local, unreduced sum.

        [Note: gradients summed without synchronisation]
        Where a sum of several micro-batches' gradients rounds decides the step's gradient in
        the last bits, and each dialect rounds in its own order, which `Plan.unsynced_grad_sum`
        names. FSDP1 lets autograd accumulate into its unsharded flat parameter's gradient, in
        the gradients' dtype (param_dtype), and casts that sum to reduce_dtype once, for the
        reduction (COMPUTE_DTYPE). FSDP2 keeps the sum in reduce_dtype: the first gradient is
        cast to it, each later one, the synchronising backward's included, added as it is,
        with one rounding of the sum (REDUCE_DTYPE). Both are reproduced here as they compute
        it: the sum starts as the first gradient laid out in `unsynced_dtype`, and each later
        gradient, laid out in its own dtype, is added into it."""
        if self.unsynced_grad is None:
            kept = self._take_kept_grad_to_rereduce()
            if kept is None:
                self.unsynced_grad = torch.empty(
                    self.padded_numel, dtype=self.unsynced_dtype, device=self.device
                )
                self.write_full_grad(grads, self.unsynced_grad)
                return
            self.unsynced_grad = kept
        full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.write_full_grad(grads, full)
        self.unsynced_grad.add_(full)

    def _rereduces_kept_grad(self) -> bool:
        """[Note: a kept gradient reduced again] Where a rank's gradient shard is the whole
        gradient (a shard group of one rank: NO_SHARD, hybrid sharding over groups of one, a
        world of one), FSDP1 leaves a gradient kept from an earlier backward (several
        synchronised micro-steps, or `.grad` not zeroed) in its flat parameter's `.grad`:
        autograd adds the next backward's gradient into it, in the kept gradient's dtype, and
        FSDP1 reduces that sum again (cast to the reduce dtype, divided, all-reduced, divided)
        and makes the result the new gradient. Mathematically that is the kept gradient plus
        the new mean, but it rounds otherwise than adding the new mean to the kept gradient,
        which FSDP1 does wherever shards are parts, and FSDP2 everywhere. Under
        `Plan.rereduce_kept_grad` the kept gradient (the pieces whose `.grad` the user dropped
        as zero) starts the backward's local sum, as FSDP1 computes it, and the reduced sum
        then replaces it rather than being added to it. A no_sync backward starts from it too,
        as FSDP1's autograd adds into the same `.grad`."""
        return (self.rereduce_kept_grad and self.comm.shard_size == 1
                and self.grad_cycle is GradCycle.CLOSED and self._kept_grad_shard() is not None)

    def _take_kept_grad_to_rereduce(self) -> Optional[torch.Tensor]:
        """A copy of the kept gradient to start a local sum with, on the compute device, when
        it is to be reduced again (see [Note: a kept gradient reduced again]); the group
        then no longer counts it as a gradient to add the reduction to."""
        if not self._rereduces_kept_grad():
            return None
        kept = self._kept_grad_shard()
        assert kept is not None
        taken = kept.to(self.device, copy=True)
        if self.flat_param is not None:  # its `.grad` is the kept shard whole (no pieces to drop)
            self.flat_param.grad = None
            return taken
        for index, param in enumerate(self.local_params):
            if param.grad is None:  # dropped on its own: it counts as zero
                self._piece(taken, index).zero_()
        self.grad_shard_ref = None
        return taken

    def take_unsynced_grad(self, grads: Optional[tuple] = None) -> torch.Tensor:
        """The no_sync sum, with `grads` (the synchronising backward's, if any) added, in the
        reduce dtype, ready to be reduced; the group holds no sum afterwards."""
        if grads is not None:
            self.accumulate_unsynced(grads)
        full, self.unsynced_grad = self.unsynced_grad, None
        assert full is not None, "no gradients accumulated without synchronisation"
        return full.to(self.reduce_dtype)  # no copy when the sum is in the reduce dtype

    def start_reduce_of_grads(self, grads: tuple, predivide: float = 1.0):
        """Start reducing one backward's gradients (and any no_sync sum), each rank's part
        divided by `predivide` first; returns (work, shard-sized result tensor, what the
        reduction reads from until it is done)."""
        if self.unsynced_grad is not None or self._rereduces_kept_grad():
            full = self.take_unsynced_grad(grads)
        elif self.comm.swaps_halves and self.custom_reduce_scatter is None:
            return self._start_pair_reduce(grads, predivide)
        else:
            full = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
            self.write_full_grad(grads, full)
        work, output = self.start_reduce(full, predivide)
        return work, output, full

    def _start_pair_reduce(self, grads: tuple, predivide: float):
        """[Note: a pair reduces from the gradients] Only the other rank's part of the
        gradient is laid out, to be sent; this rank's part is added from the gradients
        themselves once the other rank's contribution has arrived. Half the copying of a full
        layout, and half its memory while backward goes on."""
        rank = self.comm.shard_rank
        theirs = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.write_grad_part(grads, 1 - rank, theirs)
        if predivide != 1:
            theirs.div_(predivide)
        own = self.grad_part_pieces(grads, rank)
        if predivide != 1:  # divided in the reduce dtype, as a laid-out gradient is (an fp16
            # piece the reduce dtype holds exactly is kept as it is, but halving it in fp16
            # would round its subnormals)
            own = [(at, piece.to(self.reduce_dtype) / predivide) for at, piece in own]
        output = torch.empty_like(theirs)

        def add_own() -> None:
            for at, piece in own:
                output[at : at + piece.numel()].add_(piece)

        return self.comm.reduce_pair(theirs, output, add_own), output, theirs

    def start_reduce(self, full: torch.Tensor, predivide: float = 1.0):
        """Start reducing a full gradient, divided by `predivide` first; returns (work,
        shard-sized result tensor)."""
        if predivide != 1:
            full.div_(predivide)
        if self.comm.shard_size == 1:
            return self.comm.all_reduce_replicas(full), full
        if self.custom_reduce_scatter is not None:  # see [Note: custom collectives]
            output = self._allocate_for_comm(self.custom_reduce_scatter, self.shard_numel,
                                             full.dtype)
            self.comm.stats.record("reduce_scatter", full)
            work = self.custom_reduce_scatter(output_tensor=output, input_tensor=full,
                                              group=self.comm.shard_group,
                                              op=torch.distributed.ReduceOp.SUM, async_op=False)
            if work is not None:
                work.wait()
            return None, output
        if self._reduces_in_full_buffer:
            work = self.comm.reduce_scatter_in_buffer(full)
            return work, full[self.shard_start : self.shard_start + self.shard_numel]
        output = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        return self.comm.reduce_scatter(output, full), output

    def keep_partial_reduce(self, reduced: torch.Tensor) -> None:
        """[Note: reduce-scattered, not all-reduced] Under hybrid sharding FSDP2's
        `set_requires_all_reduce(False)` reduce-scatters each backward's gradient inside the
        shard group but does not all-reduce it over the replicas: the reduced shards are summed
        aside, in the reduce dtype, and join the next all-reduced shard before its
        all-reduce (`add_partial_reduce_into`); only then does the gradient change."""
        if self.partial_reduce is None:
            self.partial_reduce = reduced.clone() if reduced._base is not None else reduced
        else:
            self.partial_reduce.add_(reduced)

    def add_partial_reduce_into(self, reduced: torch.Tensor) -> None:
        if self.partial_reduce is not None:
            reduced.add_(self.partial_reduce)
            self.partial_reduce = None

    @property
    def _reduces_in_full_buffer(self) -> bool:
        """Whether a reduction's result is a slice of the full gradient (gloo groups of more
        than two) rather than a tensor of its own."""
        return (self.comm.shard_size > 1 and self.comm.reduce_scatter_in_place
                and self.custom_reduce_scatter is None)

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add one micro-step's reduced gradient shard into this cycle's accumulator; the
        first of a cycle becomes the accumulator when it is a tensor of its own of the master's
        dtype, saving a zero-fill and an addition. On gloo this runs on the process group's
        thread as the reduction lands (see [Note: reductions land early]): it touches only
        this group's gradient state, which the main thread reads again only after waiting on
        that reduction."""
        if self.grad_cycle is GradCycle.CLOSED:
            if (self._reduces_in_full_buffer or reduced.dtype != self.master.dtype
                    or reduced.device != self.master.device):
                # To the host under CPU offload: a blocking copy, so the optimizer (on the
                # host) never reads a gradient still on its way.
                reduced = reduced.to(device=self.master.device, dtype=self.master.dtype,
                                     copy=True)
            self._begin_cycle(reduced)
            return
        assert self.accumulator is not None
        self.accumulator.add_(reduced.to(self.accumulator.device))

    def _begin_cycle(self, first: torch.Tensor) -> None:
        # [Note: gradient memory follows .grad] Between cycles the engine holds the gradient
        # shard only weakly: the `.grad` views handed to the user are what keep it alive, so
        # `zero_grad()` (set_to_none) frees it on the spot, as torch frees a plain `.grad`.
        # Torch semantics: gradients add into existing .grad until the user zeroes or drops
        # them. If the user kept some, accumulate aside and add at the end.
        # `first`, the cycle's first reduced shard, becomes the accumulator.
        assert self.grad_cycle is GradCycle.CLOSED, "a gradient cycle opened twice"
        kept = self._kept_grad_shard()
        if kept is None:
            self.grad_shard = self.accumulator = first
            return
        self.grad_shard = kept
        for index, param in enumerate(self.local_params):
            # A `.grad` the user dropped on its own starts again from zero (the pieces of a
            # flat parameter have none: its own `.grad` is the shard kept).
            if param.grad is None and self.flat_param is None:
                self._piece(kept, index).zero_()
        self.accumulator = first

    @property
    def grad_cycle(self) -> GradCycle:
        return GradCycle.CLOSED if self.accumulator is None else GradCycle.OPEN

    def _kept_grad_shard(self) -> Optional[torch.Tensor]:
        """Last cycle's gradient shard if the user still holds any `.grad` view of it (with a
        flat parameter: its `.grad`, whatever tensor that now is)."""
        if self.flat_param is not None:
            return self.flat_param.grad
        shard = self.grad_shard_ref() if self.grad_shard_ref is not None else None
        if shard is None or all(p.grad is None for p in self.local_params):
            return None
        return shard

    def finalize_grads(self, divisor: float, without_grad: frozenset = frozenset(),
                       run_hooks: bool = False) -> None:
        """Divide once, expose the result as `.grad` views, and end the cycle. Parameters
        whose index is in `without_grad` (no rank's backward reached them) keep a `.grad` of
        None unless the user kept one from an earlier cycle, which stays as it was.
        `run_hooks`: then call the post-accumulate-grad hooks of the parameters the backward
        reached (see `Plan.post_accumulate_grad_hooks`)."""
        self.grads_seen = None
        if self.grad_cycle is GradCycle.CLOSED:
            return
        assert self.grad_shard is not None and self.accumulator is not None
        if self.accumulator is not self.grad_shard:  # the user kept last cycle's .grad
            self.grad_shard.add_(self.accumulator, alpha=1.0 / divisor)
        elif divisor != 1:  # a divide by one would be a pass over the shard for nothing
            self.grad_shard.div_(divisor)
        if self.flat_param is not None:
            self.flat_param.grad = self.grad_shard
        else:
            for index, param in enumerate(self.local_params):
                if index not in without_grad or param.grad is not None:
                    param.grad = self._grad_of(index)
        self.grad_shard_ref = weakref.ref(self.grad_shard)
        self.grad_shard = self.accumulator = None  # closes the cycle
        if run_hooks:
            for index, param in enumerate(self.local_params):
                if index not in without_grad:
                    for hook in (getattr(param, "_post_accumulate_grad_hooks", None)
                                 or {}).values():
                        hook(param)

    def _grad_of(self, index: int) -> torch.Tensor:
        """Parameter `index`'s gradient as the user sees it: a view of the gradient shard."""
        assert self.grad_shard is not None
        return self._piece(self.grad_shard, index)

    def _piece(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s part of a tensor laid out as this rank's shard."""
        lo, hi = self.local_range(index)
        return shard[lo:hi]

    def whole_grad_shard(self) -> list[torch.Tensor]:
        """This rank's gradient shard, padding included, as one tensor (FSDP1's flat
        parameter's gradient), when every `.grad` is still a view of it; else []."""
        if self.flat_param is not None:
            return [] if self.flat_param.grad is None else [self.flat_param.grad]
        shard = self._kept_grad_shard()
        if shard is None or any(p.grad is None or p.grad._base is not shard
                                for p in self.local_params):
            return []
        return [shard]

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's pieces of the parameters' gradients, as plain tensors."""
        if self.flat_param is not None:
            return self.whole_grad_shard()
        return [local_part(p.grad) for p in self.local_params if p.grad is not None]

    # -- full (unsharded) values --------------------------------------------------------------

    def gather_full_master(self) -> torch.Tensor:
        """The full fp32 flat parameters (parameter after parameter, as `split` reads them),
        on every rank (a blocking collective)."""
        return self.gather_full(self.master)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard` (laid out like the master shard) as one full flat tensor in
        the order `split` reads, on the compute device. A blocking collective."""
        shard = shard.to(self.device)  # from the host under CPU offload
        full = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        work = self.comm.all_gather(full, shard)
        if work is not None:
            work.wait()
        return full

    def load_full_master(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.master.copy_(self.shard_of(full))
        self.invalidate()

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full flat tensor laid out as `split` reads it."""
        return full[self.shard_start : self.shard_start + self.shard_numel]


def _storage_less(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A plain tensor of `shape` whose storage is freed: what native FSDP1's modules hold for
    their flattened parameters outside forward. Giving it the shape sizes its storage (not
    written, so not touched), which is freed at once: one parameter's worth for an instant."""
    stride = torch.empty(shape, device="meta").stride()
    tensor = torch.empty(0, dtype=dtype, device=device)
    storage = tensor.untyped_storage()
    tensor.set_(storage, 0, shape, stride)
    storage.resize_(0)
    return tensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor, or the tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)
