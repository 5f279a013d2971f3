"""The README's short example runs as written: saved as train.py and started on 2 CPU ranks
with torchrun, it trains (the loss falls) on our engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _short_example() -> str:
    section = README.read_text().split("## A short example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_short_example_runs_as_written(tmp_path):
    (tmp_path / "train.py").write_text(_short_example())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "train.py"], cwd=tmp_path, env=dict(
                               env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d loss (\S+)$", done.stdout, re.MULTILINE)]
    assert len(losses) == 3, done.stdout
    assert losses[-1] < losses[0], losses
