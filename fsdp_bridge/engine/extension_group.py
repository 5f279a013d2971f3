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
values; a plain tensor object keeps its identity and the hooks attached to it, its data
pointed at the master). Gradients reach the group as plain tensors of the parameter's shape
(a float8 weight's gradient is computed in high precision) and are reduced as in any row
group. Frozen parameters keep their own local tensors (see [Note: frozen extension
parameters]).

The inputs of all the group's parameters go in one all-gather, as bytes: inputs of several
dtypes (float8 data beside fp32 scales) share the buffer, as FSDP2 gathers them as uint8.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch

from fsdp_bridge.engine.row_group import RowGroup


@dataclasses.dataclass
class LocalForm:
    """How a parameter's local tensor is rebuilt around a view of the master."""

    kind: type
    inner_name: Optional[str] = None  # a subclass: the inner tensor holding the values
    context: Any = None  # a subclass: what `__tensor_flatten__` returned beside the names
    others: Optional[dict] = None  # a subclass: its other inner tensors, kept as they are
    plain: Optional[torch.Tensor] = None  # a plain tensor object carrying the hooks

    @classmethod
    def of(cls, local: torch.Tensor, fqn: str) -> "LocalForm":
        if type(local) is torch.Tensor:
            return cls(torch.Tensor, plain=local)
        flatten = getattr(local, "__tensor_flatten__", None)
        if flatten is not None:
            names, context = flatten()
            values = getattr(local, names[0]) if names else None
            if (isinstance(values, torch.Tensor) and values.shape == local.shape
                    and values.dtype == local.dtype):
                others = {name: getattr(local, name) for name in names[1:]}
                return cls(type(local), names[0], context, others)
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

    def around(self, view: torch.Tensor) -> torch.Tensor:
        """A local tensor of this form whose values are `view`."""
        if self.plain is not None:
            self.plain.data = view  # the same object: the hooks attached to it stay
            return self.plain
        inner = {self.inner_name: view, **(self.others or {})}
        unflatten: Callable = getattr(self.kind, "__tensor_unflatten__")
        return unflatten(inner, self.context, view.size(), view.stride())


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
            if form.shard_dim != 0 or slot.shape[0] % ranks:
                raise NotImplementedError(
                    f"fsdp_bridge: parameter {slot.fqn!r} uses FSDP2's all-gather extension and "
                    f"is split on dim {form.shard_dim} of shape {tuple(slot.shape)} over "
                    f"{ranks} ranks; accepted: such parameters split evenly on dim 0 (FSDP2 "
                    "requires the pre-all-gather outputs of an uneven split to be padded, which "
                    "torchao's float8 weights do not do). Choose sizes that divide by the "
                    "shard group.")
            if not self.keeps_locals:
                self.local_forms.append(LocalForm.of(local, slot.fqn))
        count = len(self.slots)
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(count)]
        self.unsharded: list[Optional[torch.Tensor]] = [None] * count
        self.inner: list[tuple] = [() for _ in range(count)]
        self._gathered_inputs: Optional[list] = None  # (metadata, sizes, dtypes) per param

    @staticmethod
    def _check_hooks(fqn: str, local: torch.Tensor) -> None:
        if not all(hasattr(local, hook) for hook in ("fsdp_pre_all_gather",
                                                     "fsdp_post_all_gather")):
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

    def _build_master(self, device: torch.device, sync_module_states: bool) -> torch.Tensor:
        if self.keeps_locals:
            return torch.zeros(0, dtype=self.slots[0].param.dtype, device=device)
        return super()._build_master(device, sync_module_states)

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

    def _point_at_master(self, index: int) -> None:
        slot = self.slots[index]
        param: Any = slot.param  # a DTensor
        if not self.keeps_locals:
            param._local_tensor = self.local_forms[index].around(self._master_view(index))
        for module, attr in slot.owners:
            module._parameters[attr] = slot.param

    # -- gathering ----------------------------------------------------------------------------

    def _shard_mesh(self, index: int):
        """The mesh the pre-hook is given, as FSDP2 gives it: the shard group's 1-D mesh."""
        mesh = self.slots[index].param.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim == 1:
            return mesh
        dim = 0 if self.forms[index].compute_mesh is not None else mesh.ndim - 1
        return mesh[mesh.mesh_dim_names[dim]]

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
            pieces += [t.detach().contiguous().view(-1).view(torch.uint8) for t in inputs]
        mine = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8,
                                                            device=self.device)
        self._scratch = self._allocate_for_comm(self.custom_all_gather,
                                                mine.numel() * self.comm.shard_size, torch.uint8)
        self._gathered_inputs = described
        self.pending_gather = self._all_gather(self._scratch, mine)

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
