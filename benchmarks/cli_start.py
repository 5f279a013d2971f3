"""Start-up time of the command line: `--help` of every command, a mistyped argument refused
before torch loads (`compare --backends reference,nosuch`), a text file given to
`compare-scripts`, `explain`'s argument tables, and `migrate` of a small FSDP1 file to bridge
and to fsdp2 (neither needs torch).

Each line is the median (and range) of --repeats runs of `python -m fsdp_bridge ...` as a
subprocess, interpreter start included. The load average is printed before and after, so a
figure can be read as an idle machine's only when both are low.

    .venv/bin/python benchmarks/cli_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from fsdp_bridge.cli import SUBCOMMANDS


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fsdp_bridge", *argv], capture_output=True,
                   timeout=300, check=False)
    return time.perf_counter() - start


FSDP1_FILE = """import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy


def build(model):
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))


def train(model, data, optimizer):
    for step, batch in enumerate(data):
        loss = model(batch).sum()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
"""


def _cases(folder: str) -> dict[str, list[str]]:
    cases = {"--help": ["--help"]}
    cases.update({f"{name} --help": [name, "--help"] for name in SUBCOMMANDS})
    cases["compare --backends reference,nosuch (refused)"] = ["compare", "--backends", "reference,nosuch"]
    notes, script = os.path.join(folder, "notes.txt"), os.path.join(folder, "train.py")
    with open(notes, "w") as handle:
        handle.write("Run it with torchrun.\n")
    with open(script, "w") as handle:
        handle.write(FSDP1_FILE)
    cases["compare-scripts notes.txt notes.txt (refused)"] = ["compare-scripts", notes, notes]
    cases["explain (the argument tables)"] = ["explain"]
    for target in ("bridge", "fsdp2"):
        cases[f"migrate train.py --to {target} (17 lines)"] = ["migrate", script, "--to", target]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    cases = _cases(tempfile.mkdtemp(prefix="fsdp-bridge-cli-start-"))
    times: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(args.repeats):  # rounds, so a burst of load spreads over every command
        for label, argv in cases.items():
            times[label].append(_seconds(argv))
    print(f"{'command':46s} {'median s':>9s}  range")
    for label, values in times.items():
        print(f"{label:46s} {statistics.median(values):9.2f}  {min(values):.2f}-{max(values):.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
