"""What happens once, before sharding: materialising meta modules, agreeing on the plan across
ranks, and preparing module buffers (dtype, rank 0's values)."""

from __future__ import annotations

import collections
import difflib
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.engine.comm import Comm
from fsdp_bridge.engine.device import backends_of, collective_device
from fsdp_bridge.engine.layout import gathered_form, innermost_common_unit
from fsdp_bridge.plan import ParamLayout, Plan


def warn_unhonoured_offload(plan: Plan, device: torch.device) -> None:
    """CPU offload is implemented for flat parameters; fully_shard's DTensor parameters stay
    on an accelerator. Say so rather than pretend. (On a CPU device nothing moves anyway.)"""
    if plan.cpu_offload and device.type != "cpu" and plan.param_layout is ParamLayout.ROWS:
        warnings.warn(
            f"fsdp_bridge ({plan.frontend}): CPU offload is not implemented yet for "
            f"fully_shard's DTensor parameters; the master shards and their gradients stay "
            f"on {device}. Numerics are the same; memory on the device is not reduced. Drop "
            "the offload setting to silence this warning.",
            stacklevel=3)


def _needs_materialising(region: list[tuple[str, nn.Module]], ignored_params: set[str]) -> bool:
    """Whether a region holds a meta buffer, or a meta parameter other than `ignored_params`
    (names): FSDP1's test."""
    for prefix, submodule in region:
        if any(buffer.is_meta for buffer in submodule.buffers(recurse=False)):
            return True
        if any(param.is_meta and (f"{prefix}.{name}" if prefix else name) not in ignored_params
               for name, param in submodule.named_parameters(recurse=False)):
            return True
    return False


def _named_states(module: nn.Module):
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def function_name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


# [Note: a unit at a time]
# The engine never holds the whole unsharded model: each unit, in the Plan's order (inner units
# first, the root last), is materialised, moved, broadcast, flattened and sharded, and its full
# parameters are freed before the next unit is touched, as native FSDP1 and FSDP2 do. A unit
# materialises its *region*: the modules whose innermost enclosing unit it is (the modules of
# inner units were materialised with them, before).


def unit_regions(module: nn.Module, unit_names,
                 ignored_modules=()) -> dict[str, list[tuple[str, nn.Module]]]:
    """Each unit's region (see [Note: a unit at a time]) in breadth-first order from the unit's
    module, the order in which FSDP1 materialises (so the RNG draws of `reset_parameters` and
    of `param_init_fn` land on the same tensors as natively). `ignored_modules` (names) and
    the modules inside them belong to no region: as in FSDP1 they are left as they are (not
    materialised, initialised, moved, cast nor broadcast), and the user's own initialisation
    after the wrap draws the same random numbers as natively."""
    names = {id(submodule): name for name, submodule in module.named_modules()}
    skipped = {id(module.get_submodule(name)) for name in ignored_modules}
    regions: dict[str, list[tuple[str, nn.Module]]] = {name: [] for name in unit_names}
    for submodule in _breadth_first(module, skipped):
        name = names[id(submodule)]
        regions[innermost_common_unit([name], list(unit_names))].append((name, submodule))
    return regions


def materialisation_regions(module: nn.Module, unit_names,
                            ignored_modules=()) -> dict[str, list[tuple[str, nn.Module]]]:
    """The modules each unit materialises and initialises, breadth-first (see `unit_regions`).
    FSDP1 skips ignored modules only in the wrapper they were given to (the root): the units
    its auto-wrap policy makes are given the ignored parameters, not the modules, so an ignored
    module inside such a unit is materialised with it, in its breadth-first place (and
    `param_init_fn` is called on it), though it is then neither flattened nor cast."""
    unit_names = list(unit_names)
    in_root = tuple(name for name in ignored_modules
                    if innermost_common_unit([name], unit_names) == "")
    return unit_regions(module, unit_names, in_root)


def still_ignored_params(module: nn.Module, unit_names, ignored_modules,
                         ignored_params) -> tuple[str, ...]:
    """The names of `ignored_params` that FSDP1 still leaves alone once the model is
    materialised. FSDP1 knows ignored parameters by identity, and materialising gives a meta
    parameter a new one (`to_empty` makes a new Parameter): an ignored parameter on meta in a
    module its unit materialises (see `materialisation_regions`) is sharded like any other."""
    ignored = set(ignored_params)
    materialised: set[str] = set()
    for region in materialisation_regions(module, unit_names, ignored_modules).values():
        if not _needs_materialising(region, ignored):
            continue
        materialised.update(f"{prefix}.{name}" if prefix else name
                            for prefix, submodule in region
                            for name, param in submodule.named_parameters(recurse=False)
                            if param.is_meta)
    return tuple(name for name in ignored_params if name not in materialised)


def _breadth_first(module: nn.Module, skipped: set[int]) -> list[nn.Module]:
    """`module` and its descendants, breadth-first, not entering the modules in `skipped`
    (ids)."""
    order, queue, seen = [], collections.deque([module]), {id(module)}
    while queue:
        current = queue.popleft()
        order.append(current)
        for child in current.children():
            if id(child) not in seen and id(child) not in skipped:
                seen.add(id(child))
                queue.append(child)
    return order


def materialize_region(
    region: list[tuple[str, nn.Module]], device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]], ignored_params=(),
) -> tuple[bool, Optional[Exception]]:
    """Give storage to one region whose modules hold meta parameters or buffers, as FSDP1
    does: `param_init_fn` on every module of the region, containers included, breadth-first;
    without one, `to_empty(device, recurse=False)` and `reset_parameters()` on every module that
    has parameters or buffers of its own (one without `reset_parameters` is refused, as FSDP1
    refuses it). Returns whether anything was materialised, and what the initialisation raised
    (not raised here: every rank first learns whether the others failed too, see
    `agree_on_unit`). As in FSDP1, meta `ignored_params` (names) alone do not call for
    materialising."""
    if not _needs_materialising(region, set(ignored_params)):
        return False, None
    try:
        if param_init_fn is not None:
            for _, submodule in region:
                param_init_fn(submodule)
            return True, None
        with torch.no_grad():
            for name, submodule in region:
                if next(_named_states(submodule), None) is None:
                    continue
                submodule.to_empty(device=device, recurse=False)
                _reset(name, submodule)
    except Exception as error:  # noqa: BLE001 - re-raised by agree_on_unit on every rank
        return True, error
    return True, None


def _reset(name: str, module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise AttributeError(
            f"module {name or '<root>'!r} ({type(module).__name__}) has parameters or buffers "
            "on the meta device and no reset_parameters() to initialise them (FSDP1 refuses it "
            "too). Pass param_init_fn=... that materialises and initialises the module it is "
            "given, e.g. `lambda m: m.to_empty(device=device, recurse=False)` followed by your "
            "init, or build the model on a real device.")
    reset()


def warn_broken_ties(broken: list[list[str]], plan: Plan) -> None:
    """Say which tied weights materialising untied (see [Note: ties broken on materialising]
    in engine/layout.py): FSDP1 unties them without a word."""
    if broken:
        warnings.warn(
            f"fsdp_bridge ({plan.frontend}): materialising from the meta device gave tied "
            f"parameters separate storage, as FSDP1 does (to_empty makes a new Parameter per "
            f"module): {'; '.join(' / '.join(names) for names in broken)} are no longer tied "
            "and are initialised and trained separately. To keep a tie, build the model on a "
            "real device (on rank 0 only, with sync_module_states=True, to save memory).",
            stacklevel=5)


def region_problem(region: list[tuple[str, nn.Module]],
                   param_init_fn: Optional[Callable[[nn.Module], None]],
                   ignored_params=()) -> Optional[str]:
    """What is wrong with a region after materialising it: tensors still on meta (but for
    `ignored_params`, by name: FSDP1 leaves them as they are)."""
    names = ((f"{prefix}.{name}" if prefix else name, tensor)
             for prefix, submodule in region for name, tensor in _named_states(submodule))
    still_meta = [name for name, tensor in names
                  if tensor.is_meta and name not in ignored_params]
    if not still_meta:
        return None
    who = (f"param_init_fn {function_name(param_init_fn)}" if param_init_fn is not None
           else "reset_parameters")
    return (f"{who} left {len(still_meta)} tensors on the meta device (first: "
            f"{still_meta[0]!r}). It is called once per module that has meta parameters or "
            "buffers of its own and must give them storage, e.g. `lambda m: "
            "m.to_empty(device=device, recurse=False)` followed by your init.")


def meta_params(regions: dict) -> set[tuple[int, str]]:
    """(module id, attribute) of every meta parameter of the model."""
    return {(id(submodule), attr)
            for region in regions.values() for _, submodule in region
            for attr, param in submodule._parameters.items()
            if param is not None and param.is_meta}


def warn_if_reached_beyond(regions: dict, later_units: list[str], meta_before: set, plan: Plan,
                           param_init_fn: Callable[[nn.Module], None]) -> None:
    """A `param_init_fn` that materialises modules it was not called on (a closure over the
    whole model, `to_empty` on the root) allocates them unsharded ahead of their unit: say so."""
    early = [f"{prefix}.{attr}" if prefix else attr
             for name in later_units for prefix, submodule in regions[name]
             for attr, param in submodule._parameters.items()
             if (id(submodule), attr) in meta_before and param is not None and not param.is_meta]
    if early:
        warnings.warn(
            f"fsdp_bridge ({plan.frontend}): param_init_fn {function_name(param_init_fn)} gave "
            f"storage to {len(early)} parameters of modules it was not called on (first: "
            f"{early[0]!r}) while the first unit was materialised. The wrap materialises and "
            "shards one unit at a time; these stay unsharded until their own unit is sharded "
            "(with a function that materialises everything, the whole model on every rank). "
            "Expected: a function that materialises the module it is given, e.g. "
            "`lambda m: m.to_empty(device=device, recurse=False)` followed by its init.",
            stacklevel=5)


def ignored_on_meta(module: nn.Module, ignored_params: set[str]) -> set[str]:
    return {name for name, param in module.named_parameters(remove_duplicate=False)
            if name in ignored_params and param.is_meta}


def warn_ignored_materialised(module: nn.Module, were_on_meta: set[str], plan: Plan,
                              param_init_fn) -> None:
    """Ignored parameters the wrap left alone, yet a `param_init_fn` reaching beyond the module
    it was given (`to_empty` on a container) materialised: FSDP1 would then shard them (it
    knows ignored parameters by identity, and these are new); they stay ignored here."""
    reached = [name for name, param in module.named_parameters(remove_duplicate=False)
               if name in were_on_meta and not param.is_meta]
    if reached:
        warnings.warn(
            f"fsdp_bridge ({plan.frontend}): param_init_fn {function_name(param_init_fn)} gave "
            f"storage to ignored parameters of modules it was not called on: "
            f"{', '.join(reached)}. FSDP1 would then shard them (it knows ignored parameters "
            "by identity, and these are new Parameters); here they stay ignored, whole and "
            "unreduced. Expected: a function that materialises the module it is given, e.g. "
            "`lambda m: m.to_empty(device=device, recurse=False)` followed by its init.",
            stacklevel=5)


def describe_unit(unit_name: str, slots, region) -> str:
    """What every rank must agree on once a unit is materialised: its parameters' names,
    shapes, dtypes and requires_grad, and its region's buffers (values aside)."""
    lines = [f"unit {unit_name or '<root>'} as materialised:"]
    lines.extend(f"  {slot.fqn} {tuple(slot.param.shape)} {slot.param.dtype} "
                 f"grad={slot.param.requires_grad}" for slot in slots)
    lines.extend(f"  buffer {f'{prefix}.{name}' if prefix else name} {tuple(buffer.shape)} "
                 f"{buffer.dtype}"
                 for prefix, submodule in region for name, buffer in submodule._buffers.items()
                 if buffer is not None)
    return "\n".join(lines)


def changed_slots(layouts, param_init_fn) -> Optional[str]:
    """A parameter whose shape, dtype or requires_grad the initialisation changed: the layout
    (and the plan every rank agreed on) was made from the model as it was given."""
    for layout in layouts:
        for slot in layout.slots:
            param = slot.param
            found = (tuple(gathered_form(param).shape), param.dtype, param.requires_grad)
            expected = (tuple(slot.shape), layout.dtype, layout.requires_grad)
            if found != expected:
                who = (f"param_init_fn {function_name(param_init_fn)}"
                       if param_init_fn is not None else "reset_parameters")
                return (f"{who} changed parameter {slot.fqn!r} from (shape, dtype, "
                        f"requires_grad) {expected} to {found}. Expected: the same shape, dtype "
                        "and requires_grad as on the meta device (the sharding layout is made "
                        "from them). Build the model with its final dtypes (or cast it after "
                        "wrapping), and change requires_grad before wrapping.")
    return None


def agree_on_unit(plan: Plan, description: str, problem: Optional[str],
                  error: Optional[Exception], comm: Comm, device: torch.device) -> None:
    """Every rank learns whether a unit's materialisation went the same everywhere before the
    unit's first collective: a failure seen by all ranks is raised by all of them (and the
    rollback, a collective, runs everywhere); ranks that differ (a rank-dependent
    `param_init_fn`, a failure on some ranks only) get the difference, on every rank."""
    failure = f"{type(error).__name__}: {error}" if error is not None else problem
    text = description + (f"\nfailed: {failure}" if failure else "")
    check_ranks_agree(plan, text, comm, device, subject="materialise each unit alike (param_init_fn / "
                      "reset_parameters give every rank the same shapes and dtypes, and fail on "
                      "all ranks or none); the difference")
    if error is not None:
        raise error
    if problem is not None:
        raise ValueError(problem)


def move_region(region: list[tuple[str, nn.Module]], ignored: set[str],
                device: torch.device) -> None:
    """Move a region's buffers, and its parameters that stay whole (`ignored`, by name), to
    `device`; the sharded parameters move as they are flattened, one unit at a time."""
    for prefix, submodule in region:
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.device != device:
                submodule._buffers[name] = buffer.to(device)
        for attr, param in submodule._parameters.items():
            fqn = f"{prefix}.{attr}" if prefix else attr
            if (param is not None and fqn in ignored and param.device != device
                    and not param.is_meta):  # an ignored parameter left on meta stays there
                param.data = param.data.to(device)


def describe_rank(module: nn.Module, device: torch.device) -> str:
    """What else every rank must agree on: the device type (indices differ by rank) and each
    buffer's name, shape and dtype (rank 0's values are broadcast into them)."""
    lines = [f"device type: {device.type}"]
    lines.extend(f"buffer {name} {tuple(buffer.shape)} {buffer.dtype}"
                 for name, buffer in module.named_buffers())
    return "\n".join(lines)


_DIFFERENT_PLANS = ("wrap the same modules of the same model with the same settings; the "
                    "difference")


def check_ranks_agree(plan: Plan, layout_text: str, comm: Comm, device: torch.device,
                      subject: str = _DIFFERENT_PLANS) -> None:
    """Fail with a readable diff, instead of hanging in a collective later, when ranks built
    different plans (different wrapping, dtypes, or parameter shapes). `subject`: what every
    rank must do, and what the difference shows."""
    group = comm.world_group
    if group is None or dist.get_world_size(group) == 1:
        return
    description = plan.describe() + "\n" + layout_text
    # A group without a CPU backend (NCCL) communicates device tensors only: the engine's
    # device, not the current one (a rank whose device_id is not the current device would
    # talk through another GPU).
    on = collective_device(backends_of(group), device)
    mine = torch.tensor([plan.fingerprint(layout_text)], dtype=torch.int64, device=on)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if all(int(g) == int(gathered[0]) for g in gathered):
        return
    descriptions: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(descriptions, description, group=group)
    first_other = next(i for i, g in enumerate(gathered) if int(g) != int(gathered[0]))
    diff = "\n".join(
        list(
            difflib.unified_diff(
                str(descriptions[0]).splitlines(),
                str(descriptions[first_other]).splitlines(),
                "rank 0",
                f"rank {first_other}",
                lineterm="",
            )
        )[:40]
    )
    raise ValueError(
        f"fsdp_bridge: ranks disagree on the sharding plan (plan built by {plan.frontend}): "
        f"rank 0 and rank {first_other} differ. Every rank must {subject}:\n{diff}"
    )


def prepare_region_buffers(region: list[tuple[str, nn.Module]], plan: Plan, comm: Comm,
                           seen: set[int]) -> dict[str, torch.dtype]:
    """Broadcast rank 0's buffers of one region (sync_module_states) and cast floating ones to
    `buffer_dtype`. Returns each cast buffer's original dtype by name, for full state dicts.
    `seen`: buffers already prepared (one object held by several modules is prepared once)."""
    original_dtypes = {}
    buffer_dtype = plan.mixed_precision.buffer_dtype
    for prefix, submodule in region:
        for attr, buffer in list(submodule._buffers.items()):
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            if plan.sync_module_states:
                comm.broadcast_from_first(buffer)
            if (buffer_dtype is not None and buffer.is_floating_point()
                    and buffer.dtype != buffer_dtype):
                original_dtypes[f"{prefix}.{attr}" if prefix else attr] = buffer.dtype
                submodule._buffers[attr] = buffer.to(buffer_dtype)
    return original_dtypes


def sync_ignored_buffers(module: nn.Module, plan: Plan, comm: Comm,
                         device: torch.device) -> None:
    """Under `sync_module_states`, FSDP1 broadcasts rank 0's buffers of ignored modules too
    (not their parameters), neither moving nor casting them. A buffer still on meta on some
    rank has nothing to send or receive (natively the broadcast fails): it is left as it is on
    every rank, which learns so from one small all-reduce."""
    group = comm.world_group
    if (not plan.sync_module_states or not plan.ignored_modules or group is None
            or dist.get_world_size(group) == 1):
        return
    buffers = list({id(b): b for name in plan.ignored_modules
                    for b in module.get_submodule(name).buffers()}.values())
    if not buffers:
        return
    on = collective_device(backends_of(group), device)
    meta_anywhere = torch.tensor([b.is_meta for b in buffers], dtype=torch.int32, device=on)
    dist.all_reduce(meta_anywhere, op=dist.ReduceOp.MAX, group=group)
    for buffer, on_meta in zip(buffers, meta_anywhere.tolist()):
        if not on_meta:
            comm.broadcast_from_first(buffer)


def ignored_parameters(module: nn.Module, plan: Plan) -> list[nn.Parameter]:
    ignored = set(plan.ignored_params)
    return [p for name, p in module.named_parameters() if name in ignored]
