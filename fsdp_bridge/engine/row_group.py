"""A row group: a flat group whose parameters are sharded by rows, as torch's `Shard(0)`.

[Note: row layout]
In a `FlatGroup` a rank keeps one contiguous range of the unit's concatenated parameters, so
its piece of a parameter may start or end inside a row: no DTensor placement can describe it.
Here each parameter is split the way `Shard(0)` splits it (rows in chunks of
ceil(rows / ranks), later ranks possibly short or empty), and a rank's shard of the group is the
concatenation of its chunk of every parameter, each padded to the full chunk size:

    rank r's shard:  [ chunk r of p0 | pad ][ chunk r of p1 | pad ] ...   (`shard_numel` long)

One all-gather of these equal shards still moves the whole group at once, into a scratch
buffer ordered rank after rank; a copy then lays each parameter out whole in the gather buffer
(parameter after parameter, as `split` reads it), and the compute views are taken there. The
reduction goes the other way: each parameter's full gradient is cut into the same row chunks.

In exchange for that copy, every parameter the user sees (outside a unit's compute: see [Note:
unsharded parameters]) is a real `DTensor` whose local tensor is a view into this rank's master
shard: `placements`, `to_local()`, `full_tensor()`, `state_dict()` (sharded, no communication),
torch.distributed.checkpoint, optimizers and `torch.nn.utils.clip_grad_norm_` all work through
torch's own code. Gradients are DTensors of the same layout, views into the gradient shard.

The parameters arrive already as DTensors (the front-end converts them when the user shards a
module, before any optimizer or initialisation code runs); building the group *adopts* them:
their local data is copied into the master and their `_local_tensor` is pointed at it, so the
Parameter objects the user holds stay the same.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fsdp_bridge.engine.flat_group import FlatGroup
from fsdp_bridge.engine.layout import gathered_form

# On a gathered parameter registered in place of a sharded one: that sharded parameter.
SHARDED_FORM = "_fsdp_bridge_sharded_form"


def chunk_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s chunk when `rows` rows are split as `Shard(0)`
    splits them (torch.chunk: ceil-sized chunks, the last ones short or empty)."""
    size = -(-rows // ranks) if rows else 0
    start = min(rank * size, rows)
    return start, min(size, rows - start)


class RowGroup(FlatGroup):
    # -- construction -------------------------------------------------------------------------

    def _init_layout(self) -> None:
        ranks, rank = self.comm.shard_size, self.comm.shard_rank
        # [Note: other shard dims] A parameter may be split along another dim d (FSDP2's
        # `shard_placement_fn` returning Shard(d)): its "rows" are then its slices along d, and
        # its chunk is the contiguous local tensor of shape[d] -> local rows. Chunks keep their
        # place in the shards; only the copies between a rank-ordered buffer and a full
        # parameter place them along d (see _place_along_dims, _flat_piece, shard_of).
        self.forms = [gathered_form(slot.param) for slot in self.slots]
        self.row_numels = []  # elements in one row (slice along the shard dim) of each parameter
        self.chunk_numels = []  # elements of one (padded) chunk of each parameter
        self.local_rows = []  # rows of each parameter held by this rank
        for slot, dim in zip(self.slots, (form.shard_dim for form in self.forms)):
            if len(slot.shape) == 0:
                raise ValueError(
                    f"fsdp_bridge: parameter {slot.fqn!r} is a scalar (shape ()); it cannot be "
                    "split by rows. Give it shape (1,), or pass it in ignored_params.")
            rows = slot.shape[dim]
            row = slot.numel // rows if rows else 0
            self.row_numels.append(row)
            self.chunk_numels.append((-(-rows // ranks) if rows else 0) * row)
            self.local_rows.append(chunk_rows(rows, ranks, rank)[1])
        # Offsets of each parameter's chunk inside a rank's shard.
        self.chunk_offsets = [sum(self.chunk_numels[:i]) for i in range(len(self.slots))]
        self.shard_numel = sum(self.chunk_numels)
        self.padded_numel = self.shard_numel * ranks
        # In a full (parameter after parameter) buffer, parameter i takes `ranks` chunks.
        self.offsets = [offset * ranks for offset in self.chunk_offsets]
        self._scratch: Optional[torch.Tensor] = None  # a gather in flight lands here

    def _build_master(self, device: torch.device, sync_module_states: bool) -> torch.Tensor:
        assert not sync_module_states, "row groups take DTensors; there is nothing to broadcast"
        dtype = self.slots[0].param.dtype
        master = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        for index, slot in enumerate(self.slots):
            local = self._checked_local(index)
            start = self.chunk_offsets[index]
            master[start : start + local.numel()].copy_(local.reshape(-1))
        return master

    def _local_shape(self, index: int, rows: Optional[int] = None) -> tuple:
        """Parameter `index`'s shape with `rows` (default: this rank's) along its shard dim."""
        shape = list(self.slots[index].shape)
        shape[self.forms[index].shard_dim] = self.local_rows[index] if rows is None else rows
        return tuple(shape)

    def _checked_local(self, index: int) -> torch.Tensor:
        slot = self.slots[index]
        local = getattr(slot.param, "_local_tensor", None)
        expected = self._local_shape(index)
        if local is None or tuple(local.shape) != expected:
            got = "a plain tensor" if local is None else f"local shape {tuple(local.shape)}"
            raise ValueError(
                f"fsdp_bridge: parameter {slot.fqn!r} must be a DTensor sharded over the shard "
                f"group on dim {self.forms[index].shard_dim} (local shape {expected}); got {got}. Assign parameters of "
                "a fully_shard-ed module only from DTensors of its layout (e.g. "
                "distribute_tensor(full, param.device_mesh, param.placements)).")
        return local.detach()

    def _values_of(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """The tensor holding parameter `index`'s values in its local tensor `local` (here the
        local tensor itself)."""
        return local

    def _register_local_params(self) -> list[torch.nn.Parameter]:
        for index in range(len(self.slots)):
            self._point_at_master(index)
        return [slot.param for slot in self.slots]

    def _point_at_master(self, index: int) -> None:
        slot = self.slots[index]
        param: Any = slot.param  # a DTensor
        param._local_tensor = self._master_view(index)
        for module, attr in slot.owners:
            module._parameters[attr] = slot.param

    def _master_view(self, index: int) -> torch.Tensor:
        return self._piece(self.master, index)

    def _piece(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s rows in a tensor laid out as this rank's shard."""
        start = self.chunk_offsets[index]
        rows = self.local_rows[index]
        return shard[start : start + rows * self.row_numels[index]].view(self._local_shape(index))

    def adopt_replaced_params(self) -> bool:
        """Take in parameters the user replaced since the group was built (`load_state_dict(
        assign=True)`, `module.to_empty()`): their values are copied into the master and
        they become views of it, as the ones they replaced were."""
        master_ptr = self.master.untyped_storage().data_ptr()
        for index, slot in enumerate(self.slots):
            module, attr = slot.owners[0]
            current = module._parameters.get(attr)
            local = getattr(current, "_local_tensor", None)
            # `module.to(...)` keeps the Parameter object but may swap its local tensor.
            if (current is slot.param and local is not None
                    and self._values_of(index, local).untyped_storage().data_ptr() == master_ptr):
                continue
            slot.param = current  # type: ignore[assignment]  # checked just below
            local = self._checked_local(index)
            if (local.dtype, local.device) != (self.master.dtype, self.master.device):
                raise ValueError(
                    f"fsdp_bridge: parameter {slot.fqn!r} became {local.dtype} on "
                    f"{local.device} after the model first ran, sharded in {self.master.dtype} "
                    f"on {self.master.device}. Cast or move the model before its first forward "
                    "(compute dtypes come from MixedPrecisionPolicy).")
            with torch.no_grad():
                self._master_view(index).copy_(local)
            self.local_params[index] = current  # type: ignore[assignment]
            self._point_at_master(index)
            self.invalidate()
        return False  # a change of dtype is refused above

    def compute_views(self, views) -> list:
        """The gathered views as modules compute with them: a tensor-parallel parameter's as
        the DTensor it was (see [Note: gathered form]); differentiable, so gradients reach the
        views as this rank's local gradients."""
        from torch.distributed.tensor import DTensor

        out = []
        for form, view in zip(self.forms, views):
            if form.data_parallel_dims:
                view = SpmdCompute.apply(view, form)
            elif form.compute_mesh is not None:
                view = DTensor.from_local(view, form.compute_mesh, form.compute_placements,
                                          run_check=False, shape=form.compute_shape,
                                          stride=form.compute_stride)
            out.append(view)
        return out

    # [Note: unsharded parameters] While a unit is gathered for compute (inside its forward,
    # kept gathered until its backward, or after an explicit unshard()), FSDP2 registers its
    # unsharded parameters on the modules, as plain nn.Parameters (DTensors over a tensor-
    # parallel mesh), and the sharded DTensors again when it reshards; code that checks a
    # parameter's type between forward and backward sees them. So do we. A forward's are its
    # differentiable views, marked as parameters but not detached (FSDP2's are leaves), so that
    # every gradient through them, a loss term reading `module.weight` after the forward
    # included, reaches the unit's reduction.

    @property
    def exposed(self) -> bool:
        """Whether the owner modules hold gathered parameters (not the sharded DTensors)."""
        module, attr = self.slots[0].owners[0]
        return hasattr(module._parameters.get(attr), SHARDED_FORM)

    def expose_full(self) -> None:
        """FSDP2's `unshard()`: the owner modules hold the gathered parameters (compute dtype)
        as ordinary Parameters until the gathered copy goes (`invalidate`)."""
        if self.exposed:
            return  # already held for compute
        self.wait_gather()
        views = self.compute_views(self.full_views())
        self._register([torch.nn.Parameter(view, requires_grad=self.requires_grad)
                        for view in views])

    # Registering is bookkeeping on Python objects: torch.compile runs it as Python (a graph
    # break), rather than tracing attribute writes on the tensors its graph produced.
    @torch.compiler.disable
    def show_views(self, views) -> None:
        self._register([_as_parameter(view) for view in self.compute_views(views)])

    def hide_views(self) -> None:
        self.hide_full()

    def invalidate(self) -> None:
        self.hide_full()
        super().invalidate()

    @torch.compiler.disable
    def hide_full(self) -> None:
        if self.exposed:  # back to the sharded DTensors
            for slot in self.slots:
                for module, attr in slot.owners:
                    module._parameters[attr] = slot.param

    def _register(self, gathered: list) -> None:
        for slot, param in zip(self.slots, gathered):
            setattr(param, SHARDED_FORM, slot.param)
            for module, attr in slot.owners:
                module._parameters[attr] = param

    def detach_params(self) -> None:
        """Give every parameter a local tensor of its own (the group is being dropped)."""
        for slot in self.slots:
            param: Any = slot.param  # a DTensor
            param._local_tensor = param._local_tensor.clone()

    # -- gathering ----------------------------------------------------------------------------

    def _gather_target(self) -> torch.Tensor:
        self._scratch = self._allocate_for_comm(self.custom_all_gather, self.padded_numel,
                                                self.compute_dtype)
        return self._scratch

    def _finish_gather(self) -> None:
        scratch = self._scratch
        if scratch is None:
            return
        self._scratch = None
        self._to_parameter_order(scratch, self.gathered_flat().data)

    def _to_parameter_order(self, by_rank: torch.Tensor, out: torch.Tensor) -> None:
        """Copy a gathered buffer (rank after rank) into `out` (parameter after parameter)."""
        ranks = self.comm.shard_size
        sizes = self.chunk_numels
        targets = [out[offset : offset + ranks * size].view(ranks, size)
                   for offset, size in zip(self.offsets, sizes)]
        torch.split_with_sizes_copy(by_rank.view(ranks, self.shard_numel), sizes, dim=1,
                                    out=targets)
        self._place_along_dims(by_rank, out)

    def _place_along_dims(self, by_rank: torch.Tensor, out: torch.Tensor) -> None:
        """Parameters split on a dim other than 0: their chunks, copied whole above, are
        placed again along that dim (see [Note: other shard dims])."""
        ranks = self.comm.shard_size
        rows_by_rank = by_rank.view(ranks, self.shard_numel)
        for index, dim in enumerate(form.shard_dim for form in self.forms):
            if dim == 0:
                continue
            slot = self.slots[index]
            full = out[self.offsets[index] : self.offsets[index] + slot.numel].view(slot.shape)
            for rank in range(ranks):
                start, rows = chunk_rows(slot.shape[dim], ranks, rank)
                at = self.chunk_offsets[index]
                chunk = rows_by_rank[rank, at : at + rows * self.row_numels[index]]
                full.narrow(dim, start, rows).copy_(chunk.view(self._local_shape(index, rows)))

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        by_rank = super().gather_full(shard)
        full = torch.empty_like(by_rank)
        self._to_parameter_order(by_rank, full)
        return full

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        rank = self.comm.shard_rank
        parts = []
        for index, (offset, size) in enumerate(zip(self.offsets, self.chunk_numels)):
            if self.forms[index].shard_dim == 0:
                parts.append(full[offset + rank * size : offset + (rank + 1) * size])
                continue
            slot = self.slots[index]
            mine = self._flat_piece(full[offset : offset + slot.numel].view(slot.shape), index,
                                    rank * size, 0)
            parts += [mine, full.new_zeros(size - mine.numel())]
        return torch.cat(parts) if parts else full[:0]

    # -- gradients ----------------------------------------------------------------------------

    def part_pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Rank `rank`'s part is its row chunk of every parameter, each padded to the chunk
        size (see [Note: row layout])."""
        pieces = []
        for index, (offset, size, numel) in enumerate(
                zip(self.chunk_offsets, self.chunk_numels, self.numels)):
            lo, hi = rank * size, min((rank + 1) * size, numel)
            if lo < hi:
                pieces.append((index, lo, hi, offset))
        return pieces

    def _flat_piece(self, grad: torch.Tensor, index: int, lo: int, hi: int) -> torch.Tensor:
        """The elements of a rank's chunk of parameter `index` that start at `lo` of the
        part-after-part layout, from its full-shaped `grad`: a slice of the flattened tensor
        on dim 0, the rank's slice along the dim otherwise (see [Note: other shard dims])."""
        dim = self.forms[index].shard_dim
        if dim == 0:
            return super()._flat_piece(grad, index, lo, hi)
        rank = lo // self.chunk_numels[index]
        start, rows = chunk_rows(grad.shape[dim], self.comm.shard_size, rank)
        return grad.narrow(dim, start, rows).reshape(-1)

    def _grad_of(self, index: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        param: Any = self.local_params[index]  # a DTensor
        assert self.grad_shard is not None
        local = self._piece(self.grad_shard, index)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    def local_range(self, index: int) -> tuple[int, int]:
        raise NotImplementedError(
            f"fsdp_bridge: {self.slots[index].fqn!r} is a row-sharded DTensor parameter "
            "(fully_shard); this operation handles FSDP1-style flat shards only. Use the "
            "DTensor API (full_tensor(), torch.distributed.checkpoint) instead.")


def _as_parameter(view: torch.Tensor) -> torch.Tensor:
    """`view` seen as a parameter, still attached to its autograd graph: a plain tensor as an
    `nn.Parameter`, a DTensor marked as `nn.Parameter(dtensor)` marks its result."""
    if type(view) is torch.Tensor:
        return view.as_subclass(torch.nn.Parameter)
    view._is_param = True
    return view


def register_sharded(module: torch.nn.Module) -> None:
    """Register the sharded parameters again where `module` holds gathered ones: a state dict
    taken or loaded while a unit is gathered is one of sharded DTensors, as under FSDP2 (the
    unit's next use registers its gathered parameters again)."""
    for attr, param in module._parameters.items():
        sharded = getattr(param, SHARDED_FORM, None)
        if sharded is not None:
            module._parameters[attr] = sharded


class SpmdCompute(torch.autograd.Function):
    """A gathered parameter as the DTensor it is on an SPMD mesh (FSDP2's `dp_mesh_dims`).
    Its gradient comes back Partial on the data-parallel dimensions when the inputs are split
    there: that is this rank's part of the sum the engine's reduction adds up, so only the
    other dimensions are redistributed to the parameter's placements (as FSDP2 keeps Partial
    on its data-parallel dims for its reduce-scatter), and the local tensor goes on."""

    @staticmethod
    def forward(ctx, local, form):
        from torch.distributed.tensor import DTensor

        ctx.form = form
        return DTensor.from_local(local, form.compute_mesh, form.compute_placements,
                                  run_check=False, shape=form.compute_shape,
                                  stride=form.compute_stride)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        form = ctx.form
        if isinstance(grad, DTensor):
            target = tuple(grad.placements[i] if i in form.data_parallel_dims else placement
                           for i, placement in enumerate(form.compute_placements))
            if target != tuple(grad.placements):
                grad = grad.redistribute(form.compute_mesh, target)
            grad = grad.to_local()
        return grad, None
