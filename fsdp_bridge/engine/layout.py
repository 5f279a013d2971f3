"""Which parameter goes into which flat group: a pure function of the model and the Plan.

A unit (a module named in the Plan) owns the parameters used only inside it, minus those of
inner units; a parameter used in several places (tied weights) goes to the innermost unit that
contains every use. Norm-group parameters go to the root unit, which stays gathered for the
whole step. Within a unit, parameters are split into flat groups by (requires_grad, dtype), so
frozen parameters never get gradient memory and one flat buffer has one dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from fsdp_bridge.plan import Plan

# On a DTensor parameter a front-end sharded: its GatheredForm (see below).
GATHERED_FORM = "_fsdp_bridge_gathered_form"
# On each local parameter: a weakref to its ShardedModel (see ownership.py); here so that the
# rollback can recognise the engine's parameters without importing the runtime.
OWNER_ATTRIBUTE = "_fsdp_bridge_owner"
# On a unit's flat parameter (see engine/flat_params.py): the original parameters it stands for,
# which the modules no longer register; here so that the rollback records them too.
HIDDEN_ORIGINALS = "_fsdp_bridge_originals"
# torch FSDP1's mark of a parameter already flattened into an FSDP unit, on every parameter the
# engine shards: see [Note: flattened, as torch's FSDP1 reads it] in flat_group.py. Written out,
# not imported from torch's private module (which may move).
FLATTENED_MARK = "_fsdp_flattened"


@dataclasses.dataclass(frozen=True)
class GatheredForm:
    """What the shard group's pieces of a DTensor parameter make up once gathered, and how
    modules compute with it.

    [Note: gathered form] Without tensor parallelism a parameter gathers into its full tensor,
    split on `shard_dim`. With it (a parameter that was already a DTensor on a tensor-parallel
    mesh before data-parallel sharding) the shard group gathers this rank's tensor-parallel
    local tensor, of `shape`, and modules compute with it as the DTensor it was:
    `compute_mesh` / `compute_placements`."""

    shape: torch.Size
    shard_dim: int = 0
    compute_mesh: Optional[Any] = None  # a DeviceMesh, for tensor-parallel parameters
    compute_placements: tuple = ()
    compute_shape: Optional[torch.Size] = None  # the tensor-parallel DTensor's global shape
    compute_stride: Optional[tuple] = None
    # Dimensions of `compute_mesh` that are data-parallel (FSDP2's `dp_mesh_dims`): a gradient
    # arriving Partial on them is this rank's part of the sum the engine reduces, taken as it is
    # (see engine/row_group.py, SpmdCompute).
    data_parallel_dims: tuple = ()
    # The data-parallel DeviceMesh of a parameter sharded over a mesh of its own (FSDP2's
    # per-parameter mesh, e.g. experts over an expert-data-parallel mesh): 1-D (its shard group)
    # or 2-D (replicate, shard). None: the model's groups. See [Note: groups over other meshes].
    shard_mesh: Optional[Any] = None


def gathered_form(param: torch.Tensor) -> GatheredForm:
    """`param`'s GatheredForm: the one its front-end attached, else its own full shape."""
    form = getattr(param, GATHERED_FORM, None)
    return form if form is not None else GatheredForm(param.shape)


def state_dict_key(fqn: str) -> str:
    """`fqn` as state dicts name it: without the child that torch's activation-checkpointing
    wrappers (`checkpoint_wrapper`, `offload_wrapper`) insert. Their own state-dict hooks,
    native FSDP1 and torch's state-dict helpers all leave it out, so checkpoints load whether
    or not checkpointing was applied, and applied before or after the wrap."""
    return fqn.replace(_CHECKPOINT_PREFIX, "")


@dataclasses.dataclass
class ParamSlot:
    """One original parameter and every (module, attribute) that refers to it."""

    fqn: str  # canonical name, the first one `named_parameters()` gives
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]  # all (module, attribute name) holding it
    owner_fqns: list[str]  # the FQN of each owner entry, for state dicts
    # Recorded up front: the original parameter's storage is released once it is flattened.
    shape: torch.Size = dataclasses.field(init=False)
    numel: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.shape = gathered_form(self.param).shape
        self.numel = self.shape.numel()

    @property
    def state_key(self) -> str:
        """The canonical name in state dicts (see `state_dict_key`)."""
        return state_dict_key(self.fqn)

    @property
    def state_keys(self) -> list[str]:
        """Every name of the parameter in state dicts (tied weights have several)."""
        return [state_dict_key(fqn) for fqn in self.owner_fqns]

    def refresh(self) -> None:
        """Follow a parameter replaced on its module since the layout was made (a
        `param_init_fn` may assign new Parameters while materialising)."""
        module, attr = self.owners[0]
        current = module._parameters.get(attr)
        if current is not None:
            self.param = current


# FSDP2's all-gather extension point: a parameter whose local tensor defines these chooses what
# is gathered and how the gathered pieces become the tensor modules compute with (torchao's
# float8 weights). See fsdp_bridge/engine/extension_group.py.
ALL_GATHER_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def has_all_gather_extension(param: torch.Tensor) -> bool:
    """Whether `param` is a DTensor parameter (FSDP2's layout; the flat layouts of FSDP1 and
    the others flatten every parameter, as theirs do) whose local tensor defines either hook:
    as a tensor subclass's methods, or attached to the tensor object itself."""
    local = getattr(param, "_local_tensor", None)
    return local is not None and any(hasattr(local, hook) for hook in ALL_GATHER_HOOKS)


@dataclasses.dataclass
class GroupLayout:
    unit_name: str
    requires_grad: bool
    dtype: torch.dtype
    slots: list[ParamSlot]
    # The group's parameters use the all-gather extension (a group of their own).
    extension: bool = False
    # The data-parallel mesh the group is sharded over when it is not the model's (see
    # GatheredForm.shard_mesh); None: the model's shard and replicate groups.
    mesh: Optional[Any] = None


# [Note: groups over other meshes] FSDP2 lets `shard_placement_fn` give a parameter a mesh of its
# own (`ShardPlacementResult`: expert parallelism beside data parallelism shards the experts over
# an expert-data-parallel mesh, the rest over the data-parallel one). Such parameters form flat
# groups of their own within their unit, one per mesh: each is gathered over its own shard
# group, reduced over it (and all-reduced over its replicate group), and its gradients are
# averaged over its own data-parallel size, as FSDP2 averages each of its parameter groups.

GroupKey = tuple[bool, torch.dtype, bool, Optional[Any]]


def _group_key(slot: ParamSlot) -> GroupKey:
    return (slot.param.requires_grad, slot.param.dtype, has_all_gather_extension(slot.param),
            gathered_form(slot.param).shard_mesh)


def _key_of(layout: GroupLayout) -> GroupKey:
    return (layout.requires_grad, layout.dtype, layout.extension, layout.mesh)


def _collect_params(model: nn.Module) -> list[ParamSlot]:
    """Every distinct parameter with all its owners, in `named_parameters()` order."""
    by_id: dict[int, ParamSlot] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{module_name}.{attr}" if module_name else attr
            slot = by_id.get(id(param))
            if slot is None:
                by_id[id(param)] = ParamSlot(fqn, param, [(module, attr)], [fqn])
                continue
            # A module registered at two paths gives one owner but two names.
            if not any(m is module and a == attr for m, a in slot.owners):
                slot.owners.append((module, attr))
            slot.owner_fqns.append(fqn)
    return list(by_id.values())


def _module_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _is_within(module_name: str, unit_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def innermost_common_unit(module_names: list[str], unit_names: list[str]) -> str:
    """The deepest unit containing every module in `module_names` (the root always does)."""
    best = ""
    for unit in unit_names:
        if all(_is_within(name, unit) for name in module_names) and len(unit) > len(best):
            best = unit
    return best


def assign_groups(model: nn.Module, plan: Plan) -> list[GroupLayout]:
    """Split the model's parameters into flat groups, in unit order (post-order, root last)."""
    unit_names = list(plan.unit_names)
    ignored = set(plan.ignored_params)
    norm_modules = set(plan.norm_modules)
    per_unit: dict[str, list[ParamSlot]] = {name: [] for name in unit_names}
    for slot in _collect_params(model):
        if any(fqn in ignored for fqn in slot.owner_fqns):
            continue
        modules = [_module_of(fqn) for fqn in slot.owner_fqns]
        if all(name in norm_modules for name in modules):
            per_unit[""].append(slot)
        else:
            per_unit[innermost_common_unit(modules, unit_names)].append(slot)
    groups: list[GroupLayout] = []
    for unit_name in unit_names:
        keyed: dict[GroupKey, list[ParamSlot]] = {}
        for slot in per_unit[unit_name]:
            keyed.setdefault(_group_key(slot), []).append(slot)
        # Trainable groups first so a unit's main buffer is the one with gradients.
        for key, slots in sorted(keyed.items(), key=lambda kv: not kv[0][0]):
            groups.append(GroupLayout(unit_name, key[0], key[1], slots, key[2], key[3]))
    return groups


def describe_layout(groups: list[GroupLayout]) -> str:
    """Text of the layout (names, shapes, dtypes) for the cross-rank fingerprint."""
    lines = []
    for group in groups:
        extension = " all-gather extension" if group.extension else ""
        # The mesh's shape and names, which every rank shares (its ranks differ by rank).
        mesh = (f" over mesh {tuple(group.mesh.shape)} {group.mesh.mesh_dim_names}"
                if group.mesh is not None else "")
        lines.append(f"[{group.unit_name or '<root>'} grad={group.requires_grad} {group.dtype}"
                     f"{extension}{mesh}]")
        lines.extend(f"  {slot.fqn} {_agreed_shape(slot)}" for slot in group.slots)
    return "\n".join(lines)


def _agreed_shape(slot: ParamSlot) -> str:
    """The shape every rank must agree on. A tensor-parallel parameter's local tensor may
    legitimately differ by rank (an uneven split: (5, 3) on one rank, (4, 3) on its peer), so
    its global shape and placements are what ranks compare."""
    form = gathered_form(slot.param)
    if form.compute_shape is None:
        return str(tuple(slot.shape))
    return f"{tuple(form.compute_shape)} as {form.compute_placements}"


# [Note: ties broken on materialising] `to_empty` gives every module a Parameter of its own, so
# weights tied on the meta device are no longer tied once their modules are materialised (FSDP1
# too): each is initialised, flattened and trained on its own. After a unit is materialised, a
# slot whose owners now hold different parameters is split: the owners that hold the first
# owner's parameter keep the slot, every other parameter gets a slot in the unit just
# materialised (its modules were in that unit's region).


def split_untied(model: nn.Module, layouts: list[GroupLayout], unit_name: str,
                 unit_names: list[str]) -> list[list[str]]:
    """Split the slots whose tie materialising `unit_name` broke (see [Note: ties broken on
    materialising]); `layouts` is updated in place. Returns the names of each split tie."""
    broken = []
    for layout in list(layouts):
        for slot in list(layout.slots):
            by_param: dict[int, list[str]] = {}
            for fqn in slot.owner_fqns:
                module_name, _, attr = fqn.rpartition(".")
                current = model.get_submodule(module_name)._parameters.get(attr)
                by_param.setdefault(id(current), []).append(fqn)
            if len(by_param) < 2:
                continue
            broken.append(list(slot.owner_fqns))
            first, *others = by_param.values()
            slot.owners, slot.owner_fqns = _owners(model, first), first
            for fqns in others:
                if innermost_common_unit([_module_of(f) for f in fqns], unit_names) != unit_name:
                    raise ValueError(
                        f"materialising unit {unit_name or '<root>'!r} gave {fqns[0]!r} a new "
                        "parameter of its own, outside that unit's modules. Materialise only the "
                        "module param_init_fn is given, e.g. `lambda m: m.to_empty(device=device, "
                        "recurse=False)` followed by its init.")
                owners = _owners(model, fqns)
                param = owners[0][0]._parameters[owners[0][1]]
                assert param is not None  # it replaced the tied parameter
                new = ParamSlot(fqns[0], param, owners, fqns)
                _layout_for(layouts, new, unit_name, unit_names).slots.append(new)
    return broken


def _owners(model: nn.Module, fqns: list[str]) -> list[tuple[nn.Module, str]]:
    owners: list[tuple[nn.Module, str]] = []
    for fqn in fqns:
        module_name, _, attr = fqn.rpartition(".")
        module = model.get_submodule(module_name)
        if not any(m is module and a == attr for m, a in owners):
            owners.append((module, attr))
    return owners


def _layout_for(layouts: list[GroupLayout], slot: ParamSlot, unit_name: str,
                unit_names: list[str]) -> GroupLayout:
    """`unit_name`'s group for `slot`'s (requires_grad, dtype), added in unit order if new."""
    key = _group_key(slot)
    for layout in layouts:
        if layout.unit_name == unit_name and _key_of(layout) == key:
            return layout
    new = GroupLayout(unit_name, key[0], key[1], [], key[2], key[3])
    order = unit_names.index(unit_name)
    later = [i for i, layout in enumerate(layouts) if unit_names.index(layout.unit_name) > order]
    layouts.insert(later[0] if later else len(layouts), new)
    return new
