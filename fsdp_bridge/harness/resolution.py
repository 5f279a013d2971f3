"""Could a comparison have seen a 1 % learning-rate change? (the verdict's resolution)

[Note: resolution]
Runs that stay within tolerance at every step differ by less than the tolerance; that makes them
equivalent only if a real change would have left it. The yardstick is the smallest change an
engineer comparing loss curves expects to catch: the learning rate off by 1 %. To first order
such a change scales every update by 1.01, so whatever training moves ends up 1 % further from
where it started. From the baseline alone we predict, at every step k, what a 1 % change would do
and divide it by the allowance at that step (the tolerance there, growth included):
- parameter sum and sum of squares (digest): 1 % of |q_k - q_0|, q_0 the digest before the first
  update (or after it, for runs that record no step 0: the change at step 1 is then not counted,
  which only makes the estimate smaller);
- loss: 1 % of how far the loss has come, measured so that batch-to-batch scatter cannot pass for
  progress: |mean of the first W losses - mean of the W losses up to step k| less Z standard
  errors of that difference (0 when the run is shorter than 2 W steps). Z is 4, not 2: the
  largest of some hundred such differences (one per step) is judged, and a flat, scattering loss
  must not pass for progress at any of them.
The comparison's sensitivity is the largest of these ratios. Below 1, no quantity would have left
its allowance at any step under a 1 % change: the runs cannot be told apart from such a change
and the verdict is "inconclusive", never "equivalent". Runs whose parameter digests agree bit for
bit are equivalent regardless (any change of the learning rate alters those float64 sums).
Checked against real +1 % / -1 % runs (benchmarks/verdict_rates.py): with parameter digests the
prediction is 2-4x below what the changes reached in fp32 (never above by more than 1.1x, in
bf16); from the loss alone it is far below (the loss of a random-token model barely falls).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

from fsdp_bridge.harness.names import STRICT_STEPS

LR_CHANGE = 0.01  # the smallest learning-rate change a verdict must be able to see
LOSS_WINDOW = 10  # W above: steps averaged at each end of the loss's progress
STANDARD_ERRORS = 4.0  # Z above


def loss_progress(losses: Sequence[float], upto: int, window: int = LOSS_WINDOW) -> float:
    """How far the loss has moved from its first `window` values to the `window` values ending at
    index `upto` (inclusive), less STANDARD_ERRORS standard errors; 0 when that cannot be told
    from scatter."""
    if upto + 1 < 2 * window:
        return 0.0
    head, tail = losses[:window], losses[upto + 1 - window:upto + 1]
    if not all(math.isfinite(value) for value in (*head, *tail)):
        return 0.0
    error = math.sqrt((statistics.variance(head) + statistics.variance(tail)) / window)
    return max(0.0, abs(statistics.fmean(head) - statistics.fmean(tail))
               - STANDARD_ERRORS * error)


def sensitivity(baseline: Sequence, tolerance) -> float:
    """The largest (effect of a 1 % learning-rate change) / (allowance) over steps and quantities
    of a baseline run (StepRecord-like rows, step 0 optional); see [Note: resolution]."""
    rows = [row for row in baseline if row.step >= 1]
    best = 0.0
    losses = [row.loss for row in rows]
    if all(loss is not None for loss in losses):
        for index, row in enumerate(rows):
            effect = LR_CHANGE * loss_progress(losses, index)
            allowance = tolerance.at_step(row.step).allowance(row.loss)
            best = max(best, _ratio(effect, allowance + getattr(row, "loss_quantum", 0.0)))
    start = next((row.digest for row in baseline if row.digest is not None), None)
    if start is None:
        return best
    for row in rows:
        if row.digest is None:
            continue
        sum_allowance, sumsq_allowance = tolerance.at_step(row.step).digest_allowances(row.digest)
        best = max(best,
                   _ratio(LR_CHANGE * abs(row.digest.sum - start.sum), sum_allowance),
                   _ratio(LR_CHANGE * abs(row.digest.sumsq - start.sumsq), sumsq_allowance))
    return best


def _ratio(effect: float, allowance: float) -> float:
    if not math.isfinite(effect) or not allowance > 0:
        return 0.0
    return effect / allowance


def digests_identical(baseline: Sequence, candidate: Sequence) -> Optional[bool]:
    """Whether both runs recorded parameter digests and every one is equal (None: no digests)."""
    pairs = [(a.digest, b.digest) for a, b in zip(baseline, candidate)]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return all(a == b for a, b in pairs) and len(baseline) == len(candidate)


# [Note: why a comparison cannot tell]
# An inconclusive verdict is only useful with the reason this comparison could not resolve a 1 %
# change, since each reason has its own fix: a tolerance coarser than fp32's (compare in fp32),
# losses alone because no torch optimizer step was recorded (step one, or train at least two loss
# windows, on data whose loss falls), or parameters that moved too little in the steps given
# (train longer; how long is extrapolated from how far they moved per step, since with a steady
# optimizer the reach grows about linearly with the updates, while the allowance stays the
# one-step tolerance inside the strict window).


def advice(baseline: Sequence, tolerance, finest) -> str:
    """Why a comparison against this baseline could not see a 1 % learning-rate change, and what
    would let it (see [Note: why a comparison cannot tell]); `finest` is fp32's default
    tolerance."""
    if tolerance.rtol > finest.rtol or tolerance.atol > finest.atol:
        return _coarse_tolerance(tolerance, finest)  # more steps would not help
    recorded = [row for row in baseline if row.digest is not None]
    if recorded:
        return _few_updates(baseline, recorded, tolerance)
    return _loss_only([row for row in baseline if row.step >= 1])


def _coarse_tolerance(tolerance, finest) -> str:
    if tolerance.dtype != finest.dtype:
        return (f"the {tolerance.dtype} tolerance ({tolerance.rtol:g} of each value) is wider "
                "than 1 % of what training moved: compare fp32 runs (--dtype fp32, the scripts "
                "training in fp32) to tell")
    return (f"the tolerance given (rtol {tolerance.rtol:g}, atol {tolerance.atol:g}) is wider "
            f"than fp32's default (rtol {finest.rtol:g}, atol {finest.atol:g}): leave out "
            "--rtol / --atol to tell")


def _loss_only(rows: Sequence) -> str:
    steps = len(rows)
    said = ("no torch optimizer step was recorded (a hand-written update?), so only the printed "
            "losses were compared")
    fix = "or step a torch.optim optimizer, whose parameter digests resolve far better"
    if steps < 2 * LOSS_WINDOW:
        return (f"{said}, and a loss's progress is told from its batch-to-batch scatter only "
                f"over {2 * LOSS_WINDOW} steps or more ({steps} here): train at least "
                f"{2 * LOSS_WINDOW} steps, {fix}")
    return (f"{said}, and the loss did not fall measurably over {steps} steps (by more than "
            f"{STANDARD_ERRORS:g} standard errors of its scatter): train on data the model can "
            f"learn, or longer, {fix}")


def _few_updates(baseline: Sequence, recorded: Sequence, tolerance) -> str:
    """Parameters that moved too little: how many steps would do, extrapolated."""
    start, last = recorded[0], recorded[-1]
    updates = last.step - start.step  # the updates the reach was measured over
    steps = last.step
    if updates < 1:
        return (f"one step only: parameter movement is measured from step {start.step}'s "
                "digest, so there is none to measure; train more steps")
    reach = sensitivity(baseline, tolerance)
    if reach <= 0.0:
        return (f"the parameters did not move in {steps} steps (a learning rate of 0, or every "
                "parameter frozen?): check that the optimizer steps them")
    needed = start.step + math.ceil(updates / reach)
    said = (f"too few steps: in {steps} the parameters moved too little for a 1 % learning-rate "
            f"change to leave the tolerance")
    if needed > STRICT_STEPS:
        return (f"{said}, and at the pace they moved it would take more than {STRICT_STEPS} "
                "steps, after which the tolerance grows as fast: train with a larger learning "
                "rate, or accept the runs as not distinguishable from a 1 % change")
    return (f"{said}: train about {needed} steps or more (extrapolated from how far they moved "
            "per step)")
