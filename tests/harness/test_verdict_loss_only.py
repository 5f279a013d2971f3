"""End to end: `compare-scripts` on two scripts that differ only by a +1 % learning rate, judged
on their printed losses alone (no torch optimizer, so no parameter digest), is not called
equivalent. The loss of the tiny Llama on random tokens barely falls, so the drift grows by less
than the one-step tolerance per step: a tolerance that grows linearly from step 1 absorbs it."""

from __future__ import annotations

import os

from fsdp_bridge.cli import main

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_llama_loss_only.py")


def test_one_percent_learning_rate_change_is_caught_from_the_loss_alone(tmp_path, capsys):
    with open(SCRIPT) as handle:
        text = handle.read()
    assert "LR = 0.05\n" in text
    other = tmp_path / "train_lr_plus_1pct.py"
    other.write_text(text.replace("LR = 0.05\n", "LR = 0.05 * 1.01\n"))
    code = main(["compare-scripts", SCRIPT, str(other), "--nproc", "1", "--no-determinism-check",
                 "-q", "--", "--steps", "10"])
    out = capsys.readouterr().out
    assert "0 optimizer steps" in out  # the loss-only path: no digest was recorded
    assert code == 1, out
    assert "RESULT: NOT equivalent" in out and "first diverging step" in out
