"""The equivalence part of `make demo`, ready to be wired into `fsdp_bridge/demo.py`.

1. `fsdp-bridge migrate --to bridge` and `--to fsdp2` rewrite the realistic FSDP1 example
   (`fsdp_bridge/examples/fsdp1_train_llama.py`) into a temporary directory;
2. `compare-scripts` runs the original (twice: determinism) and both rewrites on 2 CPU ranks;
3. the tables are printed and the loss/deviation plot is written.

Returns the compare-scripts exit code: 0 when both rewrites match the original.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable, Optional

from fsdp_bridge.outputs import write_bytes

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(PACKAGE, "examples", "fsdp1_train_llama.py")
TARGETS = ("bridge", "fsdp2")


def migrate_copy(example: str, target: str, out_dir: str, quiet: bool = False) -> str:
    """A copy of `example` rewritten by `fsdp-bridge migrate --to target --write` (`-q`: without
    migrate's summary line)."""
    from fsdp_bridge.migrate import cli as migrate_cli

    stem = os.path.splitext(os.path.basename(example))[0]
    path = os.path.join(out_dir, f"{stem}_to_{target}.py")
    with open(example, "rb") as handle:
        write_bytes(path, handle.read())  # replaces only this file of out_dir
    parser = argparse.ArgumentParser(prog="fsdp-bridge migrate")
    migrate_cli.add_arguments(parser)
    argv = [path, "--to", target, "--write"] + (["-q"] if quiet else [])
    code = int(migrate_cli.run(parser.parse_args(argv)) or 0)
    if code not in (0, 1):  # 1: migrated with sites to review, still a runnable file
        raise RuntimeError(f"fsdp-bridge migrate --to {target} {path} failed with exit {code}")
    return path


def run_demo_flow(example: str = EXAMPLE, nproc: int = 2, steps: int = 3,
                  out_dir: Optional[str] = None, show: Callable[[str], None] = print,
                  quiet: bool = False) -> int:
    from fsdp_bridge import progress
    from fsdp_bridge.harness.compare import tolerance_for
    from fsdp_bridge.harness.report import render_table, save_plot
    from fsdp_bridge.harness.scripts import compare_scripts

    out_dir = out_dir or tempfile.mkdtemp(prefix="fsdp-bridge-demo-")
    os.makedirs(out_dir, exist_ok=True)
    rewrites = [migrate_copy(example, target, out_dir, quiet) for target in TARGETS]
    for target, path in zip(TARGETS, rewrites):
        show(f"migrated --to {target}: {path}")
    # The original runs twice (its determinism is checked), then each rewrite once.
    with progress.bar(2 + len(rewrites), "demo: script runs", "run", quiet) as runs_done:
        report = compare_scripts(example, rewrites, nproc=nproc, args=["--steps", str(steps)],
                                 tolerance=tolerance_for("fp32"),
                                 on_run=lambda run: runs_done.update(1))
    show(render_table(report))
    for error in report.errors:
        show(f"error: {error}")
    plot = os.path.join(out_dir, "compare.png")
    save_plot(report, plot)
    show(f"plot: {plot}")
    return report.exit_code
