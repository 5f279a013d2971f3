"""A row group whose parameters use FSDP2's all-gather extension point.

[Note: all-gather extensions]
A parameter whose local tensor defines `fsdp_pre_all_gather` and `fsdp_post_all_gather`
(torchao's float8 weights, or hooks attached to a plain tensor object) decides what is
gathered and what modules compute with, as under FSDP2:

    inputs, metadata = local.fsdp_pre_all_gather(shard mesh[, full size, full stride, module,
                                                 mp_policy])          (torch's two signatures)
    first gather:  tensor, inner = local.fsdp_post_all_gather(outputs, metadata, param_dtype)
                   (modules compute with `tensor`, laid out as the full parameter)
    later gathers: local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=tensor)

where `outputs` are the pre-hook's inputs of every rank, concatenated along dim 0 rank after
rank, each in a tensor kept from gather to gather (the `out=` form relies on it: float8 keeps
its gathered data there and only swaps its scale). Between gathers the outputs and `inner`
tensors give their memory back (their storage is resized to zero, as FSDP2 frees them) and
get it again at the next gather.

The values of trainable parameters still live in the group's fp32 master, as in any row
group, so the optimizer, gradients, state dicts and checkpoints are unchanged: the parameter's local tensor
is rebuilt around its view of the master, of the same kind as the user's (a tensor subclass
through its `__tensor_flatten__` / `__tensor_unflatten__`, its first inner tensor being the
values, see [Note: twin inner tensors]; a plain tensor object keeps its identity and the hooks
attached to it, its data pointed at the master, see [Note: local tensors kept as objects]).
Gradients are reduced as in any row group, as plain tensors of the parameter's shape (see
[Note: tensor subclasses in collectives]). A parameter may split unevenly on dim 0 (see
[Note: uneven extension parameters]). Frozen parameters keep their own local tensors (see
[Note: frozen extension parameters]).

The inputs of all the group's parameters go in one all-gather, as bytes: inputs of several
dtypes (float8 data beside fp32 scales) share the buffer, as FSDP2 gathers them as uint8.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fsdp_bridge.engine.row_group import RowGroup


@dataclasses.dataclass
class LocalForm:
    """How a parameter's local tensor is rebuilt around a view of the master."""

    kind: type
    inner_name: Optional[str] = None  # a subclass: the inner tensor holding the values
    context: Any = None  # a subclass: what `__tensor_flatten__` returned beside the names
    twins: tuple = ()  # a subclass: its other inner tensors of the values' shape and dtype
    others: Optional[dict] = None  # a subclass: its other inner tensors, kept as they are
    kept: Optional[torch.Tensor] = None  # the user's tensor object, kept (see below)

    # [Note: local tensors kept as objects] Where the user's local tensor object itself must
    # stay, it is kept and its values (and twins) are pointed at the master's views in place:
    # a plain tensor carrying the hooks (its `.data`), a subclass whose hooks were attached
    # to the object rather than its class (bound to that object, they read its inner
    # tensors), and a subclass whose `__tensor_unflatten__` does not give back one of its kind
    # (FSDP2 never calls it: it builds local tensors through the subclass's own ops).

    @classmethod
    def of(cls, local: torch.Tensor, fqn: str) -> "LocalForm":
        if type(local) is torch.Tensor:
            return cls(torch.Tensor, kept=local)
        flatten = getattr(local, "__tensor_flatten__", None)
        if flatten is not None:
            names, context = flatten()
            values = getattr(local, names[0]) if names else None
            if (isinstance(values, torch.Tensor) and values.shape == local.shape
                    and values.dtype == local.dtype):
                inner = {name: getattr(local, name) for name in names[1:]}
                twins = tuple(name for name, tensor in inner.items()
                              if type(tensor) is torch.Tensor and _alike(tensor, values))
                others = {name: tensor for name, tensor in inner.items() if name not in twins}
                form = cls(type(local), names[0], context, twins, others)
                own_hooks = HOOKS & set(vars(local))
                if own_hooks or not isinstance(
                        form._unflatten(values, [inner[name] for name in twins]), form.kind):
                    form.kept = local
                return form
        raise NotImplementedError(
            f"fsdp_bridge: parameter {fqn!r} is a trainable {type(local).__name__} using "
            "FSDP2's all-gather extension whose values are not held by one inner tensor of its "
            "shape and dtype; fsdp_bridge keeps a trainable parameter's values in the engine's "
            "shard and supports extensions that wrap them (torchao's float8 weights, hooks "
            "attached to a plain tensor), and frozen parameters of any kind (NF4). Freeze it "
            "(requires_grad=False), or shard this model with torch's own "
            "torch.distributed.fsdp.fully_shard.")

    def values(self, local: torch.Tensor) -> torch.Tensor:
        """The plain tensor holding the parameter's values in `local`."""
        return local if self.inner_name is None else getattr(local, self.inner_name)

    def around(self, view: torch.Tensor, twins: list) -> torch.Tensor:
        """A local tensor of this form whose values are `view` and whose twin inner tensors
        are `twins` (views at the same place of buffers laid out as the master)."""
        if self.kept is None:
            return self._unflatten(view, twins)
        if self.inner_name is None:
            self.kept.data = view
        else:
            for name, tensor in zip((self.inner_name, *self.twins), (view, *twins)):
                setattr(self.kept, name, tensor)
        return self.kept

    def _unflatten(self, view: torch.Tensor, twins: list) -> Any:
        inner = {self.inner_name: view, **dict(zip(self.twins, twins)), **(self.others or {})}
        unflatten: Callable = getattr(self.kind, "__tensor_unflatten__")
        try:
            return unflatten(inner, self.context, view.size(), view.stride())
        except TypeError:  # another signature than the protocol's
            return None


HOOKS = frozenset({"fsdp_pre_all_gather", "fsdp_post_all_gather"})


def _as_plain(tensor: torch.Tensor) -> torch.Tensor:
    """[Note: tensor subclasses in collectives] FSDP2 copies all-gather inputs and gradients
    into plain buffers before its collectives. A tensor subclass among them (a TwoTensor's
    gradient, or a TwoTensor returned by a pre-all-gather hook) is written there through its
    own ops: for TwoTensor, which runs the copy on each inner tensor in turn, its second
    tensor's values. So it is copied here too; plain tensors and DTensors go on as they are."""
    from torch.distributed.tensor import DTensor

    if type(tensor) is torch.Tensor or isinstance(tensor, DTensor):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _alike(tensor: torch.Tensor, like: torch.Tensor) -> bool:
    return (tensor.shape, tensor.stride(), tensor.dtype) == (like.shape, like.stride(),
                                                             like.dtype)


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() > 0:
        storage.resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    size = int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
    storage = tensor.untyped_storage()
    if storage.nbytes() != size:
        storage.resize_(size)


class ExtensionGroup(RowGroup):
    # Set by the runtime after construction: torch's MixedPrecisionPolicy of the unit (the
    # pre-hook's `mp_policy`).
    mp_policy: Any = None

    def _init_layout(self) -> None:
        super()._init_layout()
        ranks = self.comm.shard_size
        self.local_forms = []
        if self.keeps_locals:  # see [Note: frozen extension parameters]
            count = len(self.slots)
            self.chunk_numels = self.chunk_offsets = self.offsets = [0] * count
            self.shard_numel = self.padded_numel = 0
        for index, (slot, form) in enumerate(zip(self.slots, self.forms)):
            local = slot.param._local_tensor  # type: ignore[attr-defined]  # a DTensor
            self._check_hooks(slot.fqn, local)
            if form.shard_dim != 0:
                raise NotImplementedError(
                    f"fsdp_bridge: parameter {slot.fqn!r} uses FSDP2's all-gather extension and "
                    f"is split on dim {form.shard_dim} of shape {tuple(slot.shape)} over "
                    f"{ranks} ranks; accepted: such parameters split on dim 0 (the pre-all-"
                    "gather outputs are gathered rank after rank along dim 0). Split it on "
                    "dim 0 (shard_placement_fn), or shard this model with torch's own "
                    "torch.distributed.fsdp.fully_shard.")
            if not self.keeps_locals:
                self.local_forms.append(LocalForm.of(local, slot.fqn))
        count = len(self.slots)
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(count)]
        self.unsharded: list[Optional[torch.Tensor]] = [None] * count
        self.inner: list[tuple] = [() for _ in range(count)]
        self._gathered_inputs: Optional[list] = None  # (metadata, sizes, dtypes) per param
        self._hook_meshes: dict[int, Any] = {}  # per param: see _shard_mesh (found once)
        # See [Note: uneven extension parameters]: checked on every rank once.
        self._padding_checked = not any(slot.shape[0] % ranks for slot in self.slots)

    @staticmethod
    def _check_hooks(fqn: str, local: torch.Tensor) -> None:
        if not all(hasattr(local, hook) for hook in HOOKS):
            raise AssertionError(
                f"fsdp_bridge: parameter {fqn!r}: both fsdp_pre_all_gather and "
                "fsdp_post_all_gather should be defined if using all-gather extensions (as "
                "FSDP2 asserts).")

    # [Note: frozen extension parameters] A frozen group needs no master: no optimizer writes
    # its values and no gradient is reduced. Its parameters keep their own local tensors, as
    # under FSDP2 (an NF4 weight stays NF4 blocks: a fp32 copy would cost eight times its
    # memory), and the hooks run on them.

    @property
    def keeps_locals(self) -> bool:
        return not self.requires_grad

    def adopt_replaced_params(self) -> bool:
        if not self.keeps_locals:
            return super().adopt_replaced_params()
        for index, slot in enumerate(self.slots):
            module, attr = slot.owners[0]
            current = module._parameters.get(attr)
            if current is not slot.param:  # load_state_dict(assign=True), to_empty()
                slot.param = current  # type: ignore[assignment]  # checked just below
                self._checked_local(index)
                self.local_params[index] = current  # type: ignore[assignment]
                self._point_at_master(index)
                self.invalidate()
        return False

    def _values_of(self, index: int, local: torch.Tensor) -> torch.Tensor:
        return self.local_forms[index].values(local)

    def _checked_local(self, index: int) -> torch.Tensor:
        local = super()._checked_local(index)
        if self.keeps_locals or self.local_forms[index].inner_name is None:
            return local
        return self.local_forms[index].values(local)

    # [Note: twin inner tensors] A subclass may hold its values more than once: torch's
    # TwoTensor runs every op on two inner tensors of the same shape, so an optimizer step
    # updates both, and it requires them to lie at the same storage offset. Such "twins" of the
    # values live in buffers laid out as the master (`twin_shards`, one per twin), each at the
    # master view's place, and are updated by the same ops as under FSDP2.

    def _build_master(self, device: torch.device, sync_module_states: bool) -> torch.Tensor:
        if self.keeps_locals:
            self.twin_shards: list[torch.Tensor] = []
            return torch.zeros(0, dtype=self.slots[0].param.dtype, device=device)
        master = super()._build_master(device, sync_module_states)
        twins = max((len(form.twins) for form in self.local_forms), default=0)
        self.twin_shards = [torch.zeros_like(master) for _ in range(twins)]
        return master

    def _point_at_master(self, index: int) -> None:
        slot = self.slots[index]
        param: Any = slot.param  # a DTensor
        if not self.keeps_locals:
            form = self.local_forms[index]
            twins = [self._piece(shard, index) for shard in self.twin_shards[:len(form.twins)]]
            with torch.no_grad():
                for name, twin in zip(form.twins, twins):
                    current = getattr(param._local_tensor, name)
                    if current.data_ptr() != twin.data_ptr():  # a new local tensor
                        twin.copy_(current)
            param._local_tensor = form.around(self._master_view(index), twins)
        for module, attr in slot.owners:
            module._parameters[attr] = slot.param

    # -- gradients ----------------------------------------------------------------------------

    def grads_to_reduce(self, grads: tuple) -> tuple:
        return tuple(None if grad is None else _as_plain(grad) for grad in grads)

    # -- gathering ----------------------------------------------------------------------------

    def _shard_mesh(self, index: int):
        """The mesh the pre-hook is given, as FSDP2 gives it: the 1-D mesh of the shard group
        (of the replicate group under replication alone, FSDP2's DDP mesh).

        [Note: the shard dimension of a parameter's mesh] Where the shard dimension sits in the
        parameter's mesh depends on the layout: the only one of a 1-D mesh, the last of HSDP's
        (replicate, shard), the first of FSDP + TP's (dp, tp), the middle of HSDP + TP's
        (replicate, shard, tp), anywhere `dp_mesh_dims` names it in an SPMD mesh (several shard
        names being flattened into one dimension in their place). So it is found by the ranks of
        its process group (those this group gathers over; the front-end may have built its own
        group object over them), rather than by its position."""
        if index not in self._hook_meshes:
            self._hook_meshes[index] = self._find_shard_mesh(index)
        return self._hook_meshes[index]

    def _find_shard_mesh(self, index: int):
        mesh = self.slots[index].param.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim == 1:
            return mesh
        group = self.comm.shard_group or self.comm.replicate_group
        ranks = dist.get_process_group_ranks(group)
        names = [name for dim, name in enumerate(mesh.mesh_dim_names or ())
                 if dist.get_process_group_ranks(mesh.get_group(dim)) == ranks]
        if not names:
            raise NotImplementedError(
                f"fsdp_bridge: parameter {self.slots[index].fqn!r} uses FSDP2's all-gather "
                f"extension on mesh {mesh}, none of whose dimensions holds the ranks {ranks} it "
                "is gathered over (FSDP2 hands that dimension's 1-D mesh to its "
                "fsdp_pre_all_gather). Shard it over one dimension of its own mesh, or use "
                "torch's own torch.distributed.fsdp.fully_shard.")
        # Only a group of one rank can match several dimensions (all of one rank): the shard
        # dimension is then the last of them that is not a compute (tensor-parallel) one.
        form = self.forms[index]
        if len(names) > 1 and form.compute_mesh is not None:
            computing = {name for dim, name in enumerate(form.compute_mesh.mesh_dim_names)
                         if dim not in form.data_parallel_dims}
            names = [name for name in names if name not in computing] or names
        return mesh[names[-1]]

    def _pre_all_gather(self, index: int, local: torch.Tensor):
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        count = len(inspect.signature(hook).parameters)
        if count not in (1, 5):
            raise AssertionError(
                f"fsdp_bridge: invalid fsdp_pre_all_gather {inspect.signature(hook)} of "
                f"parameter {self.slots[index].fqn!r}: expected fsdp_pre_all_gather(self, mesh, "
                "outer_size, outer_stride, module, mp_policy) or fsdp_pre_all_gather(self, "
                "mesh), as FSDP2.")
        mesh = self._shard_mesh(index)
        if count == 1:
            return hook(mesh)
        shape = self.slots[index].shape
        stride = torch.empty(shape, device="meta").stride()
        return hook(mesh, shape, stride, self.slots[index].owners[0][0], self.mp_policy)

    def start_gather(self) -> None:
        assert self.buffer is not None and self.buffer.owner in (None, self)
        self.buffer.owner = self
        described, pieces = [], []
        for index, param in enumerate(self.local_params):
            inputs, metadata = self._pre_all_gather(index, param._local_tensor)  # type: ignore
            described.append((metadata, [t.size() for t in inputs], [t.dtype for t in inputs]))
            pieces += [_as_plain(t.detach()).contiguous().view(-1).view(torch.uint8)
                       for t in inputs]
        self._check_padding([sizes for _, sizes, _ in described])
        mine = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8,
                                                            device=self.device)
        self._scratch = self._allocate_for_comm(self.custom_all_gather,
                                                mine.numel() * self.comm.shard_size, torch.uint8)
        self._gathered_inputs = described
        self.pending_gather = self._all_gather(self._scratch, mine)

    # [Note: uneven extension parameters] A parameter whose rows do not divide by the shard
    # group is split as FSDP2 splits it: chunks of ceil(rows / ranks) rows, the last ones short
    # or empty. As under FSDP2, its pre-all-gather hook is given the full size (`outer_size`)
    # and must return inputs padded to the full chunk size, so that every rank sends as many
    # bytes; the post-all-gather hook then receives outputs of ranks * chunk rows, of which
    # the parameter is the first rows. Where a hook returns unpadded inputs, FSDP2 raises on
    # the ranks that hold short chunks and the others wait in the all-gather; here every rank
    # exchanges what it found before the group's first all-gather, and all of them raise,
    # naming the parameter. Later gathers check on each rank only (the hooks return the same
    # sizes from gather to gather), sparing a collective per gather.

    def _padded_size(self, index: int) -> torch.Size:
        shape = self.slots[index].shape
        return torch.Size((-(-shape[0] // self.comm.shard_size), *shape[1:]))

    def _check_padding(self, sizes: list) -> None:
        ranks, rank = self.comm.shard_size, self.comm.shard_rank
        unpadded = [self.local_rows[index] != self._padded_size(index)[0]
                    and any(size != self._padded_size(index) for size in sizes[index])
                    for index in range(len(self.slots))]
        by_rank = [[rank] if bad else [] for bad in unpadded]
        if not self._padding_checked:
            flags = torch.zeros(len(self.slots), ranks, dtype=torch.int32, device=self.device)
            flags[:, rank] = torch.tensor(unpadded, dtype=torch.int32)
            self.comm.all_reduce_shards(flags, op=dist.ReduceOp.MAX)
            by_rank = [row.nonzero().view(-1).tolist() for row in flags.cpu()]
            self._padding_checked = True
        for index, bad_ranks in enumerate(by_rank):
            if bad_ranks:
                slot = self.slots[index]
                here = f" (here: {[tuple(size) for size in sizes[index]]})" if unpadded[index] \
                    else ""
                raise AssertionError(
                    f"fsdp_bridge: parameter {slot.fqn!r} is unevenly sharded by FSDP (orig "
                    f"size={slot.shape}, FSDP world size={ranks}): fsdp_pre_all_gather must "
                    "return all-gather inputs with the padded sharded size "
                    f"{self._padded_size(index)}, as under FSDP2, but rank(s) {bad_ranks} of "
                    f"the shard group returned other sizes{here}. Pad each input on dim 0 to "
                    "ceil(outer_size[0] / mesh.size()) rows.")

    def _finish_gather(self) -> None:
        scratch, described = self._scratch, self._gathered_inputs
        if scratch is None or described is None:
            return
        self._scratch = self._gathered_inputs = None
        ranks = self.comm.shard_size
        by_rank = scratch.view(ranks, -1)
        at = 0
        for index, (metadata, sizes, dtypes) in enumerate(described):
            outputs = self._outputs_for(index, sizes, dtypes)
            for output in outputs:
                width = output.numel() * output.element_size() // ranks
                # `.data`: the copy leaves the outputs' version counters alone (autograd saved
                # the compute tensor, which may view them, for backward).
                output.data.view(-1).view(torch.uint8).view(ranks, width).copy_(
                    by_rank[:, at:at + width])
                at += width
            self._post_all_gather(index, outputs, sizes, metadata)

    def _outputs_for(self, index: int, sizes, dtypes) -> list[torch.Tensor]:
        """Parameter `index`'s all-gather outputs, the same tensors from gather to gather."""
        numels = [torch.Size(size).numel() * self.comm.shard_size for size in sizes]
        kept = self.outputs[index]
        if [(t.numel(), t.dtype) for t in kept] != list(zip(numels, dtypes)):
            kept = self.outputs[index] = [torch.empty(numel, dtype=dtype, device=self.device)
                                          for numel, dtype in zip(numels, dtypes)]
            self.unsharded[index] = None  # rebuilt around the new outputs
        for tensor in kept:
            _allocate(tensor)
        return kept

    def _post_all_gather(self, index: int, outputs, sizes, metadata) -> None:
        local: Any = self.local_params[index]._local_tensor  # type: ignore[attr-defined]
        gathered = tuple(t.view(-1, *size[1:]) for t, size in zip(outputs, sizes))
        dtype = self.compute_dtype
        if self.unsharded[index] is None:
            tensor, inner = local.fsdp_post_all_gather(gathered, metadata, dtype)
            shape = self.slots[index].shape
            stride = torch.empty(shape, device="meta").stride()
            self.unsharded[index] = torch.as_strided(tensor, shape, stride, storage_offset=0)
            self.inner[index] = tuple(inner)
            return
        for tensor in self.inner[index]:
            _allocate(tensor)
        local.fsdp_post_all_gather(gathered, metadata, dtype, out=self.unsharded[index])

    def full_views(self) -> list[torch.Tensor]:
        views = []
        for tensor in self.unsharded:
            assert tensor is not None, "gathered before use"
            views.append(tensor.view_as(tensor))
        return views

    def invalidate(self) -> None:
        """Give the gathered tensors' memory back (FSDP2's free_storage): the next gather
        allocates it again, in the same tensors."""
        super().invalidate()
        for index in range(len(self.slots)):
            for tensor in (*self.outputs[index], *self.inner[index]):
                _free(tensor)
