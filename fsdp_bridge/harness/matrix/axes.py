"""The matrix's axes, which front-end accepts which value, and the cells that cover them.

Free of torch: the command line checks `--axes` / `--frontends` before torch loads.

A cell is one value per axis (`Cell`); the first value of each axis is its default, and a cell
prints only what differs from the defaults. `invalid(settings)` says why a (partial) combination
has no meaning for its front-end (`use_orig_params` for `fully_shard`, a hybrid mesh on 3 ranks,
...); the covering array never contains such a cell. `native_limit(cell)` says why the native
reference cannot run a valid cell on a CPU-only torch (FSDP1's CPUOffload and
sync_module_states need an accelerator): such cells are compared with native running
`native_stand_in(cell)` (the same arithmetic without that setting) and reported `no reference`
when they agree, never failed for what native cannot do.

[Note: the covering array]
Every value of every axis appears at least once, and every pair of values of two axes appears in
some cell wherever a valid cell can hold it (pairwise, "2-way", coverage). allpairspy, the kept
PyPI generator, stops early under constraints as many as ours (it left a third of the pairs
uncovered here), so a small greedy generator does it: take an uncovered pair, then give each
other axis the value that covers most new pairs while a valid completion still exists (found
depth-first with `invalid`), until no feasible pair is left. A seed orders the pairs and the
axes, so two seeds give two different covering arrays of the same space; the suite runs a fixed
seed on a restricted space (`SAMPLE_SPACE`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable, Iterable, Mapping, Optional

FRONTENDS = ("fsdp1", "fsdp2", "yafsdp", "zeta", "torchacc")

# What each front-end of ours is compared with (see `dialects.py`).
BASELINES = {
    "fsdp1": "torch FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel)",
    "fsdp2": "torch fully_shard (torch.distributed.fsdp.fully_shard)",
    "yafsdp": "the single-process reference on the global batch (YaFSDP is CUDA-only upstream)",
    "zeta": "torch FSDP1 as Zeta's fsdp() builds it (its wrap policy, presets and prefetch)",
    "torchacc": "the single-process reference on the global batch (TorchAcc runs on XLA "
                "upstream)",
}

# axis -> (values, the first is the default; what it means)
AXES: dict[str, tuple[tuple, str]] = {
    "frontend": (FRONTENDS, "the front-end pair: ours against its baseline (BASELINES)"),
    "world": ((2, 1, 3, 4), "ranks; the model's units have element counts no world divides"),
    "param": (("fp32", "bf16", "fp16"), "parameter (compute) dtype"),
    "reduce": (("default", "fp32", "bf16", "fp16"),
               "gradient reduction dtype (default: the front-end's own default)"),
    "buffer": (("default", "bf16", "fp16"), "buffer dtype (FSDP1's MixedPrecision.buffer_dtype)"),
    "accumulate": (("none", "skip", "sync"),
                   "gradient accumulation: none; skip = no_sync() / "
                   "set_requires_gradient_sync(False) / YaFSDP's declared steps on every "
                   "micro-step but the last; sync = reduce on every micro-step"),
    "micro": ((1, 2, 3, 4), "micro-steps per optimizer step"),
    "offload": ((False, True), "CPU offload (CPUOffload(offload_params=True), "
                               "CPUOffloadPolicy(pin_memory=False))"),
    "ac": (("off", "before", "before-reentrant", "after", "after-reentrant"),
           "activation checkpointing of the blocks (check_fn by class), applied before or "
           "after the wrap, non-reentrant or reentrant"),
    "compile": (("off", "whole", "blocks"),
                "torch.compile: off, the whole wrapped model, or each block in place "
                "(block.compile(fullgraph=True))"),
    "strategy": (("full", "grad_op", "no_shard", "hybrid"),
                 "FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD (2 x 2 mesh), or the "
                 "dialect's equivalent"),
    "tied": ((False, True), "the output head's weight tied to the embedding"),
    "frozen": ((False, True), "one block's up-projection frozen (requires_grad=False)"),
    "ignored": ((False, True), "a side module left out of sharding (ignored_states / "
                               "ignored_params); its user averages its gradients"),
    "orig_params": ((True, False), "FSDP1's use_orig_params"),
    "init": (("real", "meta", "rank0"),
             "initialisation: real weights; meta + param_init_fn (FSDP2: to_empty + "
             "reset_parameters); rank 0 real + sync_module_states (FSDP2: "
             "set_model_state_dict(broadcast_from_rank0=True))"),
    "clip": ((False, True), "clip_grad_norm_ every step (its returned norm is compared too)"),
    "resume": (("off", "full", "sharded"),
               "save after the middle step, build a fresh model and optimizer, load, go on: "
               "full state dicts, or sharded ones through torch.distributed.checkpoint"),
    "outer": (("none", "torch-fsdp2", "torch-fsdp1"),
              "a torch root wrapper around our FSDP1 blocks (mixed dialects; refused by name)"),
    "late_param": ((False, True), "a new Parameter assigned in place of a block's bias after the "
                                  "wrap"),
    "odd_args": ((False, True),
                 "arguments native takes its own way: set_requires_gradient_sync(0) / (1) "
                 "(native accepts truthy values), state_dict_type(FULL_STATE_DICT, "
                 "ShardedStateDictConfig()) for the full resume (native refuses the pair)"),
}

DEFAULTS = {axis: values[0] for axis, (values, _) in AXES.items()}

# The suite's sample (`compare --matrix --sample`): one world of 2 ranks, no compile (dynamo
# dominates a cell's time), the checkpointing and micro-step values that pair least with the
# rest left to `make conformance`.
SAMPLE_SPACE = {"world": (2,), "compile": ("off",), "ac": ("off", "before", "after-reentrant"),
                "micro": (1, 2, 3)}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination: a value for every axis."""

    settings: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **settings) -> "Cell":
        unknown = set(settings) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)[0]!r}: the axes are "
                             f"{', '.join(AXES)}.")
        return cls(tuple((axis, settings.get(axis, DEFAULTS[axis])) for axis in AXES))

    def __getattr__(self, axis: str):
        if axis.startswith("__"):
            raise AttributeError(axis)
        for name, value in self.settings:
            if name == axis:
                return value
        raise AttributeError(f"Cell has no axis {axis!r}")

    def as_dict(self) -> dict:
        return dict(self.settings)

    def label(self) -> str:
        """The front-end, the world, then every setting that is not its axis's default."""
        parts = [f"{self.frontend} w{self.world}"]
        for axis, value in self.settings:
            if axis in ("frontend", "world") or value == DEFAULTS[axis]:
                continue
            if axis == "micro":
                continue  # said by accumulate
            if axis == "accumulate":
                parts.append(f"{value}x{self.micro}")
            elif value is True:
                parts.append(axis)
            elif value is False:
                parts.append(f"no-{axis}")
            else:
                parts.append(f"{axis}={value}")
        return " ".join(parts)


# --- which front-end accepts which value ------------------------------------------------------

# axis -> values each front-end accepts (an axis a front-end does not list: every value).
_ACCEPTS: dict[str, dict[str, tuple]] = {
    "fsdp2": {"buffer": ("default",), "orig_params": (True,), "outer": ("none",),
              "late_param": (False,)},
    "yafsdp": {"reduce": ("default", "bf16", "fp16"), "buffer": ("default",),
               "accumulate": ("none", "skip"), "offload": (False,),
               "strategy": ("full", "grad_op"), "ignored": (False,), "orig_params": (True,),
               "init": ("real", "rank0"), "resume": ("off", "full"), "outer": ("none",),
               "late_param": (False,)},
    "zeta": {"reduce": ("default",), "buffer": ("default",), "offload": (False,),
             "strategy": ("full", "grad_op", "no_shard"), "ignored": (False,),
             "orig_params": (True,), "init": ("real",), "outer": ("none",),
             "late_param": (False,)},
    "torchacc": {"param": ("fp32", "bf16", "fp16"), "reduce": ("default",),
                 "buffer": ("default",), "accumulate": ("none", "sync"), "offload": (False,),
                 "strategy": ("full", "no_shard", "hybrid"), "ignored": (False,),
                 "orig_params": (True,), "init": ("real", "rank0"), "resume": ("off",),
                 "outer": ("none",), "late_param": (False,)},
}

Rule = Callable[[Mapping[str, Any]], Optional[str]]

# [Note: rules judge partial cells]
# Each rule judges whatever axes a partial combination holds and speaks as soon as those already
# break it (two axes are enough for every rule): the generator's depth-first search then never
# fails deep down, where it would retry every combination of the axes above.


def _micro_steps(s):
    if "accumulate" in s and "micro" in s and (s["accumulate"] == "none") != (s["micro"] == 1):
        return "accumulate=none means one micro-step, and accumulating means two or more"
    return None


def _hybrid_world(s):
    if s.get("strategy") == "hybrid" and s.get("world", 4) != 4:
        return "hybrid sharding runs on a 2 x 2 mesh (world 4)"
    return None


def _reduce_dtype(s):
    if s.get("frontend") == "yafsdp" and s.get("reduce", "default") != "default" \
            and s.get("param", s["reduce"]) != s["reduce"]:
        return "YaFSDP reduces in fp32, or with bit16_reduce_scatter in the parameter dtype"
    return None


def _buffer_dtype(s):
    if s.get("buffer") == "fp16" and s.get("param") == "fp32":
        return "an fp16 buffer dtype is only tried beside low-precision parameters"
    return None


# A torch root around our blocks, and a parameter assigned after the wrap, are tried on a plain
# model: these axes keep their defaults there.
_PLAIN_FOR_OUTER = ("offload", "init", "resume", "ignored", "late_param", "strategy", "ac",
                    "orig_params")
_PLAIN_FOR_LATE = ("init", "resume", "ac")


def _plain_model(s):
    for axis, plain in (("outer", _PLAIN_FOR_OUTER), ("late_param", _PLAIN_FOR_LATE)):
        if s.get(axis, DEFAULTS[axis]) == DEFAULTS[axis]:
            continue
        for other in plain:
            if s.get(other, DEFAULTS[other]) != DEFAULTS[other]:
                return f"{axis} is tried with {other} at its default ({DEFAULTS[other]!r})"
    return None


def _odd_args(s):
    if not s.get("odd_args"):
        return None
    frontend = s.get("frontend")
    if frontend is not None and frontend not in ("fsdp1", "fsdp2"):
        return "odd arguments are tried on FSDP1's state_dict_type and FSDP2's gradient sync"
    if frontend == "fsdp2" and s.get("accumulate", "skip") != "skip":
        return "FSDP2's odd argument is set_requires_gradient_sync's: accumulate=skip"
    if frontend == "fsdp1" and s.get("resume", "full") != "full":
        return "FSDP1's odd argument is the full resume's state-dict config: resume=full"
    return None


def _compile_reentrant(s):
    if s.get("compile", "off") != "off" and s.get("ac", "off").endswith("reentrant"):
        return "reentrant checkpointing is a graph break torch.compile does not trace"
    return None


def _meta_tied(s):
    if s.get("init") == "meta" and s.get("tied"):
        return "materialising from meta unties tied weights (natively too, with a warning)"
    return None


def _compile_flat(s):
    if s.get("compile", "off") != "off" and s.get("orig_params") is False:
        return "torch.compile of FSDP1 needs use_orig_params=True"
    return None


_RULES: tuple[Rule, ...] = (_micro_steps, _hybrid_world, _reduce_dtype, _buffer_dtype,
                            _plain_model, _odd_args, _compile_reentrant,
                            _meta_tied, _compile_flat)


def invalid(settings: Mapping[str, Any]) -> Optional[str]:
    """Why a (partial) combination has no valid cell, or None. Axes absent are not judged."""
    frontend = settings.get("frontend")
    if frontend is not None:
        for axis, accepted in _ACCEPTS.get(frontend, {}).items():
            if axis in settings and settings[axis] not in accepted:
                return f"{frontend} has no {axis}={settings[axis]!r}"
    for rule in _RULES:
        reason = rule(settings)
        if reason:
            return reason
    return None


# --- what the native reference cannot run on a CPU-only torch ---------------------------------


def native_stand_in(cell: Cell) -> Cell:
    """The cell native runs in place of one it cannot run here: without CPU offload (which
    moves the same fp32 arithmetic to the host) and from real weights on every rank (which
    sync_module_states would have broadcast from rank 0: the seeded weights)."""
    return Cell.of(**{**cell.as_dict(), "offload": False,
                      "init": "real" if cell.init == "rank0" else cell.init})


def native_limit(cell: Cell, device_type: str = "cpu") -> Optional[str]:
    """Why the baseline of a valid cell cannot run it here, or None."""
    if device_type != "cpu" or cell.frontend not in ("fsdp1", "zeta"):
        return None
    if cell.offload:
        return ("torch FSDP1's CPUOffload pins memory, which needs an accelerator "
                "(RuntimeError on a CPU-only torch)")
    if cell.init == "rank0":
        return ("torch FSDP1's sync_module_states refuses CPU parameters (ValueError on a "
                "CPU-only torch)")
    return None


# --- known differences ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Known:
    """A difference from native that is known and being fixed elsewhere: cells it matches
    are reported apart and do not fail the sweep. Remove the entry once the fix lands."""

    name: str
    reason: str
    matches: Callable[[Cell], bool]


KNOWN: tuple[Known, ...] = (
    Known("fully_shard compiled whole in low precision",
          "dynamo fails to build a shape guard when it recompiles our fully_shard model with "
          "bf16 / fp16 parameters (IndexError in symbolic_shapes); fp32 compiles and is equal",
          lambda c: c.frontend == "fsdp2" and c.compile == "whole" and c.param != "fp32"),
    Known("torch's fully_shard root around our FSDP1 blocks",
          "torch's root gathers our blocks' pieces as its own parameters before our forward "
          "can refuse the pair; where its padded shards of our uneven pieces differ between "
          "ranks, gloo aborts the process (README, Mixing dialects)",
          lambda c: c.outer == "torch-fsdp2" and c.world > 1),
)


def known_difference(cell: Cell) -> Optional[Known]:
    return next((known for known in KNOWN if known.matches(cell)), None)


# Where ours cannot be bit for bit equal to a deterministic native by construction, and README
# says so: such a cell is `equal` when it is within the compute dtype's tolerance, and the
# table says it was not bit for bit, and why.
ROUNDING: tuple[Known, ...] = (
    Known("FSDP1's flat layout: other pieces per rank",
          "native FSDP1 pads each parameter to 16 bytes inside its flat parameter and ours "
          "does not, so ranks hold other pieces: each rank's partial clip norm rounds "
          "otherwise, and beyond 2 ranks an element can fall in another rank's chunk of "
          "gloo's reduce-scatter and be summed in another order (README, FSDP1 gradients)",
          lambda c: c.frontend in ("fsdp1", "zeta") and (c.world > 2 or c.clip and c.world > 1)),
)


def rounding_difference(cell: Cell) -> Optional[Known]:
    return next((known for known in ROUNDING if known.matches(cell)), None)


# --- the covering array -----------------------------------------------------------------------


def check_space(space: Mapping[str, Iterable]) -> dict[str, tuple]:
    """Every axis with the values to sweep (`space` restricts some axes), checked."""
    chosen = {}
    for axis, (values, _) in AXES.items():
        wanted = tuple(space.get(axis, values))
        unknown = [value for value in wanted if value not in values]
        if unknown or not wanted:
            raise ValueError(f"axis {axis}: {unknown[0] if unknown else 'no value'!r} is not "
                             f"one of its values ({', '.join(map(str, values))}).")
        chosen[axis] = wanted
    return chosen


def _completion(fixed: Mapping[str, Any], domains: Mapping[str, tuple]) -> Optional[dict]:
    """A valid value for every axis that keeps `fixed`, or None (depth-first, in axis order)."""
    names = [axis for axis in domains if axis in fixed] + [a for a in domains if a not in fixed]
    assigned: dict[str, Any] = {}

    def extend(index: int) -> bool:
        if index == len(names):
            return True
        axis = names[index]
        choices = (fixed[axis],) if axis in fixed else domains[axis]
        for value in choices:
            assigned[axis] = value
            if invalid(assigned) is None and extend(index + 1):
                return True
        del assigned[axis]
        return False

    return dict(assigned) if extend(0) else None


def _pairs(settings: Mapping[str, Any], names: list[str]) -> set:
    return {((a, settings[a]), (b, settings[b])) for i, a in enumerate(names)
            for b in names[i + 1:]}


def feasible_pairs(domains: Mapping[str, tuple]) -> set:
    """Every pair of values of two axes that some valid cell holds."""
    return set(_feasible_pairs(tuple(domains.items())))


@functools.lru_cache(maxsize=8)  # the generator and `uncovered` ask for the same space
def _feasible_pairs(items: tuple) -> frozenset:
    domains = dict(items)
    names = list(domains)
    return frozenset(((a, va), (b, vb)) for i, a in enumerate(names) for b in names[i + 1:]
                     for va in domains[a] for vb in domains[b]
                     if _completion({a: va, b: vb}, domains) is not None)


def covering_cells(space: Optional[Mapping[str, Iterable]] = None, seed: int = 0) -> list[Cell]:
    """Valid cells covering every value and every valid pair of values of `space` (all axes,
    all values by default); see [Note: the covering array]."""
    domains = check_space(space or {})
    names = list(domains)
    rng = random.Random(seed)
    todo = sorted(feasible_pairs(domains), key=repr)
    rng.shuffle(todo)
    left = set(todo)
    cells = []
    while left:
        (a, va), (b, vb) = next(pair for pair in todo if pair in left)
        fixed = {a: va, b: vb}
        order = [axis for axis in names if axis not in fixed]
        rng.shuffle(order)
        for axis in order:  # greedily: the value that covers most new pairs and stays valid
            best, best_gain = None, -1
            for value in domains[axis]:
                trial = {**fixed, axis: value}
                gain = sum(1 for other, held in fixed.items()
                           if _pair(axis, value, other, held) in left)
                if gain > best_gain and _completion(trial, domains) is not None:
                    best, best_gain = value, gain
            fixed[axis] = best
        left -= _pairs(fixed, names)
        cells.append(Cell.of(**fixed))
    return cells


def _pair(axis: str, value, other: str, held) -> tuple:
    first, second = sorted(((axis, value), (other, held)), key=lambda item: list(AXES).index(
        item[0]))
    return (first, second)


def uncovered(cells: Iterable[Cell], space: Optional[Mapping[str, Iterable]] = None) -> set:
    """The feasible pairs of `space` that no cell holds (empty for a covering array)."""
    domains = check_space(space or {})
    names = list(domains)
    held = set()
    for cell in cells:
        held |= _pairs(cell.as_dict(), names)
    return feasible_pairs(domains) - held
