"""pytest plugin (entry point `fsdp_bridge` in `pytest11`): assert that your own model trains
the same under several FSDP backends.

    from fsdp_bridge.harness import Recipe

    def test_my_model_shards_equivalently(fsdp_equivalence):
        recipe = Recipe("mine", make_model=my_pkg.build_model, make_batch=my_pkg.batch,
                        loss_fn=my_pkg.loss, unit_classes=(my_pkg.Block,), steps=3)
        fsdp_equivalence(recipe, backends=("reference", "torch-fsdp2"), nproc=2)

The factories must be importable module-level functions: the ranks are spawned processes.
The fixture raises AssertionError with the full comparison table when the backends differ,
and returns the report otherwise. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import pytest


def assert_equivalent(recipe, backends=("reference", "torch-fsdp1", "torch-fsdp2"), nproc=2,
                      device="auto", rtol=None, atol=None):
    """Run `recipe` under `backends` (the first is the baseline); raise unless every one is
    shown equivalent (also when a comparison cannot tell, see harness/resolution.py)."""
    from fsdp_bridge.harness.compare import EXIT_INCONCLUSIVE
    from fsdp_bridge.harness.equivalence import check_equivalence
    from fsdp_bridge.harness.report import render_table

    report = check_equivalence(recipe, list(backends), nproc=nproc, device=device, rtol=rtol,
                               atol=atol)
    if not report.ok:
        what = "cannot be told apart from a 1 % learning-rate change" if report.exit_code == EXIT_INCONCLUSIVE \
            else "are not equivalent"
        raise AssertionError(f"backends {what}:\n" + render_table(report))
    return report


@pytest.fixture
def fsdp_equivalence():
    """A callable `(recipe, backends=..., nproc=2, device="auto", rtol=None, atol=None)` that
    asserts equivalence of `recipe` across FSDP backends and returns the report."""
    return assert_equivalent
