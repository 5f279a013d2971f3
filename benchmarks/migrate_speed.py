"""How fast is `fsdp-bridge migrate`? Side by side with libcst's own runner on the same tree.

    .venv/bin/python benchmarks/migrate_speed.py [TREE] [-j N]

TREE defaults to the installed `transformers` package source (copied to a temporary directory so
nothing can touch the installed files). Both commands run in this one invocation, one after the
other, with the same number of worker processes:

  ours:   fsdp-bridge migrate TREE --to fsdp2 --check
  libcst: python -m libcst.tool codemod -x libcst.codemod.commands.noop.NOOPCommand TREE --no-format

The target is ours <= 0.1x libcst's time. The prefilter (fsdp_bridge/migrate/files.py) makes this
possible: libcst parses every file, we parse only the files that can contain FSDP usage.

`--top-level` takes the tree's top-level files alone (for transformers: 61 files, among them
`trainer.py`, two of them let through by the prefilter), where the few files we parse are the
largest ones: there the time is the per-file cost of `benchmarks/migrate_file_speed.py`.
`--repeats N` runs the two commands N times, interleaved, and prints each one's median and spread.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _default_tree() -> str:
    import transformers

    return os.path.dirname(transformers.__file__)


def _count(tree: str) -> tuple[int, int]:
    files = lines = 0
    for path in pathlib.Path(tree).rglob("*.py"):
        files += 1
        with open(path, "rb") as handle:
            lines += handle.read().count(b"\n")
    return files, lines


def _timed(command: list[str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - started, result.returncode, (result.stderr.strip().splitlines() or [""])[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=None, help="source tree (default: installed transformers)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--top-level", action="store_true", help="the tree's top-level .py files alone")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    source = args.tree or _default_tree()
    with tempfile.TemporaryDirectory() as scratch:
        tree = os.path.join(scratch, "tree")
        if args.top_level:
            os.makedirs(tree)
            for path in sorted(pathlib.Path(source).glob("*.py")):
                shutil.copy(path, tree)
        else:
            shutil.copytree(source, tree, ignore=shutil.ignore_patterns("__pycache__"))
        files, lines = _count(tree)
        print(f"tree: {source}{' (top level)' if args.top_level else ''} ({files} .py files, {lines} lines), "
              f"-j {args.jobs}, {args.repeats} round(s), load average {os.getloadavg()[0]:.1f}")
        ours = [sys.executable, "-m", "fsdp_bridge", "migrate", tree, "--to", "fsdp2", "--check", "-j", str(args.jobs)]
        theirs = [sys.executable, "-m", "libcst.tool", "codemod", "-x", "libcst.codemod.commands.noop.NOOPCommand",
                  tree, "--no-format", "-j", str(args.jobs), "--hide-progress"]
        runs: dict[str, list[float]] = {"fsdp-bridge migrate --check": [], "libcst no-op codemod": []}
        for _ in range(args.repeats):  # interleaved: a shared machine slows both alike
            for name, command in zip(runs, (ours, theirs)):
                seconds, code, last = _timed(command)
                runs[name].append(seconds)
        for name, seconds in runs.items():
            median = statistics.median(seconds)
            print(f"{name:30s} {median:8.2f} s (spread {min(seconds):.2f}-{max(seconds):.2f})  "
                  f"{files / median:9.0f} files/s  {lines / median:11.0f} lines/s")
        ratio = statistics.median(runs["fsdp-bridge migrate --check"]) / statistics.median(runs["libcst no-op codemod"])
        verdict = "met" if ratio <= 0.1 else "NOT met"
        print(f"ratio ours/libcst: {ratio:.3f}x  (target <= 0.1x over a whole tree: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
