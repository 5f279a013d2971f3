"""A cell's status from its runs (runner.RunRecord): equal / differs / refused / crash /
no reference.

[Note: what "equal" means]
(Cells native cannot run on this torch are compared with native on `native_stand_in(cell)`,
and called `no reference` when they agree.)
Against a native baseline, `equal` means bit for bit: every step's loss, gradient norm, clip
norm and parameter digest, and every tensor of the final state dict. When ours is not bit for
bit equal, native trains the cell a second time: if native is bit for bit equal to itself
(always so far on CPU + gloo) the cell `differs`, naming the first step and quantity; if
native is not deterministic, ours is `equal` when it is within twice native's own run-to-run
deviation of every quantity (the basis column says which). Against the single-process
reference (YaFSDP, TorchAcc, and cells native cannot run here), summation orders differ, so the
basis is the harness's torch.testing tolerance of the compute dtype at every step.

A run that raised is `refused` when its error names one of the cell's settings, else `crash`.
A refusal conforms when the baseline refuses too, or when README lists it (`LISTED_REFUSALS`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable, Optional

import torch

from fsdp_bridge.harness.compare import INCONCLUSIVE, clean_key, compare_runs, tolerance_for
from fsdp_bridge.harness.matrix.axes import (
    DEFAULTS,
    Cell,
    known_difference,
    rounding_difference,
)
from fsdp_bridge.harness.matrix.model import BUFFER_SUFFIXES

EQUAL, DIFFERS, REFUSED, CRASH, NO_REFERENCE, NOT_RUN = (
    "equal", "differs", "refused", "crash", "no reference", "not run")

# Words an error must contain to name a setting of the cell's axis (else it is a crash).
SETTING_WORDS = {
    "param": ("param_dtype", "mixed"), "reduce": ("reduce_dtype", "mixed"),
    "buffer": ("buffer_dtype", "mixed"), "accumulate": ("no_sync", "gradient_sync", "accumulat"),
    "offload": ("offload",), "ac": ("checkpoint_wrapper", "activation checkpoint", "reentrant"),
    "compile": ("compile",),
    "strategy": ("sharding_strategy", "strategy", "shard"), "tied": ("tied", "shared"),
    "frozen": ("requires_grad", "frozen"), "ignored": ("ignored",),
    "orig_params": ("use_orig_params",), "init": ("sync_module_states", "param_init_fn", "meta"),
    "clip": ("clip",), "resume": ("state_dict_type", "state_dict_config", "StateDictConfig"),
    "outer": ("FullyShardedDataParallel", "fully_shard"), "late_param": ("parameter",),
    "odd_args": ("requires_gradient_sync", "state_dict_config"),
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A refusal of ours that README lists (it conforms though native trains the cell)."""

    name: str
    matches: Callable[[Cell], bool]


LISTED_REFUSALS: tuple[Refusal, ...] = (
    Refusal("a torch wrapper around our FSDP1 blocks is refused at our first forward (README, "
            "Mixing dialects)", lambda c: c.outer != "none"),
    Refusal("a parameter assigned after our wrap is refused at the next forward (README, "
            "Mixing dialects)", lambda c: c.late_param),
    Refusal("torch's state-dict helpers over FSDP1's flat parameters are refused by name "
            "(README, Checkpoints)",
            lambda c: c.frontend == "fsdp1" and not c.orig_params and c.resume == "sharded"),
)


@dataclasses.dataclass
class Outcome:
    """What the matrix says about one cell."""

    cell: Cell
    status: str
    conforming: bool
    basis: str = ""  # what "equal" was judged by
    detail: str = ""  # first differing step and quantity, or the error's last line
    known: Optional[str] = None  # the KNOWN entry that covers a non-conforming cell
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"cell": self.cell.as_dict(), "label": self.cell.label(), "status": self.status,
                "conforming": self.conforming, "basis": self.basis, "detail": self.detail,
                "known": self.known, "seconds": round(self.seconds, 2)}


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Unsupported|Interrupt)\b.*:")


def last_line(error: str) -> str:
    """The line that names the exception (torch.compile's errors end with hints instead)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    named = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (named or lines or ["(no message)"])[-1]


def names_a_setting(cell: Cell, error: str) -> bool:
    message = last_line(error).lower()
    changed = [axis for axis, value in cell.settings if value != DEFAULTS[axis]]
    return any(word.lower() in message for axis in changed for word in SETTING_WORDS.get(axis, ()))


def _state_difference(baseline: dict, candidate: dict) -> Optional[str]:
    base = {clean_key(k): v for k, v in baseline.items()}
    cand = {clean_key(k): v for k, v in candidate.items()}
    if base.keys() != cand.keys():
        key = sorted(base.keys() ^ cand.keys())[0]
        return f"final state dict: key {key!r} only in {'native' if key in base else 'ours'}"
    for key in sorted(base):
        a, b = cand[key], base[key]
        if a.shape != b.shape:
            return f"final state dict: {key} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = float((a.double() - b.double()).abs().max())
            return f"final state dict: {key} max|diff| {diff:.3g}"
    return None


def _step_values(record) -> dict:
    values = {"loss": record.loss, "grad norm": record.grad_norm,
              "clip norm": record.clip_norm}
    if record.digest is not None:
        values["weights sum"] = record.digest.sum
        values["weights sum of squares"] = record.digest.sumsq
    return values


# The digest's float64 sums (weights, and the gradient norm) add each rank's pieces: where the
# shards split changes their rounding. Held to this relative bound instead of bit for bit: one
# fp32 ulp of one weight of the matrix's model moves them some 100 times more.
FLOAT64_SUMS = ("grad norm", "weights sum", "weights sum of squares")
FLOAT64_ROUNDING = 1e-12


def _same(quantity: str, value, other) -> bool:
    if value == other:
        return True
    if not isinstance(value, float) or not isinstance(other, float):
        return False
    if math.isnan(value) and math.isnan(other):
        return True
    return quantity in FLOAT64_SUMS and abs(value - other) <= FLOAT64_ROUNDING * max(
        abs(value), abs(other))


def first_difference(baseline, candidate) -> Optional[str]:
    """The first step and quantity where two runs are not equal, or None: bit for bit but for
    the digest's float64 sums (FLOAT64_ROUNDING)."""
    if len(baseline.steps) != len(candidate.steps):
        return f"{len(candidate.steps)} steps vs {len(baseline.steps)}"
    for base, cand in zip(baseline.steps, candidate.steps):
        base_values, cand_values = _step_values(base), _step_values(cand)
        for quantity, value in base_values.items():
            other = cand_values[quantity]
            if not _same(quantity, value, other):
                return f"step {base.step}: {quantity} {other!r} vs {value!r}"
    return _state_difference(baseline.state_dict, candidate.state_dict)


def _deviations(baseline, candidate) -> list[float]:
    """Every quantity's |candidate - baseline|, in a fixed order (steps, then tensors)."""
    out = []
    for base, cand in zip(baseline.steps, candidate.steps):
        cand_values = _step_values(cand)
        for quantity, value in _step_values(base).items():
            other = cand_values[quantity]
            out.append(0.0 if value == other else abs((other or 0.0) - (value or 0.0)))
    for key in sorted(baseline.state_dict):
        a, b = candidate.state_dict.get(key), baseline.state_dict[key]
        out.append(float((a.double() - b.double()).abs().max()) if a is not None
                   and a.numel() else 0.0)
    return out


def within_run_to_run(native, native_again, ours) -> bool:
    """Ours within twice native's own run-to-run deviation of every quantity."""
    allowed = _deviations(native, native_again)
    found = _deviations(native, ours)
    return len(allowed) == len(found) and all(f <= 2 * a for f, a in zip(found, allowed))


# The tolerance of the least precise dtype a cell computes, reduces or keeps buffers in.
_COARSER = ("fp32", "fp16", "bf16")


def _reference_dtype(cell: Cell) -> str:
    used = [cell.param] + [value for value in (cell.reduce, cell.buffer) if value != "default"]
    return max(used, key=_COARSER.index)


def _against_reference(cell: Cell, reference, ours) -> tuple[bool, str, str]:
    dtype = _reference_dtype(cell)
    # Summation orders differ from the reference's at every step and compound ([Note:
    # tolerance growth] in compare.py): step k, and the final weights, allow k times.
    tolerance = tolerance_for(dtype, growth="linear")
    if cell.buffer != "default":  # the reference keeps buffers in fp32: compare parameters
        names = {clean_key(name) for name in reference.state_dict
                 if name.endswith(BUFFER_SUFFIXES)}
        reference = dataclasses.replace(reference, state_dict={
            k: v for k, v in reference.state_dict.items() if clean_key(k) not in names})
        ours = dataclasses.replace(ours, state_dict={
            k: v for k, v in ours.state_dict.items() if clean_key(k) not in names})
    comparison = compare_runs(reference, ours, tolerance)
    basis = f"single-process reference, {dtype} tolerance (rtol {tolerance.rtol:g})"
    clip = [(b.clip_norm, c.clip_norm) for b, c in zip(reference.steps, ours.steps)]
    clip_ok = all(tolerance.ratio(c, b) <= 1.0 for b, c in clip)
    if comparison.ok and clip_ok:
        return True, basis, ""
    if clip_ok and comparison.outcome == INCONCLUSIVE:
        # Every step agrees; single final weights do not, at a precision that could not have
        # seen a 1 % learning-rate change either (the harness's verdict: cannot tell).
        return True, basis + "; final weights beyond it where this precision cannot tell", \
            comparison.summary()
    step = comparison.first_diverging_step
    if step is not None:
        check = comparison.steps[step]
        worst = max((("loss", check.loss_ratio), ("grad norm", check.grad_norm_ratio),
                     ("weights", check.digest_ratio)), key=lambda item: item[1])
        return False, basis, f"step {step}: {worst[0]} {worst[1]:.3g} x the tolerance"
    if not clip_ok:
        return False, basis, "clip norm beyond the tolerance"
    detail = comparison.problems[0] if comparison.problems else (
        f"final state dict: {comparison.params[0].name} {comparison.params[0].ratio:.3g} x "
        "the tolerance")
    return False, basis, detail


def judge(cell: Cell, runs: dict, native_limit: Optional[str], seconds: float = 0.0) -> Outcome:
    """The outcome of a cell from its runs: "native" or "reference" (the baseline), "ours",
    and "native-again" (native's second run, when ours was not bit for bit equal)."""
    baseline_side = "reference" if "reference" in runs else "native"
    baseline, ours = runs[baseline_side], runs["ours"]
    outcome = _classify(cell, baseline_side, baseline, ours, runs.get("native-again"),
                        native_limit)
    if native_limit and outcome.status == EQUAL:
        outcome.status = NO_REFERENCE
        outcome.basis = f"{outcome.basis}, against native without what it cannot run here"
        outcome.detail = native_limit
    if not outcome.conforming:
        known = known_difference(cell)
        outcome.known = known.name if known else None
    return outcome


def _classify(cell, baseline_side, baseline, ours, native_again, native_limit) -> Outcome:
    if baseline.error and baseline_side == "reference":
        return Outcome(cell, CRASH, False, detail="the reference failed: "
                       + last_line(baseline.error))
    if ours.error:
        status = REFUSED if names_a_setting(cell, ours.error) else CRASH
        if baseline.error:  # native cannot either: ours behaves as native
            return Outcome(cell, status, True, basis="native fails too",
                           detail=f"ours: {last_line(ours.error)}; native: "
                                  f"{last_line(baseline.error)}")
        listed = next((r.name for r in LISTED_REFUSALS if r.matches(cell)), None)
        if status == REFUSED and listed:
            return Outcome(cell, REFUSED, True, basis=listed, detail=last_line(ours.error))
        return Outcome(cell, status, False, detail=f"ours: {last_line(ours.error)}")
    if baseline.error:
        if names_a_setting(cell, baseline.error):  # a refusal of native's that ours lacks
            return Outcome(cell, DIFFERS, False,
                           detail=f"native refuses, ours trains: {last_line(baseline.error)}")
        return Outcome(cell, NO_REFERENCE, True, basis="native fails here, ours trains "
                       "(nothing to compare with)", detail=last_line(baseline.error))
    if baseline_side == "reference":
        ok, basis, detail = _against_reference(cell, baseline, ours)
        return Outcome(cell, EQUAL if ok else DIFFERS, ok, basis=basis, detail=detail)
    difference = first_difference(baseline, ours)
    if difference is None:
        return Outcome(cell, EQUAL, True, basis="bit for bit")
    if native_again is None or native_again.error or first_difference(baseline,
                                                                      native_again) is None:
        rounding = rounding_difference(cell)
        if rounding is not None:
            worst = _worst_ratio(cell, baseline, ours)
            if worst <= 1.0:
                return Outcome(cell, EQUAL, True, basis=f"within the {_reference_dtype(cell)} "
                               f"tolerance ({worst:.2g} of it), not bit for bit: "
                               f"{rounding.name}", detail=difference)
        return Outcome(cell, DIFFERS, False, basis="bit for bit (native is deterministic)",
                       detail=difference)
    ok = within_run_to_run(baseline, native_again, ours)
    return Outcome(cell, EQUAL if ok else DIFFERS, ok, basis="2 x native's run-to-run "
                   "deviation (native is not deterministic here)", detail="" if ok else difference)


def _worst_ratio(cell: Cell, baseline, ours) -> float:
    """The largest deviation / tolerance of the cell's coarsest dtype over every step, clip
    norm and final tensor."""
    tolerance = tolerance_for(_reference_dtype(cell), growth="none")
    comparison = compare_runs(baseline, ours, tolerance)
    ratios = [check.ratio for check in comparison.steps] + [p.ratio for p in comparison.params]
    ratios += [tolerance.ratio(c.clip_norm, b.clip_norm)
               for b, c in zip(baseline.steps, ours.steps)]
    return math.inf if comparison.problems else max(ratios + [0.0])


def not_run(cell: Cell, why: str) -> Outcome:
    return Outcome(cell, NOT_RUN, False, detail=why)


def crashed(cell: Cell, why: str, started: float) -> Outcome:
    return Outcome(cell, CRASH, False, detail=why, seconds=time.perf_counter() - started,
                   known=getattr(known_difference(cell), "name", None))
