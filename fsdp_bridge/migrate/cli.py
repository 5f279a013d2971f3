"""`fsdp-bridge migrate PATH... --to {bridge,fsdp2,yafsdp}`.

Exit codes: 0 nothing to change (or everything written), 1 changes pending (--diff, --check),
2 errors (a file that fails to parse is reported; the other files are still processed).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time

from fsdp_bridge import progress
from fsdp_bridge.codemods import rules
from fsdp_bridge.migrate import report
from fsdp_bridge.migrate.driver import (
    TARGETS,
    ChangedOnDisk,
    FileResult,
    Writer,
    run_all,
    settle_type_checks,
    write_problem,
)
from fsdp_bridge.migrate.files import walk


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to migrate")
    parser.add_argument("--to", required=True, choices=TARGETS, dest="target",
                        help="bridge: import fsdp_bridge's mirrored modules; fsdp2: native torch "
                        "fully_shard; yafsdp: fsdp_bridge.ya_fsdp.YaFSDP")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--diff", dest="mode", action="store_const", const="diff",
                      help="show unified diffs, write nothing (default)")
    mode.add_argument("--write", dest="mode", action="store_const", const="write",
                      help="rewrite the files in place (atomically)")
    mode.add_argument("--check", dest="mode", action="store_const", const="check",
                      help="write nothing; exit 1 if any file would change")
    parser.set_defaults(mode="diff")
    parser.add_argument("--report", metavar="FILE", help="write every site to FILE (.json or .md)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip paths matching this gitignore-style glob (repeatable)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="worker processes for the files that need parsing (default: all cores)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (it is drawn on stderr, and only on a terminal)")


def _diff(result: FileResult) -> str:
    old = result.old_source.decode("utf-8").splitlines(keepends=True)
    new = result.new_source.decode("utf-8").splitlines(keepends=True)
    return "".join(difflib.unified_diff(old, new, f"a/{result.path}", f"b/{result.path}"))


# Sites of a constructor the rewrite turns into the new dialect.
CONSTRUCTOR_RULES = {rules.CONSTRUCTOR_IN_PLACE, rules.CONSTRUCTOR_AT_RUN_TIME, rules.YAFSDP_IN_PLACE,
                     rules.YAFSDP_AT_RUN_TIME}


def _write(results: list[FileResult], target: str, jobs: int) -> list[FileResult]:
    """Check every file to be rewritten, then rewrite those that can be (problems become errors).

    A file that cannot be written keeps its FSDP1 constructors, so the type checks of the other
    files are settled again, knowing that, before anything is written."""
    problems = {r.path: write_problem(r.path) for r in results if r.changed}
    stuck = [f"{r.path} (cannot be written)" for r in results if problems.get(r.path)
             and any(site["rule"] in CONSTRUCTOR_RULES for site in r.sites)]
    if stuck:
        results = settle_type_checks(results, target, jobs, stuck)
    pending = [r for r in results if r.changed]
    for result in pending:
        result.error = problems[result.path] if result.path in problems else write_problem(result.path)
    with Writer() as writer:
        for result in pending:
            if result.error is None:
                try:
                    writer.write(result.path, result.new_source, result.old_source, result.read_stat)
                except ChangedOnDisk as exc:
                    result.error = str(exc)
                except OSError as exc:
                    result.error = f"cannot rewrite: {exc}"
    for result in pending:
        if result.error is not None:
            result.new_source = None  # not rewritten: the report must not say it was
    return results


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        print(f"fsdp-bridge migrate: -j {args.jobs}: the number of jobs must be at least 1.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if args.report:  # every output path is checked before any file is touched
            report.check_path(args.report)
        paths = list(walk(args.paths, args.exclude))
    except (FileNotFoundError, ValueError) as exc:
        print(f"fsdp-bridge migrate: {exc}", file=sys.stderr)
        return 2
    with progress.bar(len(paths), "migrate", "file", args.quiet) as files_done:
        results = run_all(paths, args.target, args.jobs, lambda: files_done.update(1))
    if args.mode == "write":
        results = _write(results, args.target, args.jobs)
    for result in results:
        if result.error:
            print(f"error: {result.path}: {result.error}", file=sys.stderr)
        elif result.changed and args.mode == "diff":
            sys.stdout.write(_diff(result))
        elif result.changed and args.mode == "check":
            print(f"would rewrite {result.path}")
        for site in result.sites:
            if site["rule"] == rules.NOTEBOOK:
                print(f"note: {result.path}: {site['what']}; {site['reason']}", file=sys.stderr)
    if args.report:
        report.write(args.report, results, args.target)
    totals = report.summary(results, args.target)
    by_status = ", ".join(f"{n} {status}" for status, n in totals["by_status"].items())
    verb = "rewritten" if args.mode == "write" else "to change"
    print(
        f"fsdp-bridge migrate --to {args.target}: {totals['files']} files, {totals['parsed']} parsed, "
        f"{totals['changed']} {verb}, {totals['sites']} sites" + (f" ({by_status})" if by_status else "")
        + f", {totals['errors']} errors in {time.perf_counter() - started:.2f}s",
        file=sys.stderr,
    )
    if totals["errors"]:
        return 2
    return 1 if totals["changed"] and args.mode != "write" else 0
