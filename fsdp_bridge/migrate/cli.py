"""`fsdp-bridge migrate PATH... --to {bridge,fsdp2,yafsdp}`.

Exit codes: 0 nothing to change (or everything written), 1 changes pending (--diff, --check),
2 errors (a file that fails to parse, or a file named on the command line that is not Python,
YAML or a notebook, is reported; the other files are still processed).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time

from fsdp_bridge import progress
from fsdp_bridge.migrate import report
from fsdp_bridge.migrate.driver import (
    TARGETS,
    ChangedOnDisk,
    FileResult,
    Writer,
    check_unchanged,
    run_all,
    sweep_temporaries,
    write_problem,
)
from fsdp_bridge.migrate.files import READ_SUFFIXES, unsupported_files, walk
from fsdp_bridge.text import plural


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
    parser.add_argument("--no-default-excludes", dest="default_excludes", action="store_false",
                        help="also walk into virtual environments (a directory holding "
                        "pyvenv.cfg, .venv, venv, site-packages, ...) and build or tool "
                        "directories (build, dist, .tox, node_modules, __pypackages__, ...), "
                        "skipped by default as ruff and black skip them")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="worker processes for the files that need parsing (default: all cores)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (drawn on stderr, only on a terminal) and no summary "
                        "lines; errors are still printed")


def _diff(result: FileResult) -> str:
    old = result.old_source.decode("utf-8").splitlines(keepends=True)
    new = result.new_source.decode("utf-8").splitlines(keepends=True)
    return "".join(difflib.unified_diff(old, new, f"a/{result.path}", f"b/{result.path}"))


def _write_problem(result: FileResult) -> str | None:
    """Why `result`'s file cannot be rewritten now: not writable, or edited since it was read."""
    problem = write_problem(result.path)
    if problem is None:
        try:
            check_unchanged(os.path.realpath(result.path), result.old_source, result.read_stat)
        except ChangedOnDisk as exc:
            problem = str(exc)
    return problem


def _write(results: list[FileResult]) -> tuple[list[FileResult], str | None]:
    """Rewrite every changed file, or none: each is checked (writable, unchanged since it was
    read) before any is written, and if a rename still fails midway, the files already rewritten
    get their original bytes back. Returns the results (errors set, and nothing marked changed
    when nothing was written) and a line saying why nothing was written (None: all were)."""
    sweep_temporaries(result.path for result in results)  # what a killed run left
    pending = [r for r in results if r.changed]
    for result in pending:
        result.error = _write_problem(result)
    refused = [r for r in pending if r.error is not None]
    if not refused:
        refused = _write_all(pending)
    if not refused:
        return results, None
    for result in pending:
        result.new_source = None  # not rewritten: the report must not say it was
    return results, (f"nothing was written: {len(refused)} of the {len(pending)} files to "
                     "rewrite could not be (see the errors above), and --write rewrites all of "
                     "them or none, so the tree is never half migrated; fix those and run again")


def _write_all(pending: list[FileResult]) -> list[FileResult]:
    """Write each file; on a failure, restore those already written. The files that failed."""
    written: list[FileResult] = []
    with Writer() as writer:
        for result in pending:
            try:
                writer.write(result.path, result.new_source, result.old_source, result.read_stat)
            except OSError as exc:
                reason = str(exc) if isinstance(exc, ChangedOnDisk) else f"cannot rewrite: {exc}"
                result.error = reason
                for done in reversed(written):  # back to the bytes it had, if still ours
                    writer.write(done.path, done.old_source, done.new_source)
                return [result]
            written.append(result)
    return []


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


# Sites the user has to look at: a TODO left in the code, or a construct only reported
# (codemods.base.TODO and INFO, named here without importing libcst, as report.py does).
_TO_REVIEW = ("left with TODO", "report only")


def _list_sites_to_review(results: list[FileResult]) -> None:
    """Every site left with a TODO or only reported, as `path:line: FBxxx what: why` on stderr
    (the lines of the file as it was read), so that they are found without --report."""
    sites = [(result.path, site) for result in results for site in result.sites
             if site["status"] in _TO_REVIEW]
    if not sites:
        return
    print(f"fsdp-bridge migrate: {plural(len(sites), 'site')} to review (left with a TODO, or "
          "reported only):", file=sys.stderr)
    for path, site in sorted(sites, key=lambda item: (item[0], item[1]["line"])):
        print(f"  {path}:{site['line']}: {site['rule']} {site['what']}: {site['reason']}",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        print(f"fsdp-bridge migrate: -j {args.jobs}: the number of jobs must be at least 1.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if args.report:  # every output path is checked before any file is touched
            report.check_path(args.report)
        skipped: list[str] = []
        outside: list[str] = []
        unread = unsupported_files(args.paths)
        paths = list(walk([p for p in args.paths if p not in unread], args.exclude,
                          args.default_excludes, skipped, outside))
    except (FileNotFoundError, ValueError) as exc:
        print(f"fsdp-bridge migrate: {exc}", file=sys.stderr)
        return 2
    for path in unread:
        print(f"error: {path}: not a Python ({', '.join(READ_SUFFIXES[:2])}), YAML or notebook "
              "file: skipped (migrate rewrites Python and reports YAML and notebooks)",
              file=sys.stderr)
    if skipped:
        progress.note(f"fsdp-bridge migrate: skipped {_shown(skipped)} (virtual environment or build "
                      "directory); --no-default-excludes to migrate them too", args.quiet)
    if outside:
        progress.note(f"fsdp-bridge migrate: skipped {_shown(outside)}: symbolic links to files "
                      "outside the directories given; migrate writes only inside them (name "
                      "such a file itself to migrate it)", args.quiet)
    with progress.bar(len(paths), "migrate", "file", args.quiet) as files_done:
        results = run_all(paths, args.target, args.jobs, lambda: files_done.update(1))
    nothing_written = None
    if args.mode == "write":
        results, nothing_written = _write(results)
    for result in results:
        if result.error:
            print(f"error: {result.path}: {result.error}", file=sys.stderr)
        elif result.changed and args.mode == "diff":
            sys.stdout.write(_diff(result))
        elif result.changed and args.mode == "check":
            print(f"would rewrite {result.path}")
    if not args.quiet:
        _list_sites_to_review(results)
    if nothing_written:
        print(f"fsdp-bridge migrate: {nothing_written}", file=sys.stderr)
    if args.report:
        report.write(args.report, results, args.target)
    totals = report.summary(results, args.target)
    errors = totals["errors"] + len(unread)
    by_status = ", ".join(f"{n} {status}" for status, n in totals["by_status"].items())
    verb = "rewritten" if args.mode == "write" else "to change"
    progress.note(
        f"fsdp-bridge migrate --to {args.target}: {plural(totals['files'], 'file')}, "
        f"{totals['parsed']} parsed, {totals['changed']} {verb}, {plural(totals['sites'], 'site')}"
        + (f" ({by_status})" if by_status else "")
        + f", {plural(errors, 'error')} in {time.perf_counter() - started:.2f}s",
        args.quiet,
    )
    if errors:
        return 2
    return 1 if totals["changed"] and args.mode != "write" else 0
