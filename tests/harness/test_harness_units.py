"""Pieces of the harness that need no processes: tolerances, digest weights, recipes, parsing,
CLI errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fsdp_bridge.cli import main
from fsdp_bridge.harness.backends import BACKENDS, BackendUnavailable, get_backend
from fsdp_bridge.harness.compare import clean_key, tolerance_for
from fsdp_bridge.harness.digest import _weights, global_digest
from fsdp_bridge.harness.recipes import Size, builtin_recipe, micro_batches, reference_micro_batches
from fsdp_bridge.harness.scripts import DEFAULT_LOSS_PATTERN, parse_losses


def test_tolerances_follow_torch_defaults():
    assert (tolerance_for("fp32").rtol, tolerance_for("fp32").atol) == (1.3e-6, 1e-5)
    assert (tolerance_for("bf16").rtol, tolerance_for("bf16").atol) == (1.6e-2, 1e-5)
    tol = tolerance_for("fp32")
    assert tol.ratio(1.0, 1.0) == 0.0
    assert tol.ratio(1.0 + 2 * (1e-5 + 1.3e-6), 1.0) == pytest.approx(2.0)
    assert tol.ratio(float("nan"), 1.0) == math.inf
    with pytest.raises(ValueError, match="dtype='int8'"):
        tolerance_for("int8")


def test_single_process_digest_counts_every_element_once():
    params = [torch.arange(4.0), torch.ones(2, 3)]
    digest = global_digest(params, distributed=False)
    assert (digest.sum, digest.sumsq, digest.numel) == (12.0, 20.0, 10)


def test_replication_is_inferred_by_comparing_ranks():
    # rows: sum, sumsq, sum4, gradsq, numel, replicas(0 = unknown); two ranks, two params
    same = [3.0, 5.0, 17.0, 0.0, 2.0, 0.0]
    rank0 = torch.tensor([same, [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    rank1 = torch.tensor([same, [2.0, 4.0, 16.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    weights = _weights(torch.stack([rank0, rank1]))
    assert weights[:, 0].tolist() == [0.5, 0.5]  # identical everywhere: replicated
    assert weights[:, 1].tolist() == [1.0, 1.0]  # different pieces: sharded


def test_reference_micro_batches_are_the_union_of_the_ranks():
    recipe = builtin_recipe("mlp", Size(batch=8, hidden=4), micro_batches=2)
    x, _ = recipe.batch(1)
    ranks = [micro_batches(recipe, (x, x), r, 2) for r in range(2)]
    reference = reference_micro_batches(recipe, (x, x), 2)
    for m in range(2):
        assert torch.equal(reference[m][0], torch.cat([ranks[0][m][0], ranks[1][m][0]]))
    assert torch.equal(torch.cat([r[0] for r in reference]).sort(0).values, x.sort(0).values)
    with pytest.raises(ValueError, match="global_batch=8"):
        recipe.check_world(3)


def test_recipe_options_are_validated():
    with pytest.raises(ValueError, match="mp='fp8'"):
        builtin_recipe("mlp", mp="fp8")
    with pytest.raises(ValueError, match="recipe='bert'"):
        builtin_recipe("bert")


def test_loss_lines_are_parsed_first_wins():
    text = "warmup\nstep 1 loss 4.5\nstep 1 loss 9.9\n[rank0] step: 2 | loss=3.25e-1\n"
    assert parse_losses(text, DEFAULT_LOSS_PATTERN) == {1: 4.5, 2: 0.325}
    with pytest.raises(ValueError, match="named group 'loss'"):
        parse_losses(text, r"step (\d+)")


def test_losses_printed_on_every_rank_are_read_per_rank():
    from fsdp_bridge.harness.scripts import HF_TRAINER_LOSS_PATTERN, read_losses

    # Rank 1's lines arrive first; each rank prints the loss of its own slice.
    text = ("[default1]:step 1 loss 2.5\n[default0]:step 1 loss 1.5\n"
            "[default1]:step 2 loss 2.25\nW1126 torchrun says something\n"
            "[default0]:step 2 loss 1.25\n")
    assert read_losses(text, DEFAULT_LOSS_PATTERN) == ({1: 1.5, 2: 1.25}, DEFAULT_LOSS_PATTERN, 0)
    # Only rank 1 prints: its losses, said to be rank 1's.
    assert read_losses(text.replace("[default0]:step", "[default0]:stage"),
                       DEFAULT_LOSS_PATTERN)[2] == 1
    # The Trainer's lines count per rank too: the k-th line of rank 0 is its step k.
    hf = "[default1]:{'loss': 9.0}\n[default0]:{'loss': 1.0}\n[default1]:{'loss': 8.0}\n" \
         "[default0]:{'loss': 0.5}\n"
    assert read_losses(hf, DEFAULT_LOSS_PATTERN) == ({1: 1.0, 2: 0.5}, HF_TRAINER_LOSS_PATTERN, 0)


def test_wrapper_prefixes_are_removed_from_keys():
    assert clean_key("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert clean_key("model.layers.0.weight") == "model.layers.0.weight"


def test_every_backend_is_registered_and_bridge_ones_fail_clearly():
    assert set(BACKENDS) == {"reference", "torch-fsdp1", "torch-fsdp2", "bridge-fsdp1",
                             "bridge-fsdp2", "bridge-yafsdp"}
    for name in ("bridge-fsdp1", "bridge-fsdp2", "bridge-yafsdp"):
        try:
            get_backend(name).check_available()
        except BackendUnavailable as exc:
            assert f"backend {name} needs fsdp_bridge." in str(exc)
            assert "not available in this build" in str(exc)
    with pytest.raises(ValueError, match="backend 'ddp' is unknown"):
        get_backend("ddp")


def test_compare_cli_reports_errors_with_exit_2(capsys):
    assert main(["compare", "--backends", "reference,nope"]) == 2
    assert "backend 'nope' is unknown" in capsys.readouterr().err
    assert main(["compare", "--backends", "reference"]) == 2
    assert main(["compare", "--batch", "3", "--nproc", "2"]) == 2
    assert "global_batch=3" in capsys.readouterr().err


def test_the_command_lines_choices_are_the_implemented_names():
    # names.py lists them without importing torch (fast --help); it must not drift.
    from fsdp_bridge.harness import names
    from fsdp_bridge.harness.backends import BACKENDS
    from fsdp_bridge.harness.compare import GROWTH, TOLERANCES
    from fsdp_bridge.harness.recipes import BUILTIN, Size

    assert names.BACKENDS == tuple(BACKENDS)
    assert names.RECIPES == tuple(BUILTIN)
    assert names.DTYPES == tuple(TOLERANCES)
    assert names.TOLERANCE_GROWTH == GROWTH
    assert names.SIZE_DEFAULTS == dataclasses.asdict(Size())


def test_the_plot_gives_each_run_one_look_and_whole_steps():
    import matplotlib.pyplot as plt

    from fsdp_bridge.harness.compare import Comparison, StepCheck, tolerance_for
    from fsdp_bridge.harness.report import plot_figure

    class Report:
        title = "three runs"
        tolerance = tolerance_for("fp32")
        comparisons = [Comparison("a", name) for name in ("b", "c")]

        def curves(self):
            return {name: [(1, 2.0), (2, 1.5), (3, 1.2)] for name in ("a", "b", "c")}

    report = Report()
    for comparison in report.comparisons:
        comparison.steps = [StepCheck(s, 1.0, 1.0, 0.5, 0.1, 0.2) for s in (1, 2, 3)]
    figure = plot_figure(report)
    top, bottom = figure.axes
    look = {line.get_label(): (line.get_color(), line.get_marker(), line.get_linestyle())
            for line in top.get_lines()}
    # The three curves coincide: each keeps a colour, marker and dashes of its own, and later
    # ones are drawn thinner, so that none hides another.
    assert all(len({each[i] for each in look.values()}) == 3 for i in range(3)), look
    widths = [line.get_linewidth() for line in top.get_lines()]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3
    for line in bottom.get_lines():
        if line.get_label() in ("b", "c"):
            assert (line.get_color(), line.get_marker(), line.get_linestyle()) \
                == look[line.get_label()]
    assert all(float(tick).is_integer() for tick in bottom.get_xticks())
    plt.close(figure)


def test_linear_tolerance_growth_allows_drift_that_compounds_but_not_a_bug():
    # [Note: tolerance growth]: deviations that grow with the step (0.5x the one-step
    # tolerance per step, as rounding differences compound) pass under "linear" and fail
    # under "none" from step 3; a deviation 100x off at step 1 fails under both.
    from fsdp_bridge.harness.compare import Comparison, compare_steps
    from fsdp_bridge.harness.runner import StepRecord

    one_step = 1e-5 + 1.3e-6 * 2.0
    base = [StepRecord(k, 2.0, None, None) for k in range(1, 11)]
    drift = [StepRecord(k, 2.0 + 0.5 * k * one_step, None, None) for k in range(1, 11)]
    bug = [StepRecord(k, 2.0 + 100 * one_step, None, None) for k in range(1, 11)]
    judged = {}
    for growth in ("linear", "none"):
        for name, run in (("drift", drift), ("bug", bug)):
            comparison = Comparison("reference", name)
            compare_steps(base, run, tolerance_for("fp32", growth=growth), comparison)
            judged[growth, name] = comparison.first_diverging_step
    assert judged == {("linear", "drift"): None, ("none", "drift"): 3,
                      ("linear", "bug"): 1, ("none", "bug"): 1}
    assert tolerance_for("fp32", growth="linear").at_step(7).rtol == pytest.approx(7 * 1.3e-6)
    assert "times k at step k" in tolerance_for("fp32", growth="linear").describe()
    with pytest.raises(ValueError, match="growth='quadratic'"):
        tolerance_for("fp32", growth="quadratic")


def test_compare_says_on_stderr_what_it_trains_and_each_backend_done_unless_quiet():
    import subprocess
    import sys

    argv = [sys.executable, "-m", "fsdp_bridge", "compare", "--recipe", "mlp", "--steps", "1",
            "--nproc", "1", "--backends", "reference,bridge-fsdp2"]
    loud, quiet = (subprocess.run(argv + extra, capture_output=True, text=True, timeout=300)
                   for extra in ([], ["--quiet"]))
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    lines = loud.stderr.splitlines()
    # What it loads first (torch, after the light checks), then what it trains.
    assert lines[0] == "fsdp-bridge compare: loading torch and the recipe's model code...", lines
    assert lines[1].startswith("fsdp-bridge compare: training mlp under 2 backends"), lines
    assert any("bridge-fsdp2 trained (2/2 backends" in line for line in lines), lines
    assert "RESULT: equivalent" in loud.stdout and "trained" not in loud.stdout
    assert quiet.stderr == "" and "RESULT: equivalent" in quiet.stdout


def test_the_injected_sitecustomize_hands_over_to_the_one_it_shadows(tmp_path, monkeypatch):
    """compare-scripts' children start with the harness's sitecustomize first on the path; the
    environment's own still runs, and is the module `sitecustomize` names."""
    import subprocess
    import sys

    from fsdp_bridge.harness.scripts import child_env

    users = tmp_path / "site"
    users.mkdir()
    (users / "sitecustomize.py").write_text("import os\nMARK = 'the environment'\n"
                                            "os.environ['FROM_USERS_SITECUSTOMIZE'] = '1'\n")
    monkeypatch.setenv("PYTHONPATH", str(users))
    env = child_env(str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import os, sitecustomize; print("
                           "sitecustomize.MARK, os.environ.get('FROM_USERS_SITECUSTOMIZE'))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["the", "environment", "1"]
