"""Bad input to the harness: every argument and output path is checked before any process
starts (exit 2, the option named, no traceback); negative tolerances are refused; NaN equals
NaN when a run is compared with itself, and the first non-finite step is reported. The user's
files (an existing report, the scripts) are checked unchanged with SHA-256."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from fsdp_bridge.cli import main
from fsdp_bridge.harness import processes, scripts
from fsdp_bridge.harness.compare import first_nan_step, tolerance_for
from fsdp_bridge.harness.digest import Digest
from fsdp_bridge.harness.scripts import ScriptRun, compare_script_runs
from tests.checkpoint import user_files

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "scripts", "train_tiny.py")
NAN_SCRIPT = os.path.join(HERE, "scripts", "train_nan.py")


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if anything tries to start a process."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(processes.subprocess, "Popen", refuse)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)


@pytest.fixture
def user_dir(tmp_path):
    """The user's files: an earlier report and a copy of the training script."""
    user_files.make(tmp_path)
    (tmp_path / "report.json").write_text('{"earlier": true}\n')
    shutil.copy(TINY, tmp_path / "train.py")
    return tmp_path, user_files.digests(tmp_path)


COMPARE = [
    (["--hidden", "30", "--heads", "4"], "--hidden 30 is not divisible by --heads 4"),
    (["--seq", "0"], "--seq 0: expected an int >= 1"),
    (["--lr", "nan"], "--lr nan: expected a finite learning rate"),
    (["--lr", "-1"], "--lr -1.0: expected a finite learning rate"),
    (["--rtol", "-1", "--atol", "-1"], "--rtol=-1.0: expected a finite number >= 0"),
    (["--atol", "nan"], "--atol=nan: expected a finite number >= 0"),
    (["--steps", "0"], "--steps 0: expected an int >= 1"),
    (["--nproc", "0"], "--nproc 0: expected an int >= 1"),
    (["--json", "/missing/dir/x.json"], "--json '/missing/dir/x.json': the directory"),
    (["--plot", "{tmp}"], "is a directory; give a file path"),
    (["--plot", "{tmp}/out.txt"], "its suffix '.txt' is not an image format matplotlib writes"),
    (["--plot", "{tmp}/curves"], "it has no suffix, which is not an image format"),
    (["--backends", "reference"], "name at least two backends"),
    (["--recipe", "tiny-llama", "--hidden", "12", "--heads", "4"], "even head size"),
]


@pytest.mark.parametrize("argv, words", COMPARE)
def test_compare_rejects_bad_arguments_before_any_process(no_processes, user_dir, capsys,
                                                          argv, words):
    directory, before = user_dir
    argv = [a.replace("{tmp}", str(directory)) for a in argv]
    assert main(["compare", "--json", str(directory / "report.json"), *argv]
                if "--json" not in argv else ["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert user_files.digests(directory) == before


SCRIPTS = [
    (["--timeout", "0"], "--timeout 0.0: expected a number of seconds > 0"),
    (["--timeout", "-5"], "--timeout -5.0: expected a number of seconds > 0"),
    (["--timeout", "nan"], "--timeout nan: expected a number of seconds > 0"),
    (["--loss-pattern", "("], "--loss-pattern '(' is not a valid regular expression"),
    (["--loss-pattern", r"step (\d+)"], "has no named group 'loss'"),
    (["--json", "/missing/dir/x.json"], "--json '/missing/dir/x.json': the directory"),
    (["--plot", "out.txt"], "--plot 'out.txt': its suffix '.txt' is not an image format"),
    (["--rtol", "-1", "--atol", "-1"], "--rtol=-1.0: expected a finite number >= 0"),
    (["--nproc", "0"], "--nproc 0: expected an int >= 1"),
]


@pytest.mark.parametrize("argv, words", SCRIPTS)
def test_compare_scripts_rejects_bad_arguments_before_any_process(no_processes, user_dir,
                                                                  capsys, argv, words):
    directory, before = user_dir
    script = str(directory / "train.py")
    assert main(["compare-scripts", script, script, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert user_files.digests(directory) == before


def test_compare_scripts_checks_both_scripts_first(no_processes, user_dir, capsys):
    directory, before = user_dir
    assert main(["compare-scripts", str(directory / "train.py"),
                 str(directory / "missing.py")]) == 2
    assert "B.py" in capsys.readouterr().err
    assert user_files.digests(directory) == before


def test_explain_write_docs_checks_its_path(user_dir, capsys):
    directory, before = user_dir
    assert main(["explain", "--write-docs", "/missing/dir/x.md"]) == 2
    err = capsys.readouterr().err
    assert "--write-docs '/missing/dir/x.md': the directory '/missing/dir' does not exist" in err
    assert main(["explain", "--write-docs", str(directory)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert user_files.digests(directory) == before


def test_negative_and_non_finite_tolerances_are_refused():
    for value in (-1.0, -1e-9, math.nan, math.inf):
        with pytest.raises(ValueError, match="expected a finite number >= 0"):
            tolerance_for("fp32", rtol=value)
        with pytest.raises(ValueError, match="expected a finite number >= 0"):
            tolerance_for("fp32", atol=value)


def test_zero_tolerance_means_exact():
    exact = tolerance_for("fp32", rtol=0.0, atol=0.0)
    assert exact.ratio(1.5, 1.5) == 0.0 and exact.ratio(1.5, 1.5000001) == math.inf
    assert exact.tensor_ratio(torch.ones(3), torch.ones(3)) == 0.0
    assert exact.tensor_ratio(torch.ones(3), torch.zeros(3)) == math.inf


def _run(label, losses, sums):
    digests = [Digest(sum=s, sumsq=s * s, sum4=s ** 4, grad_norm=s, numel=4) for s in sums]
    return ScriptRun(label, "train.py", 0, "", losses, digests, 1.0)


def test_nan_equals_nan_when_a_run_is_repeated_and_the_step_is_named():
    nan = math.nan
    first = _run("A", {1: 0.5, 2: nan, 3: nan}, [1.0, nan, nan])
    repeat = _run("A (repeat)", {1: 0.5, 2: nan, 3: nan}, [1.0, nan, nan])
    assert compare_script_runs(first, repeat, tolerance_for("fp32")).ok
    notes, errors = [], []
    scripts._determinism_check(first, repeat, tolerance_for("fp32"), notes, errors)
    assert errors == [] and "is deterministic" in notes[0]
    assert first_nan_step(first.records()) == (2, "loss nan")
    finite_then_nan = _run("B", {1: 0.5, 2: 0.4, 3: nan}, [1.0, 0.9, nan])
    assert compare_script_runs(first, finite_then_nan, tolerance_for("fp32")) \
        .first_diverging_step == 2


def test_a_script_that_turns_nan_is_deterministic_and_its_nan_step_reported(user_dir):
    directory, before = user_dir
    # The script trains without FSDP: what is checked here is its NaN step.
    report = scripts.compare_scripts(NAN_SCRIPT, [], nproc=1, args=["--steps", "3"],
                                     timeout=300, require_fsdp=False)
    notes = "\n".join(report.notes)
    assert report.errors == [], report.errors
    assert "is deterministic" in notes
    assert "is not finite from step 2 (loss nan)" in notes
    assert user_files.digests(directory) == before


# -- runs that prove nothing are not called equivalent ----------------------------------------


def test_a_run_without_fsdp_or_without_losses_cannot_be_equivalent():
    fsdp = _run("A", {1: 0.5}, [1.0])
    fsdp.wrappers = {"torch FSDP2": 3}
    ddp = _run("B", {1: 0.5}, [1.0])
    ddp.wrappers = {"DistributedDataParallel": 1}
    silent = _run("C", {}, [1.0])
    silent.wrappers = {"torch FSDP1": 2}
    pattern = scripts.DEFAULT_LOSS_PATTERN
    assert scripts._unproven([fsdp], True, True, pattern) == []
    errors = scripts._unproven([fsdp, ddp, silent], True, True, pattern)
    assert len(errors) == 2
    assert "B (train.py) engaged no FSDP: B: DistributedDataParallel wrapped 1 module" in errors[0]
    assert "--allow-no-fsdp" in errors[0]
    assert "C (train.py): no line of its output matched the loss pattern" in errors[1]
    assert "--allow-no-loss" in errors[1]
    assert scripts._unproven([fsdp, ddp, silent], False, False, pattern) == []
    notes = scripts._run_notes([fsdp, ddp])
    assert notes[:2] == ["A: torch FSDP2 wrapped 3 modules",
                         "B: DistributedDataParallel wrapped 1 module"]


def test_a_rerun_after_the_gloo_exit_abort_is_reported():
    run = _run("A", {1: 0.5}, [1.0])
    run.retried = True
    assert any("A was run again" in note and "gloo teardown abort" in note
               for note in scripts._run_notes([run]))


def test_hf_trainer_log_lines_are_read_when_the_default_pattern_finds_nothing():
    output = ("***** Running training *****\n"
              "{'loss': 2.3125, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.5}\n"
              "{'loss': 2.25, 'grad_norm': 1.25, 'learning_rate': 2.5e-05, 'epoch': 1.0}\n"
              "{'train_runtime': 1.2, 'train_loss': 2.28, 'epoch': 1.0}\n")
    losses, used, _ = scripts.read_losses(output, scripts.DEFAULT_LOSS_PATTERN)
    assert losses == {1: 2.3125, 2: 2.25} and used == scripts.HF_TRAINER_LOSS_PATTERN
    assert scripts.read_losses("step 1 loss 0.5\n", scripts.DEFAULT_LOSS_PATTERN) == (
        {1: 0.5}, scripts.DEFAULT_LOSS_PATTERN, None)
    # A pattern of the user's own is never replaced.
    assert scripts.read_losses(output, r"step (?P<step>\d+) loss (?P<loss>\S+)")[0] == {}


def test_a_script_counting_steps_from_zero_lines_up_with_its_optimizer_steps():
    # Printed as steps 0, 1, 2: the loss of the k-th optimizer step sits beside the digest after
    # it, row k (from 1), not one row off with a loss-only row 0 and a digest-only row 3.
    zero_based = _run("A", {0: 0.5, 1: 0.4, 2: 0.3}, [1.0, 0.9, 0.8])
    rows = zero_based.records()
    assert [(row.step, row.loss, row.digest.sum) for row in rows] == [
        (1, 0.5, 1.0), (2, 0.4, 0.9), (3, 0.3, 0.8)]
    one_based = _run("B", {1: 0.5, 2: 0.4, 3: 0.3}, [1.0, 0.9, 0.8])
    assert compare_script_runs(zero_based, one_based, tolerance_for("fp32")).ok
    assert any("A: numbers its steps from 0" in note for note in scripts._run_notes([zero_based]))
