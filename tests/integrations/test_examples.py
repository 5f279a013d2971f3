"""The framework examples of fsdp_bridge/examples (HF Trainer, accelerate, Lightning) against
their native twins at 2 CPU ranks, bf16, with save and resume, through compare-scripts' own
runner and step-by-step comparison (losses and parameter digests after every optimizer step):

- each example, saving a checkpoint after step 2 of 3, agrees with its twin, each run sharding
  by the engine it names;
- each resumed from that checkpoint, its step 3 agrees with its twin's resumed step 3 and with
  the uninterrupted runs' step 3.

The pairs are run one script at a time, not by the `compare-scripts` command, because each side
needs its own --out folder and the command gives both scripts the same arguments; the command
itself is run on one pair. Lightning's
own FSDPStrategy cannot save on a CPU-only machine (torch's FSDP1 crashes offloading the full
state dict there), so its twin runs uninterrupted only and our resumed run is checked against
that. And each twin differs from its example in one import line, the change a user makes."""

from __future__ import annotations

import dataclasses
import difflib
import os

import pytest

from fsdp_bridge.harness.compare import tolerance_for
from fsdp_bridge.harness.scripts import (
    DEFAULT_LOSS_PATTERN,
    ScriptRun,
    compare_script_runs,
    run_script,
)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "fsdp_bridge", "examples")
# example -> (its line, the native twin's line, what the runs wrapped: native, ours)
PAIRS = {
    "hf_trainer_llama": ("from fsdp_bridge.integrations.transformers import Trainer",
                         "from transformers import Trainer",
                         ("torch FSDP2", "fsdp-bridge fully_shard")),
    "accelerate_llama": ("from fsdp_bridge.integrations.accelerate import Accelerator",
                         "from accelerate import Accelerator",
                         ("torch FSDP2", "fsdp-bridge fully_shard")),
    "lightning_llama": ("from fsdp_bridge.integrations.lightning import FSDPStrategy",
                        "from lightning.pytorch.strategies import FSDPStrategy",
                        ("torch FSDP1", "fsdp-bridge (FSDP1 / Zeta / TorchAcc front-end)")),
}
# What --resume takes, inside the --out folder of a run that saved after step 2.
CHECKPOINT = {"hf_trainer_llama": "checkpoint-2", "accelerate_llama": "",
              "lightning_llama": "last.ckpt"}
NATIVE_CANNOT_SAVE = {"lightning_llama"}
STEPS, SAVED_AT = 3, 2
AFTER_SAVE = STEPS - SAVED_AT
BF16 = tolerance_for("bf16")


def _path(name: str) -> str:
    return os.path.normpath(os.path.join(EXAMPLES, name + ".py"))


@pytest.mark.parametrize("name", list(PAIRS))
def test_native_twin_differs_in_one_import_line(name):
    ours, native, _ = PAIRS[name]
    with open(_path(name)) as a, open(_path(name + "_native")) as b:
        changed = [line.strip() for line in difflib.ndiff(a.readlines(), b.readlines())
                   if line[:2] in ("- ", "+ ")]
    assert changed == [f"- {ours}", f"+ {native}"]


def _run(label: str, script: str, *args: str) -> ScriptRun:
    run = run_script(label, _path(script), 2, ["--steps", str(STEPS), "--bf16", *args],
                     DEFAULT_LOSS_PATTERN, timeout=600)
    assert run.error is None, run.error
    return run


def _last_steps(run: ScriptRun, count: int) -> ScriptRun:
    """`run`'s last `count` steps, renumbered from 1. (A resumed run's digests count from its
    first optimizer step, and the Trainer's log lines carry no step. Loading a sharded optimizer
    state steps the optimizer once with zero gradients to create its state, torch's
    `set_optimizer_state_dict`, which leaves the parameters as they are and records a digest.)"""
    losses = [loss for _, loss in sorted(run.losses.items())][-count:]
    return dataclasses.replace(run, losses=dict(enumerate(losses, 1)),
                               digests=run.digests[-count:])


def _assert_agree(a: ScriptRun, b: ScriptRun, steps: int) -> None:
    comparison = compare_script_runs(a, b, BF16)
    assert comparison.ok, (f"{a.label} and {b.label} differ from step "
                           f"{comparison.first_diverging_step}: {a.losses} vs {b.losses}")
    assert len(a.losses) == len(b.losses) == len(a.digests) == len(b.digests) == steps


def _run_and_resume(label: str, script: str, out: str) -> tuple[ScriptRun, ScriptRun]:
    whole = _run(label, script, "--out", out)
    resumed = _run(f"{label} resumed", script, "--resume", os.path.join(out, CHECKPOINT[
        script.removesuffix("_native")]))
    assert len(resumed.losses) == AFTER_SAVE, resumed.losses  # it trained on from step 2
    return whole, _last_steps(resumed, AFTER_SAVE)


@pytest.mark.parametrize("name", list(PAIRS))
def test_example_saves_resumes_and_trains_equal_to_its_native_twin(name, tmp_path):
    pytest.importorskip("lightning" if name.startswith("lightning") else "accelerate")
    ours, ours_resumed = _run_and_resume("ours", name, str(tmp_path / "ours"))
    if name in NATIVE_CANNOT_SAVE:
        native, native_resumed = _run("native", name + "_native"), None
    else:
        native, native_resumed = _run_and_resume("native", name + "_native",
                                                 str(tmp_path / "native"))
    wrapped_native, wrapped_ours = PAIRS[name][2]
    assert wrapped_native in native.wrappers and wrapped_ours in ours.wrappers, \
        (native.wrappers, ours.wrappers)
    _assert_agree(native, ours, STEPS)
    _assert_agree(_last_steps(native, AFTER_SAVE), ours_resumed, AFTER_SAVE)
    _assert_agree(_last_steps(ours, AFTER_SAVE), ours_resumed, AFTER_SAVE)
    if native_resumed is not None:
        _assert_agree(native_resumed, ours_resumed, AFTER_SAVE)
        _assert_agree(_last_steps(native, AFTER_SAVE), native_resumed, AFTER_SAVE)


def test_the_compare_scripts_command_proves_a_pair(capsys):
    # The command as the README shows it (one pair: the runs above use its runner directly),
    # with the examples named as modules, as an install without the repository names them.
    pytest.importorskip("accelerate")
    from fsdp_bridge.cli import main

    code = main(["compare-scripts", "fsdp_bridge.examples.accelerate_llama_native",
                 "fsdp_bridge.examples.accelerate_llama",
                 "--nproc", "2", "--dtype", "bf16", "--no-determinism-check", "-q", "--",
                 "--steps", str(STEPS), "--bf16"])
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: equivalent" in out, out
    assert f"{STEPS} optimizer steps" in out  # parameter digests were compared, not losses alone
    assert "A: torch FSDP2 wrapped" in out and "B: fsdp-bridge fully_shard wrapped" in out, out


def test_quoted_hf_trainer_log_values_are_read():
    # transformers 5 logs `{'loss': '4.866', ...}` (values as strings)
    from fsdp_bridge.harness.scripts import DEFAULT_LOSS_PATTERN, read_losses

    output = "[default0]:{'loss': '4.866', 'grad_norm': '1.3'}\n[default0]:{'loss': '4.5'}\n"
    assert read_losses(output, DEFAULT_LOSS_PATTERN)[0] == {1: 4.866, 2: 4.5}
