"""Compare runs: tolerances by dtype, the first diverging step, the parameters that differ most.

Every check is a *ratio*: deviation / allowance, so 1.0 is the edge of the tolerance and the
numbers of different quantities can be put in one table.

[Note: tolerances]
Losses, gradient norms and state-dict elements use torch.testing's defaults for the compute
dtype: |a - b| <= atol + rtol * |b|. The digest sums many elements, so its allowance is the
root-sum-square of the per-element allowances (elements' rounding errors are independent):
    sum:   atol * sqrt(N) + rtol * sqrt(sum p^2)
    sumsq: 2 * (atol * sqrt(sum p^2) + rtol * sqrt(sum p^4))      (d(p^2) = 2 p dp)
Equivalent fp32 runs on CPU stay orders of magnitude inside these; a bug does not.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import torch

from fsdp_bridge.harness.arguments import check_tolerance_value
from fsdp_bridge.harness.digest import Digest
from fsdp_bridge.harness.names import STRICT_STEPS
from fsdp_bridge.harness.resolution import advice, digests_identical, sensitivity

EXIT_AGREE, EXIT_DISAGREE, EXIT_ERROR, EXIT_INCONCLUSIVE = 0, 1, 2, 3
EQUIVALENT, DIFFERENT, INCONCLUSIVE = "equivalent", "different", "inconclusive"


def exit_code_for(errors: Sequence[str], comparisons: Sequence[Comparison]) -> int:
    """The harness's exit status: 2 when a run failed, else 1 if a comparison differs, else 3 if
    one cannot tell (see [Note: resolution] in resolution.py), else 0."""
    if errors:
        return EXIT_ERROR
    outcomes = {c.outcome for c in comparisons}
    if DIFFERENT in outcomes:
        return EXIT_DISAGREE
    return EXIT_INCONCLUSIVE if INCONCLUSIVE in outcomes else EXIT_AGREE


class Verdict:
    """What a report concludes from its `errors` and `comparisons` (the report defines both)."""

    errors: Sequence[str]
    comparisons: Sequence[Comparison]

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_AGREE

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.errors, self.comparisons)


# [Note: tolerance growth]
# Two correct implementations that sum in different orders (one process on the whole batch, or
# ranks reducing their gradients) differ by a rounding at the first step; training feeds that
# difference back, so it grows step by step. Measured on the tiny Llama in fp32 over 200 steps
# (`fsdp-bridge compare --steps 200`): native FSDP1, native FSDP2 and our engine's fully_shard
# deviate from the reference alike, leave its one-step tolerance at step 149 and reach 17x it
# at step 200, but never more than 0.09 x step of it. That growth starts from a rounding and
# compounds, so it stays far below the one-step tolerance for many steps; a real change (a
# learning rate 1 % off) shows from the first steps at its full size and then grows only
# linearly, as fast as a linear allowance: growing the allowance from step 1 absorbs it.
# - "window" (the default): the one-step tolerance for the first STRICT_STEPS steps, then
#   growing linearly from there (step k allows k - STRICT_STEPS + 1 times it). The strict
#   window is where a changed setting is caught; measured in benchmarks/verdict_rates.py.
# - "linear": step k (and the final parameters, after k steps) allow k times the one-step
#   tolerance. Catches a bug that is off from step 1, but not a slow, steady drift.
# - "none": every step gets the one-step tolerance (short runs; the pytest fixture).
GROWTH = ("window", "linear", "none")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    dtype: str
    rtol: float
    atol: float
    growth: str = "window"  # see [Note: tolerance growth]

    def describe(self) -> str:
        grows = {
            "linear": " at step 1, times k at step k (and after k steps for the final "
                      "parameters: rounding differences compound)",
            "window": f" at steps 1-{STRICT_STEPS}, times k-{STRICT_STEPS - 1} at a later step "
                      "k (and for the final parameters)",
        }.get(self.growth, " at every step")
        return (f"{self.dtype}: |a-b| <= {self.atol:g} + {self.rtol:g}*|b| per value "
                f"(torch.testing defaults){grows}; digest sums: root-sum-square of those")

    def at_step(self, step: int) -> "Tolerance":
        """The tolerance that applies at `step` (counted from 1)."""
        factor = {"linear": step, "window": step - STRICT_STEPS + 1}.get(self.growth, 1)
        if factor <= 1:
            return self
        return dataclasses.replace(self, rtol=self.rtol * factor, atol=self.atol * factor)

    def allowance(self, reference: float) -> float:
        return self.atol + self.rtol * abs(reference)

    def ratio(self, value: Optional[float], reference: Optional[float],
              printed: float = 0.0) -> float:
        """|value - reference| / allowance; `printed`: the values' printed resolution, added."""
        if value is None or reference is None:
            return 0.0 if value is None and reference is None else math.inf
        return _deviation(value, reference, self.allowance(reference) + printed)

    def digest_allowances(self, reference: Digest) -> tuple[float, float]:
        """The allowances of the digest's sum and sum of squares; see [Note: tolerances]."""
        norm = math.sqrt(abs(reference.sumsq))
        return (self.atol * math.sqrt(reference.numel) + self.rtol * norm,
                2 * (self.atol * norm + self.rtol * math.sqrt(abs(reference.sum4))))

    def digest_ratio(self, value: Optional[Digest], reference: Optional[Digest]) -> float:
        if value is None or reference is None:
            return 0.0 if value is None and reference is None else math.inf
        sum_allowance, sumsq_allowance = self.digest_allowances(reference)
        return max(_deviation(value.sum, reference.sum, sum_allowance),
                   _deviation(value.sumsq, reference.sumsq, sumsq_allowance))

    def tensor_ratio(self, value: torch.Tensor, reference: torch.Tensor) -> float:
        if not reference.is_floating_point():
            return 0.0 if torch.equal(value, reference) else math.inf
        value, reference = value.double(), reference.double()
        allowance = self.atol + self.rtol * reference.abs()
        # Equal values (NaN and NaN, inf and inf included) deviate by 0, even with a zero
        # allowance; anything else over a zero or NaN allowance is infinitely far.
        same = (value == reference) | (value.isnan() & reference.isnan())
        ratio = ((value - reference).abs() / allowance).nan_to_num(nan=math.inf, posinf=math.inf)
        ratio = torch.where(same, torch.zeros_like(ratio), ratio)
        return float(ratio.max()) if ratio.numel() else 0.0


def _deviation(value: float, reference: float, allowance: float) -> float:
    """|value - reference| / allowance; equal values (NaN == NaN here: a run that turns NaN
    at the same step as its baseline agrees with it) deviate by 0, even when allowance is 0."""
    if value == reference or (math.isnan(value) and math.isnan(reference)):
        return 0.0
    if math.isnan(value) or math.isnan(reference) or not allowance > 0:
        return math.inf
    deviation = abs(value - reference) / allowance
    return deviation if not math.isnan(deviation) else math.inf


def first_nan_step(steps: Sequence) -> Optional[tuple[int, str]]:
    """(step, what) of the first step record (StepRecord-like) whose loss, gradient norm or
    parameter digest is NaN or infinite, or None."""
    for record in steps:
        values = {"loss": record.loss, "gradient norm": record.grad_norm}
        if record.digest is not None:
            values["parameters"] = record.digest.sum
        for what, value in values.items():
            if value is not None and not math.isfinite(value):
                return record.step, f"{what} {value}"
    return None


TOLERANCES = {
    "fp32": Tolerance("fp32", rtol=1.3e-6, atol=1e-5),
    "bf16": Tolerance("bf16", rtol=1.6e-2, atol=1e-5),
    "fp16": Tolerance("fp16", rtol=1e-3, atol=1e-5),
}


def tolerance_for(dtype: str, rtol: Optional[float] = None,
                  atol: Optional[float] = None, growth: str = "window") -> Tolerance:
    """The default tolerance of a compute dtype, optionally overridden; `growth` as in
    [Note: tolerance growth]."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r} has no default tolerance: use one of "
                         f"{', '.join(TOLERANCES)}.")
    if growth not in GROWTH:
        raise ValueError(f"growth={growth!r}: use one of {', '.join(GROWTH)}.")
    check_tolerance_value("rtol", rtol)
    check_tolerance_value("atol", atol)
    base = TOLERANCES[dtype]
    return dataclasses.replace(base, rtol=base.rtol if rtol is None else rtol,
                               atol=base.atol if atol is None else atol, growth=growth)


@dataclasses.dataclass
class StepCheck:
    """One step of a candidate against the baseline; each *_ratio is deviation / allowance."""

    step: int
    loss: Optional[float]
    baseline_loss: Optional[float]
    loss_ratio: float
    grad_norm_ratio: float
    digest_ratio: float

    @property
    def ratio(self) -> float:
        return max(self.loss_ratio, self.grad_norm_ratio, self.digest_ratio)

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@dataclasses.dataclass
class ParamDiff:
    name: str
    max_abs: float
    ratio: float


@dataclasses.dataclass
class Comparison:
    baseline: str
    candidate: str
    steps: list[StepCheck] = dataclasses.field(default_factory=list)
    params: list[ParamDiff] = dataclasses.field(default_factory=list)  # worst first
    problems: list[str] = dataclasses.field(default_factory=list)  # errors, missing keys
    # What a 1 % learning-rate change would have done, over the allowance (resolution.py);
    # None: not judged (no steps compared).
    sensitivity: Optional[float] = None
    identical_digests: bool = False  # every parameter digest equal: no resolution needed
    # Why a 1 % change could not be seen, and the fix (resolution.advice); said when inconclusive.
    advice: str = ""

    @property
    def first_diverging_step(self) -> Optional[int]:
        return next((check.step for check in self.steps if not check.ok), None)

    @property
    def diverging_params(self) -> list[ParamDiff]:
        return [diff for diff in self.params if diff.ratio > 1.0]

    @property
    def ok(self) -> bool:
        """Within tolerance everywhere (which is "equivalent" only if `outcome` says so)."""
        return (not self.problems and self.first_diverging_step is None
                and not self.diverging_params)

    @property
    def can_resolve(self) -> bool:
        """Whether a 1 % learning-rate change would have left the tolerance somewhere."""
        return self.identical_digests or self.sensitivity is None or self.sensitivity >= 1.0

    @property
    def outcome(self) -> str:
        if self.ok:
            return EQUIVALENT if self.can_resolve else INCONCLUSIVE
        # Final weights that differ one by one, after steps that all agree, at a precision
        # that could not have seen a 1 % change: measured in bf16, single weights of equivalent
        # runs differ after 200 steps as much as those of changed runs (README, "How far to
        # trust the verdict"). That is "cannot tell", not "different".
        only_params = not self.problems and self.first_diverging_step is None
        return INCONCLUSIVE if only_params and not self.can_resolve else DIFFERENT

    def summary(self) -> str:
        worst = max([c.ratio for c in self.steps] + [p.ratio for p in self.params] + [0.0])
        if self.outcome == INCONCLUSIVE:
            agree = ("every step agrees but final weights differ" if self.diverging_params
                     else f"they agree (worst deviation {worst:.3g} of tolerance)")
            return (f"cannot tell whether {self.candidate} is equivalent to {self.baseline}: "
                    f"{agree}, but a 1 % "
                    f"learning-rate change would have stayed within it too (it would reach "
                    f"{self.sensitivity:.2g} of the tolerance): {self.advice}")
        if self.ok:
            return (f"{self.candidate} agrees with {self.baseline} "
                    f"(worst deviation {worst:.3g} of tolerance{self._resolution()})")
        parts = [f"{self.candidate} differs from {self.baseline}:"]
        parts += self.problems[:1]
        if self.first_diverging_step is not None:
            parts.append(f"first diverging step {self.first_diverging_step}")
        if self.diverging_params:
            names = ", ".join(p.name for p in self.diverging_params[:3])
            parts.append(f"parameters that differ most: {names}")
        return " ".join(parts[:1]) + " " + "; ".join(parts[1:])

    def _resolution(self) -> str:
        if self.identical_digests:
            return "; parameters equal bit for bit"
        if self.sensitivity is None:
            return ""
        return f"; a 1 % learning-rate change would reach {self.sensitivity:.2g} of it"


_WRAPPER_PARTS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def clean_key(key: str) -> str:
    """A state-dict key without wrapper components (FSDP1, activation checkpointing, compile)."""
    previous = None
    while previous != key:
        previous, key = key, _WRAPPER_PARTS.sub(r"\1", key)
    return key


def compare_state_dicts(baseline: dict, candidate: dict, tol: Tolerance,
                        comparison: Comparison) -> None:
    base = {clean_key(k): v for k, v in baseline.items()}
    cand = {clean_key(k): v for k, v in candidate.items()}
    for key in sorted(base.keys() ^ cand.keys()):
        where = comparison.baseline if key in base else comparison.candidate
        comparison.problems.append(f"state dict key {key!r} only in {where}")
    for key in sorted(base.keys() & cand.keys()):
        a, b = cand[key], base[key]
        if a.shape != b.shape:
            comparison.problems.append(f"{key}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        max_abs = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        comparison.params.append(ParamDiff(key, max_abs, tol.tensor_ratio(a, b)))
    comparison.params.sort(key=lambda diff: diff.ratio, reverse=True)


def compare_steps(baseline_steps: Sequence, candidate_steps: Sequence, tol: Tolerance,
                  comparison: Comparison) -> None:
    if len(baseline_steps) != len(candidate_steps):
        comparison.problems.append(f"{len(candidate_steps)} steps vs {len(baseline_steps)} in "
                                   f"{comparison.baseline}")
    comparison.sensitivity = sensitivity(baseline_steps, tol)
    comparison.advice = advice(baseline_steps, tol, TOLERANCES["fp32"])
    comparison.identical_digests = bool(digests_identical(baseline_steps, candidate_steps))
    for base, cand in zip(baseline_steps, candidate_steps):
        at = tol.at_step(base.step)
        printed = max(getattr(base, "loss_quantum", 0.0), getattr(cand, "loss_quantum", 0.0))
        comparison.steps.append(StepCheck(
            step=base.step, loss=cand.loss, baseline_loss=base.loss,
            loss_ratio=at.ratio(cand.loss, base.loss, printed),
            grad_norm_ratio=at.ratio(cand.grad_norm, base.grad_norm),
            digest_ratio=at.digest_ratio(cand.digest, base.digest)))


def compare_runs(baseline, candidate, tol: Tolerance) -> Comparison:
    """Compare two RunRecords (see runner.py) step by step and by final state dict."""
    comparison = Comparison(baseline.backend, candidate.backend)
    for record in (baseline, candidate):
        if record.error:
            comparison.problems.append(f"{record.backend} failed: "
                                       f"{record.error.strip().splitlines()[-1]}")
    if comparison.problems:
        return comparison
    compare_steps(baseline.steps, candidate.steps, tol, comparison)
    last = max((record.step for record in baseline.steps), default=1)
    compare_state_dicts(baseline.state_dict, candidate.state_dict, tol.at_step(last), comparison)
    return comparison
