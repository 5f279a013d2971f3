"""How fast is `fsdp-bridge migrate`? Side by side with libcst's own runner on the same tree.

    .venv/bin/python benchmarks/migrate_speed.py [TREE] [-j N]

TREE defaults to the installed `transformers` package source (copied to a temporary directory so
nothing can touch the installed files). Both commands run in this one invocation, one after the
other, with the same number of worker processes:

  ours:   fsdp-bridge migrate TREE --to fsdp2 --check
  libcst: python -m libcst.tool codemod -x libcst.codemod.commands.noop.NOOPCommand TREE --no-format

The target is ours <= 0.1x libcst's time. The prefilter (fsdp_bridge/migrate/files.py) makes this
possible: libcst parses every file, we parse only the files that can contain FSDP usage.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tree = os.path.join(scratch, "tree")
        shutil.copytree(args.tree or _default_tree(), tree, ignore=shutil.ignore_patterns("__pycache__"))
        files, lines = _count(tree)
        print(f"tree: {args.tree or _default_tree()} ({files} .py files, {lines} lines), -j {args.jobs}")
        ours = [sys.executable, "-m", "fsdp_bridge", "migrate", tree, "--to", "fsdp2", "--check", "-j", str(args.jobs)]
        theirs = [sys.executable, "-m", "libcst.tool", "codemod", "-x", "libcst.codemod.commands.noop.NOOPCommand",
                  tree, "--no-format", "-j", str(args.jobs), "--hide-progress"]
        rows = []
        for name, command in (("fsdp-bridge migrate --check", ours), ("libcst no-op codemod", theirs)):
            seconds, code, last = _timed(command)
            rows.append((name, seconds))
            print(f"{name:30s} {seconds:8.2f} s  {files / seconds:9.0f} files/s  {lines / seconds:11.0f} lines/s"
                  f"  (exit {code}: {last})")
        ratio = rows[0][1] / rows[1][1]
        print(f"ratio ours/libcst: {ratio:.3f}x  (target <= 0.1x: {'met' if ratio <= 0.1 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
