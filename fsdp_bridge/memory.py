"""How many bytes a rank needs for one training step of a sharded model, predicted from the
engine's layout and schedule (what `fsdp_bridge.explain` prints).

The prediction walks the step as the engine runs it:
- always held: the parameter shards, the optimizer state, and (from the first reduction of
  backward until `zero_grad`) the gradient shards;
- in forward, the running unit's gathered weights and the next unit's (prefetched beside it);
- in backward, unit by unit in reverse forward order, with the weights of units that stay
  gathered through the step (the root) and the gradient shards reduced so far: a unit starts
  with its own gathered weights (the first unit of backward also with the scratch its gather
  lands in: the row layout's, and gloo's own flat output unless a pair swaps halves); it ends
  by giving its weights back, starting the next unit's gather (weights and scratch) and laying
  out its gradients, as autograd makes them, into the full gradient the reduction reads (and
  the shard it sums into);
- in the optimizer step: its temporaries (one parameter's worth, or every parameter's for the
  foreach implementations).
Activations are not included: they depend on the batch, and come on top of the backward figure.

`estimate_wrap_memory` predicts the other peak, the wrap's, as the engine's init makes it: unit
by unit (see [Note: a unit at a time] in fsdp_bridge/engine/init.py), the shards made so far
stay; the unit at hand adds its materialised parameters (from meta) and its shard, copied from
them; under `sync_module_states` also their copies on the device (moved) and the flat copy that
is broadcast; then its full parameters are freed (and the originals too, for a real model, but
on ranks that `sync_module_states` overwrites).
Buffers, and parameters materialised in one unit but sharded with another (norms, tied
weights), are left out: they are small beside a unit.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch

from fsdp_bridge.engine.flat_group import local_part
from fsdp_bridge.engine.row_group import RowGroup
from fsdp_bridge.engine.runtime import WrapStart

# Optimizer state tensors kept per parameter, by optimizer class (same shape and dtype as the
# parameter); a callable reads the param group's settings.
STATES_PER_PARAM = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 1,
    "SGD": lambda group: 1 if group.get("momentum", 0) else 0,
    "RMSprop": lambda group: (1 + (group.get("momentum", 0) > 0)
                              + bool(group.get("centered", False))),
}


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per rank. `optimizer` is None when no optimizer was given or its kind is unknown."""

    params: int
    grads: int
    optimizer: Optional[int]
    optimizer_note: str
    gathered_resident: int  # weights that stay gathered through a step (the root's)
    gathered_peak: int  # the most gathered layer weights at one time (running + prefetched)
    backward_peak: int  # everything above at the heaviest moment of backward, activations aside
    optimizer_step_peak: int

    @property
    def predicted_peak(self) -> int:
        return max(self.backward_peak, self.optimizer_step_peak)

    def describe(self) -> str:
        def mib(n: Optional[int]) -> str:
            return "unknown" if n is None else f"{n / 2**20:.1f} MiB"

        return "\n".join([
            "memory per rank for one training step (activations not included):",
            f"  parameters (shards)          {mib(self.params)}",
            f"  gradients (shards)           {mib(self.grads)}",
            f"  optimizer state              {mib(self.optimizer)}  ({self.optimizer_note})",
            f"  gathered, held through step  {mib(self.gathered_resident)}",
            f"  gathered layers, at most     {mib(self.gathered_peak)}",
            f"  predicted peak               {mib(self.predicted_peak)}  (backward "
            f"{mib(self.backward_peak)}, optimizer step {mib(self.optimizer_step_peak)})",
        ])


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


def _gathered_bytes(unit) -> int:
    return sum(_nbytes(g.padded_numel, g.compute_dtype) for g in unit.groups)


def _gather_scratch_bytes(unit) -> int:
    """What a gather of `unit` allocates beside its buffer while it runs: the row layout's
    scratch, and gloo's flat output (none when a pair swaps halves: see `engine.comm`)."""
    scratch = 0
    for group in unit.groups:
        comm = group.comm
        gloo_output = comm.wait_on_futures and comm.shard_size > 1 and not comm.swaps_halves
        copies = int(isinstance(group, RowGroup)) + int(gloo_output)
        scratch += copies * _nbytes(group.padded_numel, group.compute_dtype)
    return scratch


def _unit_gradient_bytes(unit) -> int:
    """A unit's gradients as autograd hands them over, plus the buffer they are laid out in to
    be reduced (the full gradient, or for a pair only the other rank's part: see
    `FlatGroup.start_reduce_of_grads`) and, when sharded, the shard the reduction lands in
    (which becomes the gradient shard)."""
    return sum(_nbytes(g.numel, g.compute_dtype) + _nbytes(_laid_out_numel(g), g.reduce_dtype)
               + (_nbytes(g.shard_numel, g.reduce_dtype) if g.comm.shard_size > 1 else 0)
               for g in unit.trainable_groups)


def _laid_out_numel(group) -> int:
    return group.shard_numel if group.comm.swaps_halves else group.padded_numel


def _grad_shard_bytes(unit) -> int:
    return sum(_nbytes(g.shard_numel, g.master.dtype) for g in unit.trainable_groups)


def _optimizer_bytes(optimizer) -> tuple[Optional[int], str, int]:
    """(state bytes, how they were found, bytes of the largest parameter it steps)."""
    if optimizer is None:
        return None, "no optimizer given", 0
    tensors = [local_part(p) for group in optimizer.param_groups for p in group["params"]]
    largest = max((t.numel() * t.element_size() for t in tensors), default=0)
    if optimizer.state:
        held = sum(local_part(v).numel() * v.element_size() for state in optimizer.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return held, f"{type(optimizer).__name__}, measured from its state", largest
    rule = STATES_PER_PARAM.get(type(optimizer).__name__)
    if rule is None:
        return None, f"{type(optimizer).__name__}: kind not known, not counted", largest
    total = 0
    for group in optimizer.param_groups:
        per_param = rule(group) if callable(rule) else rule
        total += per_param * sum(local_part(p).numel() * p.element_size() for p in group["params"])
    return total, f"{type(optimizer).__name__}, predicted before its first step", largest


def _optimizer_scratch(optimizer, largest_param: int, all_params: int) -> int:
    if optimizer is None:
        return 0
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:  # torch's default: foreach on accelerators only
        foreach = any(local_part(p).device.type != "cpu"
                      for group in optimizer.param_groups for p in group["params"])
    return all_params if foreach else largest_param


def _layers(sharded, resident_units) -> list:
    """Units whose weights are gathered and given back around their use, in forward order."""
    return [u for u in sharded.expected_forward_order() if u.groups and u not in resident_units]


def _forward_gathered_peak(layers) -> int:
    """The most layer weights gathered at once: a running unit and the one prefetched."""
    sizes = [_gathered_bytes(u) for u in layers]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=max(sizes, default=0))


def _backward_peak(sharded, held: int, layers, resident_units) -> int:
    """The heaviest moment of backward, walking the units as the engine schedules them."""
    resident = sum(_gathered_bytes(u) for u in resident_units)
    order = list(reversed(layers))
    peak = reduced = 0
    for index, unit in enumerate(order):
        following = order[index + 1] if index + 1 < len(order) else None
        base = held + reduced + resident
        # Later units' gathers started at the end of the unit before (counted there).
        starting = base + _gathered_bytes(unit) + (
            _gather_scratch_bytes(unit) if index == 0 else 0)
        ending = base + _unit_gradient_bytes(unit) + (
            _gathered_bytes(following) + _gather_scratch_bytes(following)
            if following is not None else 0)
        peak = max(peak, starting, ending)
        reduced += _grad_shard_bytes(unit)
    for unit in resident_units:  # their gradients complete last
        peak = max(peak, held + reduced + resident + _unit_gradient_bytes(unit))
        reduced += _grad_shard_bytes(unit)
    return peak


def estimate_step_memory(sharded, optimizer=None) -> StepMemory:
    """Predict the bytes one rank of `sharded` (a ShardedModel) needs for a training step."""
    groups = sharded.flat_groups()
    if any(g.master.device != g.device for g in groups):
        warnings.warn("fsdp_bridge: estimate_step_memory does not model CPU offload yet: the "
                      "master shards, gradient shards and optimizer state it counts live in "
                      "host memory, not on the device.", stacklevel=2)
    ignored = sum(p.numel() * p.element_size() for p in sharded.ignored_params)
    params = sum(_nbytes(g.shard_numel, g.master.dtype) for g in groups) + ignored
    grads = sum(_grad_shard_bytes(u) for u in sharded.units) + sum(
        p.numel() * p.element_size() for p in sharded.ignored_params if p.requires_grad)
    state, note, largest = _optimizer_bytes(optimizer)
    held = params + (state or 0)
    resident_units = [u for u in sharded.units if any(g.dedicated for g in u.groups)]
    layers = _layers(sharded, resident_units)
    backward = _backward_peak(sharded, held, layers, resident_units)
    gathered_peak = _forward_gathered_peak(layers)
    step = held + grads + _optimizer_scratch(optimizer, largest, params)
    resident = sum(_nbytes(g.padded_numel, g.compute_dtype) for g in groups if g.dedicated)
    return StepMemory(params=params, grads=grads, optimizer=state, optimizer_note=note,
                      gathered_resident=resident, gathered_peak=gathered_peak,
                      backward_peak=backward, optimizer_step_peak=step)


@dataclasses.dataclass(frozen=True)
class WrapMemory:
    """Peak growth of one rank's memory while the model is wrapped, above what it held before,
    by where the parameters start (None: not predicted for this layout)."""

    by_start: dict
    this_wrap: Optional[int]
    this_start: str

    def describe(self) -> str:
        if self.this_wrap is None:
            return ("memory per rank while wrapping: not predicted (fully_shard converts "
                    "parameters at each call; the engine adopts them at first use)")
        starts = ", ".join(f"from {start.value} {value / 2**20:.1f} MiB"
                           for start, value in self.by_start.items())
        return (f"memory per rank while wrapping (peak growth, buffers not included): this "
                f"wrap {self.this_wrap / 2**20:.1f} MiB (its units started {self.this_start}); "
                f"{starts}")


def _wrap_peak(units, starts: list[WrapStart], sync: bool) -> int:
    held = peak = 0
    for unit, start in zip(units, starts):
        if start is WrapStart.META:
            held += sum(_nbytes(g.numel, g.master.dtype) for g in unit.groups)
        for group in unit.groups:
            full = _nbytes(group.numel, group.master.dtype)
            flat = _nbytes(group.padded_numel, group.master.dtype)
            shard = _nbytes(group.shard_numel, group.master.dtype)
            # Only a broadcast needs the unit whole and flat (see FlatGroup._build_master).
            copies = flat + (full if start is WrapStart.MOVED else 0) if sync else 0
            peak = max(peak, held + copies + shard)
            freed = full if start in (WrapStart.META, WrapStart.REAL) else 0
            held += shard - freed
    return peak


def estimate_wrap_memory(sharded) -> WrapMemory:
    """Predict the wrap's peak for `sharded` (a ShardedModel), as its own wrap went and from
    each starting point (see the module's docstring)."""
    if any(isinstance(g, RowGroup) for g in sharded.flat_groups()):
        return WrapMemory({}, None, "")
    starts = [step.start for step in sharded.init_steps]
    sync = sharded.plan.sync_module_states
    by_start = {start: _wrap_peak(sharded.units, [start] * len(starts),
                                  sync or start is WrapStart.KEPT)
                for start in (WrapStart.META, WrapStart.REAL, WrapStart.KEPT)}
    kinds = sorted({start.value for start in starts})
    return WrapMemory(by_start, _wrap_peak(sharded.units, starts, sync), " / ".join(kinds))
