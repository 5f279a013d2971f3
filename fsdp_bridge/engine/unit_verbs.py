"""FSDP2's per-module verbs on one unit: unshard, reshard, expose the full parameters, run
a method as a forward, the gradient divide factor and gradient synchronisation."""

from __future__ import annotations

from typing import Optional

from fsdp_bridge.engine.row_group import RowGroup
from fsdp_bridge.engine.runtime import ShardedModel


def _unit(sharded: ShardedModel, name: str):
    """Unit `name`, or for a module inside a unit (e.g. a module of an FSDP2 list call) the
    innermost unit that encloses it."""
    best = None
    for unit in sharded.units:
        if unit.name == name:
            return unit
        if unit.name == "" or name.startswith(unit.name + "."):
            if best is None or len(unit.name) > len(best.name):
                best = unit
    return best if best is not None else sharded.units[-1]


def set_gradient_divide_factor(sharded: ShardedModel, name: str, factor: Optional[float]) -> None:
    """Divide the reduced gradients of unit `name` (or of the unit enclosing module `name`) by
    `factor` instead of the data-parallel size (FSDP2's per-module divide factor)."""
    _unit(sharded, name).gradient_divide_factor = None if factor is None else float(factor)


def set_reduce_unused_params(sharded: ShardedModel, name: str, reduce: bool) -> None:
    """Whether parameters of unit `name` that no backward reached get a zero gradient (True)
    instead of the plan's choice (FSDP2's `set_reduce_scatter_unused_params`)."""
    _unit(sharded, name).reduce_unused_params = bool(reduce)


def set_unit_gradient_sync(sharded: ShardedModel, name: str, requires_sync: bool) -> None:
    """Whether unit `name` reduces its gradients in the next backwards (FSDP2's
    `set_requires_gradient_sync` on one module): False sums them locally until a backward
    with True, while the other units go on as they are set."""
    _unit(sharded, name).requires_sync = bool(requires_sync)


def set_unit_all_reduce(sharded: ShardedModel, name: str, requires_all_reduce: bool) -> None:
    """Whether unit `name` all-reduces its reduced gradients over the replicas under hybrid
    sharding (FSDP2's `set_requires_all_reduce`; see [Note: reduce-scattered, not
    all-reduced] in flat_group.py). Without replicas there is nothing to skip."""
    _unit(sharded, name).requires_all_reduce = bool(requires_all_reduce)


def set_all_reduce_hook(sharded: ShardedModel, name: str, hook) -> None:
    """Call `hook(reduced_shard)` on each reduced gradient shard of unit `name`, averaged as
    FSDP2 averages it (see [Note: all-reduce hook] in runtime.py)."""
    _unit(sharded, name).all_reduce_hook = hook


def set_custom_collective(sharded: ShardedModel, name: str, kind: str, comm) -> None:
    """Run unit `name`'s gathers (`kind` "all_gather") or reductions ("reduce_scatter")
    through `comm`, a torch AllGather / ReduceScatter (FSDP2's `set_custom_all_gather` /
    `set_custom_reduce_scatter`; see [Note: custom collectives] in flat_group.py)."""
    for group in _unit(sharded, name).groups:
        setattr(group, f"custom_{kind}", comm)


def unshard_unit(sharded: ShardedModel, name: str) -> list:
    """Start gathering unit `name` (FSDP2's `unshard`): the next forward finds it gathered
    and uses this gather, waiting for it if still in flight, rather than gathering again.
    Returns the groups whose gathers are in flight (wait with `group.wait_gather()`)."""
    unit = _unit(sharded, name)
    started = []
    for group in unit.groups:
        if not group.is_gathered:
            group.start_gather()
            started.append(group)
            sharded.unsharded_ahead.add(id(group))
    return started


def expose_unit(sharded: ShardedModel, name: str) -> None:
    """After `unshard_unit` finished: unit `name`'s modules hold its full parameters until
    it is resharded (FSDP2's unsharded state; DTensor parameters only)."""
    for group in _unit(sharded, name).groups:
        if isinstance(group, RowGroup):
            group.expose_full()


def reshard_unit(sharded: ShardedModel, name: str) -> None:
    """Drop unit `name`'s gathered copy (FSDP2's `reshard`), unless it is running."""
    unit = _unit(sharded, name)
    if not unit.in_use:
        for group in unit.groups:
            group.invalidate()


def run_pre_forward(sharded: ShardedModel, name: str, args, kwargs):
    """Run the engine's pre-forward hook of unit `name` by hand (for a hook registered while
    the module's own hooks were already being called)."""
    unit = _unit(sharded, name)
    return sharded._make_pre_forward(unit)(unit.module, args, kwargs)


def unit_in_use(sharded: ShardedModel, name: str) -> bool:
    """Whether unit `name` is gathered for a forward or backward that is running now."""
    return _unit(sharded, name).in_use


def run_post_forward(sharded: ShardedModel, name: str, args, output):
    """Run the engine's post-forward hook of unit `name` by hand: the end of a method run as
    a forward that `run_pre_forward` began (returns the output, cast as forward's is)."""
    unit = _unit(sharded, name)
    return sharded._make_post_forward(unit)(unit.module, args, output)


def run_as_forward(sharded: ShardedModel, name: str, method, args, kwargs):
    """Call `method` with unit `name` gathered as for its forward (FSDP2's
    `register_fsdp_forward_method`)."""
    unit = _unit(sharded, name)
    if unit.in_use:
        return method(*args, **kwargs)
    args, kwargs = sharded._make_pre_forward(unit)(unit.module, args, kwargs)
    forwards = forwards_begun(sharded, name)
    output = method(*args, **kwargs)
    output = sharded._make_post_forward(unit)(unit.module, args, output)
    end_forward_method(sharded, name, forwards)
    return output


def forwards_begun(sharded: ShardedModel, name: str) -> int:
    """How many forwards unit `name` has begun (see `end_forward_method`)."""
    return _unit(sharded, name).forwards


def end_forward_method(sharded: ShardedModel, name: str, forwards_before: int) -> None:
    """[Note: the end of a forward method] FSDP2 ends a registered forward method (`generate`)
    that ran the unit's own forward inside it with the unit's sharded parameters registered
    again, whatever its reshard_after_forward (that inner forward leaves the unit idle, and an
    idle unit reshards), so an optimizer built on `model.parameters()` after `generate` gets
    the sharded ones. As there: the gathered copy stays for the next use."""
    unit = _unit(sharded, name)
    if unit.forwards > forwards_before:
        for group in unit.groups:
            group.hide_views()


def hook_module_inside(sharded: ShardedModel, name: str, module) -> None:
    """Make module `name`, which shares the flat groups of the unit enclosing it (a module of
    an FSDP2 list call), gather them when called on its own."""
    sharded.hook_module_inside(_unit(sharded, name), module)
