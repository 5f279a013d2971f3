"""Start-up time of the command line: `--help` of every command, and a mistyped argument
refused before torch loads (`compare --backends reference,nosuch`).

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
import time

from fsdp_bridge.cli import SUBCOMMANDS


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fsdp_bridge", *argv], capture_output=True,
                   timeout=300, check=False)
    return time.perf_counter() - start


def _cases() -> dict[str, list[str]]:
    cases = {"--help": ["--help"]}
    cases.update({f"{name} --help": [name, "--help"] for name in SUBCOMMANDS})
    cases["compare --backends reference,nosuch (refused)"] = ["compare", "--backends", "reference,nosuch"]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    cases = _cases()
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
