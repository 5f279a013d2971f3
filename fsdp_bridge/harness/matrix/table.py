"""`fsdp-bridge compare --matrix`: the cells, the table, the JSON and the exit status.

Exit 0 when every cell conforms (equal, no reference, or a refusal native shares or README
lists), 1 when one does not (differs, crash, a refusal nobody lists), 3 when every cell run
conforms but the time budget left some unrun; cells a KNOWN entry covers are shown apart and
do not count.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from typing import Sequence

from fsdp_bridge.harness.matrix.axes import AXES, BASELINES, SAMPLE_SPACE, Cell

EXIT_CONFORMS, EXIT_DIFFERS, EXIT_ERROR, EXIT_INCOMPLETE = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("conformance matrix (--matrix)")
    group.add_argument("--matrix", action="store_true",
                       help="train the conformance matrix: our front-ends against native torch "
                            "(or their reference) over a covering array of the axes; one table")
    group.add_argument("--axes", nargs="+", metavar="AXIS=V1,V2", default=[],
                       help="restrict axes to some values, e.g. frontend=fsdp1,fsdp2 world=2 "
                            f"(axes: {', '.join(AXES)}); default: every value of every axis")
    group.add_argument("--sample", action="store_true",
                       help="the suite's space: 2 ranks, no torch.compile, fewer checkpointing "
                            "and micro-step values (add --axes to restrict further)")
    group.add_argument("--cover-seed", type=int, default=0,
                       help="seed of the covering array (which cells cover the pairs; default 0)")
    group.add_argument("--budget", type=float, metavar="SECONDS",
                       help="start no new cell after this many seconds; the rest are reported "
                            "'not run' (exit 3 if all that ran conform)")
    group.add_argument("--list", action="store_true",
                       help="print the cells the matrix would run, and exit")


def parse_axes(items: Sequence[str], sample: bool) -> dict:
    """The space `--axes` (and `--sample`) ask for; ValueError naming the bad item."""
    space = dict(SAMPLE_SPACE) if sample else {}
    for item in items:
        axis, sep, values = item.partition("=")
        if not sep or axis not in AXES:
            raise ValueError(f"--axes {item!r}: expected AXIS=V1,V2 with AXIS one of "
                             f"{', '.join(AXES)}.")
        known = {str(value): value for value in AXES[axis][0]}
        chosen = []
        for text in values.split(","):
            if text not in known:
                raise ValueError(f"--axes {item!r}: {text!r} is not a value of {axis} (use "
                                 f"{', '.join(known)}).")
            chosen.append(known[text])
        space[axis] = tuple(chosen)
    return space


def cells_for(args: argparse.Namespace) -> list[Cell]:
    from fsdp_bridge.harness.matrix.axes import covering_cells

    if args.cover_seed < 0:
        raise ValueError(f"--cover-seed {args.cover_seed}: expected an int >= 0.")
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget {args.budget!r}: expected a number of seconds > 0.")
    cells = covering_cells(parse_axes(args.axes, args.sample), seed=args.cover_seed)
    if not cells:
        raise ValueError(f"--axes {' '.join(args.axes)}: no valid cell holds these values "
                         "together.")
    return cells


def exit_code(outcomes) -> int:
    counted = [o for o in outcomes if not o.known]
    if any(not o.conforming and o.status != "not run" for o in counted):
        return EXIT_DIFFERS
    return EXIT_INCOMPLETE if any(o.status == "not run" for o in counted) else EXIT_CONFORMS


def _status(outcome) -> str:
    if outcome.status in ("refused", "crash") and outcome.conforming:
        return f"{outcome.status} (ok)"
    return outcome.status


def render(outcomes, seconds: float) -> str:
    lines = ["== conformance matrix: ours against native torch (or the reference) ==",
             "baselines: " + "; ".join(f"{name}: {what}" for name, what in BASELINES.items())]
    width = max([len(o.cell.label()) for o in outcomes] + [4])
    lines.append(f"{'#':>3}  {'cell':<{width}}  {'status':<14} basis / detail")
    for index, outcome in enumerate(outcomes, start=1):
        if outcome.known:
            continue
        text = "; ".join(part for part in (outcome.basis, outcome.detail) if part)
        lines.append(f"{index:>3}  {outcome.cell.label():<{width}}  {_status(outcome):<14} {text}")
    known = [(i, o) for i, o in enumerate(outcomes, start=1) if o.known]
    if known:
        lines.append("")
        lines.append("known differences, fixed elsewhere (not counted; listed in "
                     "fsdp_bridge/harness/matrix/axes.py KNOWN):")
        for index, outcome in known:
            lines.append(f"{index:>3}  {outcome.cell.label():<{width}}  "
                         f"{outcome.status:<14} [{outcome.known}] {outcome.detail}")
    lines.append("")
    lines.append(summary(outcomes, seconds))
    lines.append({EXIT_CONFORMS: "RESULT: every cell conforms",
                  EXIT_DIFFERS: "RESULT: NOT conforming",
                  EXIT_INCOMPLETE: "RESULT: incomplete (time budget)"}[exit_code(outcomes)])
    return "\n".join(lines)


def summary(outcomes, seconds: float) -> str:
    counts = collections.Counter(_status(o) for o in outcomes if not o.known)
    bitwise = sum(1 for o in outcomes if not o.known and o.status == "equal"
                  and o.basis == "bit for bit")
    parts = [f"{len(outcomes)} cells in {seconds:.0f} s:"]
    for status in ("equal", "no reference", "refused (ok)", "crash (ok)", "differs", "refused",
                   "crash", "not run"):
        if counts[status]:
            extra = f" ({bitwise} bit for bit)" if status == "equal" else ""
            parts.append(f"{counts[status]} {status}{extra}")
    known = sum(1 for o in outcomes if o.known)
    if known:
        parts.append(f"{known} known")
    return " ".join(parts[:1]) + " " + ", ".join(parts[1:])


def to_json(outcomes, seconds: float, cover_seed: int) -> dict:
    return {"cells": [o.as_dict() for o in outcomes], "seconds": round(seconds, 1),
            "cover_seed": cover_seed, "baselines": BASELINES,
            "axes": {axis: [str(v) for v in values] for axis, (values, _) in AXES.items()},
            "summary": summary(outcomes, seconds), "exit_code": exit_code(outcomes)}


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge import progress
    from fsdp_bridge.harness import arguments

    try:
        cells = cells_for(args)
        arguments.outputs(args.json, None)
    except ValueError as exc:
        print(f"fsdp-bridge compare --matrix: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.list:
        for index, cell in enumerate(cells, start=1):
            print(f"{index:>3}  {cell.label()}")
        print(f"{len(cells)} cells")
        return EXIT_CONFORMS
    progress.note(f"fsdp-bridge compare --matrix: {len(cells)} cells (covering seed "
                  f"{args.cover_seed}); loading torch...", args.quiet)
    from fsdp_bridge.harness.matrix.sweep import SweepOptions, run_sweep

    started = time.time()
    options = SweepOptions(device=args.device, quiet=args.quiet, seed=args.seed,
                           deadline=None if args.budget is None else started + args.budget)

    def on_world(world: int, count: int) -> None:
        progress.note(f"fsdp-bridge compare --matrix: {count} cells on {world} ranks...",
                      args.quiet)

    try:
        outcomes = run_sweep(cells, options, on_world)
    except KeyboardInterrupt:
        print("fsdp-bridge compare --matrix: interrupted; every rank it started was stopped.",
              file=sys.stderr)
        return 130
    seconds = time.time() - started
    print(render(outcomes, seconds))
    if args.json:
        from fsdp_bridge.outputs import write_text

        write_text(args.json, json.dumps(to_json(outcomes, seconds, args.cover_seed), indent=2))
    return exit_code(outcomes)

