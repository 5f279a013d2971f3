"""A rank killed mid-run under `torchrun --max-restarts 1`: the run resumes from its last
checkpoint and ends with the same parameters and optimizer state as an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.checkpoint.cases import bit_equal

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "resume_train.py")


def _torchrun(out, kill_at, restarts):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), "--monitor-interval", "0.5", SCRIPT, str(out),
         str(kill_at)],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(os.path.join(out, "final.pt"))


def test_killed_rank_resumes_to_the_same_end(tmp_path):
    straight = _torchrun(tmp_path / "straight", -1, 0)
    resumed = _torchrun(tmp_path / "killed", 3, 1)
    assert straight["attempt"] == 0 and straight["resumed_from"] == 0
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == 2  # the last complete save
    assert bit_equal((straight["params"], straight["optim"]),
                     (resumed["params"], resumed["optim"]))
