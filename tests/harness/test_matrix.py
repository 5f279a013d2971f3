"""The conformance matrix's fixed, seeded covering sample (`compare --matrix --sample`), plus
cells pinned for differences it found and that are fixed: every cell not covered by a known
difference must conform (equal, no reference, or a refusal native shares or README lists).
One spawned world per world size runs all its cells; `make conformance` runs the full sweep."""

from __future__ import annotations

from fsdp_bridge.harness.matrix import axes, table
from fsdp_bridge.harness.matrix.sweep import SweepOptions, run_sweep

SEED = 0

# Found by the sweep, fixed, kept: each differed from native before its fix.
PINNED = (
    # fully_shard divided a bf16 reduction's sum in fp32 once the step's gradient was complete;
    # native's averaging reduction divides it in bf16 (a difference from 3 ranks on).
    axes.Cell.of(frontend="fsdp2", world=3, param="bf16"),
    # ... and the sum of several micro-steps' fp32 reductions once, where native divides each.
    axes.Cell.of(frontend="fsdp2", world=3, accumulate="sync", micro=2),
    # FSDP1's flat parameters under NO_SHARD with synchronised accumulation: the gradient kept
    # in the flat parameter's `.grad` was reduced again and also added to (counted twice).
    axes.Cell.of(frontend="fsdp1", strategy="no_shard", accumulate="sync", micro=2,
                 orig_params=False),
)


def test_the_covering_sample_conforms():
    cells = axes.covering_cells(axes.SAMPLE_SPACE, seed=SEED)
    assert not axes.uncovered(cells, axes.SAMPLE_SPACE)
    outcomes = run_sweep(cells + list(PINNED), SweepOptions(quiet=True))
    report = table.render(outcomes, 0.0)
    wrong = [o for o in outcomes if not o.known and not o.conforming]
    assert not wrong, report
    assert all(o.status != "not run" for o in outcomes), report
    assert {o.status for o in outcomes} >= {"equal", "refused", "no reference"}, report
    # Cells a known difference covers are shown apart, never hidden or counted.
    for outcome in outcomes:
        if outcome.known:
            assert outcome.status in ("differs", "crash", "refused"), report
            assert f"[{outcome.known}]" in report
