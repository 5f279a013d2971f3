"""The verdict on synthetic loss and digest series: a steady drift of 1 % of the training
progress (what a +1 % learning rate does) is "different" under the default tolerance growth,
compounding rounding noise is "equivalent", and a comparison that could not have seen a 1 %
change says "inconclusive" (exit 3) instead of "equivalent"."""

from __future__ import annotations

import math
import random

import pytest

from fsdp_bridge.harness.compare import (
    DIFFERENT,
    EQUIVALENT,
    EXIT_AGREE,
    EXIT_DISAGREE,
    EXIT_INCONCLUSIVE,
    INCONCLUSIVE,
    STRICT_STEPS,
    Comparison,
    compare_steps,
    exit_code_for,
    tolerance_for,
)
from fsdp_bridge.harness.digest import Digest
from fsdp_bridge.harness.resolution import loss_progress, sensitivity
from fsdp_bridge.harness.runner import StepRecord

STEPS = 200


def _losses(start: float, end: float, scatter: float, seed: int = 0) -> list[float]:
    """A loss falling linearly from `start` to `end` over STEPS steps, plus batch scatter."""
    rng = random.Random(seed)
    return [start + (end - start) * k / (STEPS - 1) + rng.gauss(0.0, scatter)
            for k in range(STEPS)]


def _records(losses, digests=None) -> list[StepRecord]:
    digests = digests or [None] * len(losses)
    return [StepRecord(k, loss, digest.grad_norm if digest else None, digest)
            for k, (loss, digest) in enumerate(zip(losses, digests), start=1)]


def _judge(base, cand, growth="window", dtype="fp32") -> Comparison:
    comparison = Comparison("A", "B")
    compare_steps(base, cand, tolerance_for(dtype, growth=growth), comparison)
    return comparison


def test_flat_scatter_is_not_progress_but_a_falling_loss_is():
    flat = _losses(4.85, 4.85, scatter=0.05)
    assert loss_progress(flat, STEPS - 1) == 0.0  # within 4 standard errors of no change
    falling = _losses(4.0, 2.0, scatter=0.05)
    # Two nats, less the half-windows at each end (0.09) and 4 standard errors (0.09).
    assert 1.7 < loss_progress(falling, STEPS - 1) < 1.9
    assert loss_progress(falling, 18) == 0.0  # fewer than two windows of 10 steps


def test_a_one_percent_drift_of_the_progress_is_different_under_window_growth_only():
    # +1 % learning rate: the candidate's loss is 1 % further along than the baseline's. The
    # loss falls by 0.001 a step, so the drift grows by 1e-5 a step: 0.7 of the one-step
    # tolerance per step, as slow as on the tiny Llama.
    base = _losses(4.0, 3.8, scatter=0.05)
    drifted = [b - 0.01 * 0.001 * k for k, b in enumerate(base)]
    verdicts = {growth: _judge(_records(base), _records(drifted), growth)
                for growth in ("window", "linear")}
    assert verdicts["window"].outcome == DIFFERENT
    assert verdicts["window"].first_diverging_step <= 5
    # The previous default: the allowance grows as fast as the drift and absorbs it; it is no
    # longer called equivalent, since a 1 % change could not have been seen that way.
    assert verdicts["linear"].ok and verdicts["linear"].outcome == INCONCLUSIVE


def test_compounding_rounding_noise_stays_equivalent_over_200_steps():
    # Measured shape of equivalent runs (benchmarks/verdict_rates.py): a rounding at step 1,
    # compounding by ~6 % a step; 1e-3 of the one-step tolerance at first, ~100x it at step 200.
    base = _losses(4.0, 2.0, scatter=0.05)
    tol = tolerance_for("fp32")
    sign = random.Random(1)
    noisy = [b + (1 if sign.random() < 0.5 else -1) * 1e-3 * math.exp(0.058 * k)
             * tol.allowance(b) for k, b in enumerate(base)]
    comparison = _judge(_records(base), _records(noisy))
    assert comparison.outcome == EQUIVALENT, comparison.summary()
    assert exit_code_for([], [comparison]) == EXIT_AGREE
    assert _judge(_records(base), _records(noisy), growth="none").outcome == DIFFERENT


def test_loss_lines_that_cannot_show_a_one_percent_change_are_inconclusive():
    # Random tokens: the loss stays at log(vocab) and scatters; 1 % of no progress is nothing.
    flat = _losses(4.85, 4.85, scatter=0.05)
    comparison = _judge(_records(flat), _records(list(flat)))
    assert comparison.ok and comparison.sensitivity < 1.0
    assert comparison.outcome == INCONCLUSIVE
    assert exit_code_for([], [comparison]) == EXIT_INCONCLUSIVE
    assert "cannot tell" in comparison.summary()
    # bf16's tolerance (1.6 % of the loss) is wider than 1 % of a 2-nat progress.
    falling = _losses(4.0, 2.0, scatter=0.05)
    assert _judge(_records(falling), _records(list(falling)), dtype="bf16").outcome == INCONCLUSIVE
    assert _judge(_records(falling), _records(list(falling))).outcome == EQUIVALENT


def _digests(sums) -> list[Digest]:
    return [Digest(sum=s, sumsq=100.0, sum4=1.0, grad_norm=1.0, numel=10_000) for s in sums]


def test_parameters_moving_give_resolution_and_equal_digests_are_exact():
    flat = _losses(4.85, 4.85, scatter=0.05)
    tol = tolerance_for("fp32")
    # The parameters' sum moves by 1.0 over the run: 1 % of it is 1e-2, far above the digest
    # allowance (atol * sqrt(numel) = 1e-3), so a 1 % change would show in the digest.
    moving = _digests([k / STEPS for k in range(STEPS)])
    assert sensitivity(_records(flat, moving), tol) > 1.0
    # Parameters that do not move give no resolution...
    still = _digests([0.5] * STEPS)
    assert sensitivity(_records(flat, still), tol) < 1.0
    # ...but digests equal bit for bit are equivalent whatever the resolution.
    same = _judge(_records(flat, still), _records(list(flat), still))
    assert same.identical_digests and same.outcome == EQUIVALENT
    shifted = _digests([0.5 + 1e-15] + [0.5] * (STEPS - 1))
    assert _judge(_records(flat, still), _records(flat, shifted)).outcome == INCONCLUSIVE


def test_a_differing_comparison_wins_over_an_inconclusive_one():
    flat = _losses(4.85, 4.85, scatter=0.05)
    unsure = _judge(_records(flat), _records(list(flat)))
    off = _judge(_records(flat), _records([x + 1.0 for x in flat]))
    assert off.outcome == DIFFERENT
    assert exit_code_for([], [unsure, off]) == EXIT_DISAGREE
    assert exit_code_for(["a run failed"], [unsure]) == 2


def test_window_growth_is_the_default_and_strict_for_the_first_steps():
    tol = tolerance_for("fp32")
    assert tol.growth == "window"
    assert tol.at_step(STRICT_STEPS) == tol
    assert tol.at_step(STRICT_STEPS + 10).rtol == pytest.approx(11 * tol.rtol)
    assert f"at steps 1-{STRICT_STEPS}" in tol.describe()


def test_final_weights_alone_differing_are_inconclusive_only_without_resolution():
    from fsdp_bridge.harness.compare import ParamDiff

    falling = _losses(4.0, 2.0, scatter=0.05)
    for dtype, expected in (("bf16", INCONCLUSIVE), ("fp32", DIFFERENT)):
        comparison = _judge(_records(falling), _records(list(falling)), dtype=dtype)
        comparison.params.append(ParamDiff("layer.weight", max_abs=0.04, ratio=12.0))
        assert not comparison.ok and comparison.outcome == expected, dtype
        assert ("final weights differ" in comparison.summary()) == (expected == INCONCLUSIVE)


def test_printed_losses_are_compared_to_their_last_digit():
    from fsdp_bridge.harness.scripts import printed_quantum

    assert printed_quantum([4.8123, 4.81, 4.8124]) == pytest.approx(1e-4)
    assert printed_quantum([1.2345e-05, 3e-05]) == pytest.approx(1e-9)
    assert printed_quantum([float("nan")]) == 0.0
    # Two equivalent runs printing 4 decimals: one rounding lands on the other side at step 3.
    printed = [round(x, 4) for x in _losses(4.0, 2.0, scatter=0.05)]
    flipped = list(printed)
    flipped[2] = round(flipped[2] + 1e-4, 4)

    def rows(losses):
        return [StepRecord(k, x, None, None, printed_quantum(losses))
                for k, x in enumerate(losses, start=1)]

    assert _judge(rows(printed), rows(flipped)).outcome == EQUIVALENT
    assert _judge(_records(printed), _records(flipped)).first_diverging_step == 3
    # Fewer printed digits, less resolution: 1 % of a 2-nat fall is 0.02 < 0.1.
    coarse = [round(x, 1) for x in printed]
    assert sensitivity(rows(coarse), tolerance_for("fp32")) < 1.0
    assert sensitivity(rows(printed), tolerance_for("fp32")) > 1.0


def _moving(steps: int, per_step: float, offset: float = 0.0) -> list[Digest]:
    return _digests([0.5 + per_step * k + offset for k in range(1, steps + 1)])


def _cannot_tell(base, cand, dtype="fp32") -> str:
    comparison = _judge(base, cand, dtype=dtype)
    assert comparison.outcome == INCONCLUSIVE, comparison.summary()
    return comparison.summary()


def test_cannot_tell_says_why_and_what_would_tell():
    # Parameters recorded in fp32, but 3 steps moved them too little: the advice is to train
    # longer (an estimate from the pace they moved), not what already holds (a torch optimizer
    # steps, the runs are fp32).
    flat = [4.85, 4.84, 4.86]
    said = _cannot_tell(_records(flat, _moving(3, 0.01)),
                        _records(list(flat), _moving(3, 0.01, offset=1e-9)))
    assert "too few steps" in said and "train about 12 steps" in said, said
    assert "optimizer" not in said and "fp32" not in said
    longer = [4.85] * 12
    assert _judge(_records(longer, _moving(12, 0.01)),
                  _records(list(longer), _moving(12, 0.01, offset=1e-9))).outcome == EQUIVALENT
    # Losses alone (no optimizer step hooked): too few steps to tell progress from scatter...
    said = _cannot_tell(_records(flat), _records(list(flat)))
    assert "no torch optimizer step was recorded" in said and "train at least 20 steps" in said
    # ...or enough steps of a loss that does not fall.
    said = _cannot_tell(_records(_losses(4.85, 4.85, 0.05)), _records(_losses(4.85, 4.85, 0.05)))
    assert f"did not fall measurably over {STEPS} steps" in said and "20 steps" not in said
    # A coarse tolerance is the reason whatever else holds.
    falling = _losses(4.0, 2.0, scatter=0.05)
    said = _cannot_tell(_records(falling), _records(list(falling)), dtype="bf16")
    assert "bf16 tolerance" in said and "compare fp32 runs" in said and "steps" not in said
