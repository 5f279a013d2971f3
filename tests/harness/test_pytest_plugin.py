"""The pytest plugin, loaded through its entry point, gives users `fsdp_equivalence`."""

from __future__ import annotations

import pytest

from fsdp_bridge.harness.recipes import Size, builtin_recipe

TINY = builtin_recipe("mlp", Size(layers=1, hidden=8, batch=4), steps=2)


def test_fixture_comes_from_the_entry_point(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("fsdp_bridge")


def test_fixture_passes_equivalent_backends_and_fails_a_bad_tolerance(fsdp_equivalence):
    report = fsdp_equivalence(TINY, backends=("reference", "torch-fsdp2"), nproc=2)
    assert report.ok and report.exit_code == 0
    with pytest.raises(AssertionError, match="not equivalent"):
        # 1e-30 is tighter than float32 rounding: the same run must now be reported
        fsdp_equivalence(TINY, backends=("reference", "torch-fsdp2"), nproc=2, rtol=0.0,
                         atol=1e-30)
