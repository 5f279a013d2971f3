"""The Plan: one frozen, printable description of how a model is sharded.

Front-ends (FSDP1, FSDP2, YaFSDP, Zeta, TorchAcc) translate their arguments into a Plan; the
engine applies it and knows nothing of dialects. A Plan names modules and parameters by their
fully-qualified names (FQNs) in the model, so it is plain data: it can be printed, compared,
fingerprinted across ranks and built without processes.

[Note: units]
A *unit* is a module whose parameters share one flat buffer (FSDP1's "FSDP instance", FSDP2's
"param group", YaFSDP's "SuperTensor"). Units are listed in post-order with the root ("") last.
A parameter belongs to the innermost unit that contains every module using it, so tied weights
always share a unit. Parameters of the *norm group* (norm modules named in
`Plan.norm_modules`) are moved into the root unit, which stays gathered for the whole step:
they are gathered once per step and their gradients are reduced once, together.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Optional

import torch


class ShardingMode(enum.Enum):
    """How parameters and gradients are spread over the ranks."""

    SHARD = "shard"  # one shard group of all ranks (ZeRO-2/3)
    REPLICATE = "replicate"  # every rank holds everything; gradients all-reduced (NO_SHARD)
    HYBRID = "hybrid"  # 2-D mesh: shard inside a group, all-reduce across replica groups


class ParamLayout(enum.Enum):
    """How a rank's shard of a unit is cut from its parameters, and what the user holds."""

    # One contiguous range of the unit's concatenated parameters (FSDP1 / YaFSDP): the user
    # holds 1-D local pieces of each parameter.
    FLAT = "flat"
    # Each parameter split by rows as torch's Shard(0) (FSDP2): the user holds DTensors.
    ROWS = "rows"


class UnsyncedGradSum(enum.Enum):
    """How a rank sums the gradients of the backwards run without synchronisation (FSDP1's
    `no_sync()`, FSDP2's `set_requires_gradient_sync(False)`) until the backward that reduces
    them. Each dialect rounds in its own order, so each keeps its own: see [Note: gradients
    summed without synchronisation] in engine/flat_group.py."""

    # In the gradients' own dtype (param_dtype), cast to reduce_dtype once, for the reduction
    # (FSDP1: autograd accumulates into the unsharded flat parameter's gradient).
    COMPUTE_DTYPE = "compute_dtype"
    # In reduce_dtype: the first gradient rounded to it, each later one added unrounded and the
    # sum rounded (FSDP2, and YaFSDP's fully_shard).
    REDUCE_DTYPE = "reduce_dtype"


@dataclasses.dataclass(frozen=True)
class UnitSpec:
    """One flat unit: the module at `name` ("" is the root) and its resharding policy."""

    name: str
    # ZeRO-3 frees the gathered parameters after forward and gathers again in backward;
    # ZeRO-2 keeps them until backward ends. The root unit is not resharded after forward
    # (backward starts with it) unless `reshard_as_root` says so.
    reshard_after_forward: bool = True
    # This unit's own precision (FSDP2: each fully_shard call's policy); None: the plan's.
    # Only the plan's output_dtype is applied, to the root's outputs.
    mixed_precision: Optional[MixedPrecision] = None
    # The root unit reshards after forward too (FSDP2's root given reshard_after_forward=True
    # explicitly); ignored for other units.
    reshard_as_root: bool = False


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used by the engine. `None` means "the parameter's own dtype" (no cast)."""

    param_dtype: Optional[torch.dtype] = None  # gather and compute dtype
    reduce_dtype: Optional[torch.dtype] = None  # gradient reduction dtype
    buffer_dtype: Optional[torch.dtype] = None  # module buffers are cast to this
    output_dtype: Optional[torch.dtype] = None  # root outputs are cast to this
    cast_forward_inputs: bool = False  # cast floating inputs of every unit to param_dtype
    cast_root_forward_inputs: bool = True  # cast floating inputs of the root to param_dtype

    def effective_reduce_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        """Reduce in `reduce_dtype`, else in fp32 when parameters are gathered in low
        precision (bf16 reductions drift at scale), else in the master dtype."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        if self.param_dtype is not None and self.param_dtype.itemsize < master_dtype.itemsize:
            return master_dtype
        return self.param_dtype or master_dtype


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the engine needs to shard a model, as data."""

    units: tuple[UnitSpec, ...]  # post-order, root ("") last
    mode: ShardingMode = ShardingMode.SHARD
    mixed_precision: MixedPrecision = MixedPrecision()
    norm_modules: tuple[str, ...] = ()  # FQNs of modules in the resident norm group
    ignored_params: tuple[str, ...] = ()  # FQNs of parameters left alone (not sharded)
    # FQNs of modules left as they are: not moved nor broadcast, and not materialised from
    # meta unless inside another unit than the root (see engine/init.py).
    ignored_modules: tuple[str, ...] = ()
    # Declared micro-steps per optimizer step (YaFSDP); gradients are divided once by
    # world size x this number after the last micro-step's backward.
    gradient_accumulation_steps: int = 1
    sync_module_states: bool = False  # broadcast rank 0's parameters and buffers at init
    cpu_offload: bool = False  # keep fp32 master shards and their gradients on the CPU
    param_layout: ParamLayout = ParamLayout.FLAT
    # What a parameter that no backward of an optimizer step reached gets as `.grad`: FSDP1
    # and YaFSDP reduce a zero gradient for it, FSDP2 leaves `.grad` None (an optimizer then
    # skips it: no momentum, no weight decay). See [Note: parameters without a gradient].
    unused_grad_is_none: bool = False
    # Divide every reduction's gradients before it and after it, in the reduction dtype,
    # whatever the dtype (FSDP1); otherwise fp16 only. See [Note: fp16 reductions].
    divide_around_reduce: bool = False
    # In which dtype gradients accumulated without synchronisation are summed.
    unsynced_grad_sum: UnsyncedGradSum = UnsyncedGradSum.REDUCE_DTYPE
    # Where a rank's gradient shard is the whole gradient (a shard group of one rank), a
    # gradient kept from an earlier backward joins the next backward's local gradient and is
    # reduced again with it (FSDP1); otherwise each reduction's result is added to it. See
    # [Note: a kept gradient reduced again] in engine/flat_group.py.
    rereduce_kept_grad: bool = False
    # Call each parameter's post-accumulate-grad hooks once its reduced gradient is set as
    # `.grad` (FSDP2 does, after each reduction: optimizer-in-backward). Autograd cannot: the
    # engine computes with gathered views, so it never accumulates into the parameters.
    post_accumulate_grad_hooks: bool = False
    frontend: str = "engine"  # who built the plan, for messages
    # Settings a front-end could not honour, each "argument: reason" (warned once at build).
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Invariants a front-end must guarantee; users never build a Plan by hand.
        assert self.units and self.units[-1].name == "", "the root unit must come last"
        names = [unit.name for unit in self.units]
        assert len(set(names)) == len(names), f"duplicate unit in {names}"
        assert self.gradient_accumulation_steps >= 1

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(unit.name for unit in self.units)

    def describe(self) -> str:
        """A stable, human-readable text of the plan (also what the fingerprint hashes)."""
        mp = self.mixed_precision
        lines = [
            f"frontend: {self.frontend}",
            f"mode: {self.mode.value}",
            "mixed_precision: " + _describe_precision(mp),
            f"gradient_accumulation_steps: {self.gradient_accumulation_steps}",
            f"sync_module_states: {self.sync_module_states}",
            f"cpu_offload: {self.cpu_offload}",
            f"param_layout: {self.param_layout.value}",
            f"unused_grad_is_none: {self.unused_grad_is_none}",
            "units:",
        ]
        for unit in self.units:
            policy = "reshard-after-forward" if unit.reshard_after_forward else "keep-gathered"
            if unit.mixed_precision is not None and unit.mixed_precision != mp:
                policy += ", " + _describe_precision(unit.mixed_precision)
            lines.append(f"  {unit.name or '<root>'} ({policy})")
        if self.norm_modules:
            lines.append("norm group: " + ", ".join(self.norm_modules))
        if self.ignored_params:
            lines.append("ignored params: " + ", ".join(self.ignored_params))
        if self.ignored_modules:
            lines.append("ignored modules: " + ", ".join(self.ignored_modules))
        if self.divide_around_reduce:
            lines.append("gradients divided before and after each reduction")
        if self.unsynced_grad_sum is not UnsyncedGradSum.REDUCE_DTYPE:
            lines.append(f"unsynchronised gradients summed in: {self.unsynced_grad_sum.value}")
        if self.rereduce_kept_grad:
            lines.append("kept gradients reduced again where shards are whole")
        if self.post_accumulate_grad_hooks:
            lines.append("post-accumulate-grad hooks called once a reduced gradient is set")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def fingerprint(self, extra: str = "") -> int:
        """A 63-bit hash of the plan (plus `extra`, e.g. the parameter layout)."""
        digest = hashlib.sha256((self.describe() + "\n" + extra).encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1


def _describe_precision(mp: MixedPrecision) -> str:
    return ", ".join(f"{f.name}={getattr(mp, f.name)}" for f in dataclasses.fields(mp))
