"""Run one codemod over one file; run many files in worker processes; write atomically.

[Note: type checks are settled over the whole tree]
Whether `isinstance(x, FullyShardedDataParallel)` may become `isinstance(x, FSDPModule)` depends
on every file of the run: a constructor left as FSDP1 in one file builds the modules another file
checks. So every file is first rewritten as if the rest of the tree kept no FSDP1 constructor,
each result noting where its own file keeps them and whether it narrowed a type check; then, if
anything is kept anywhere (or a file that mentions FSDP could not be read or parsed),
the files that narrowed a check are rewritten again, told where, so that their checks accept
both classes. Nothing is written before this is settled (see fsdp_bridge/codemods/base.py, [Note: what
the tree keeps of FSDP1]).

[Note: nothing half-done survives a kill]
A file is replaced by `os.replace` of a complete temporary file (`fsdp_bridge.outputs.atomic_path`),
so readers see the original or the full rewrite. SIGKILL leaves no chance to clean up in the
process itself, so what it leaves is cleaned up from outside, as the checkpoint code does with a
killed save's leftovers: a temporary file is named `.fsdp-bridge-<file>-<pid>-<n>.tmp`, with the
id of the process writing it, and `migrate --write` removes, in the directory of every file it
migrates, the temporary files of processes no longer running before it writes (prefix and
sweep). Pool workers watch their parent and end when it is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import re
import stat
import threading
import time
from ast import PyCF_ONLY_AST
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator

from fsdp_bridge.codemods import rules
from fsdp_bridge.migrate.files import (
    NOTEBOOK_SUFFIXES,
    PREFILTER,
    YAML_FSDP,
    YAML_SUFFIXES,
    decode_python,
    may_use_fsdp,
)
from fsdp_bridge.outputs import atomic_path

TARGETS = ("bridge", "fsdp2", "yafsdp")
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FileResult:
    path: str
    parsed: bool = False  # False: the prefilter showed it cannot contain FSDP usage
    new_source: bytes | None = None  # set only when the file changes
    old_source: bytes = b""
    sites: list[dict] = dataclasses.field(default_factory=list)
    error: str | None = None
    lines: int = 0
    read_stat: tuple[int, int] | None = None  # (size, mtime_ns) when old_source was read
    kept_fsdp1: list[str] = dataclasses.field(default_factory=list)  # "line 12 (FB302)"
    narrowed: bool = False  # a type check was narrowed to the new class only

    @property
    def changed(self) -> bool:
        return self.new_source is not None


def _command(target: str):
    # Imported lazily: a run where the prefilter rejects everything never loads libcst.
    from fsdp_bridge.codemods.to_bridge import ToBridgeCommand
    from fsdp_bridge.codemods.to_fsdp2 import ToFsdp2Command
    from fsdp_bridge.codemods.to_yafsdp import ToYafsdpCommand

    return {"bridge": ToBridgeCommand, "fsdp2": ToFsdp2Command, "yafsdp": ToYafsdpCommand}[target]


def transform_source(source: str, target: str, path: str = "<string>",
                     kept_elsewhere: tuple[str, ...] = ()) -> tuple[str, list[dict]]:
    """Rewrite one file's text; returns (new text, report sites). Raises on a parse error.

    `kept_elsewhere`: where the rest of the tree keeps FSDP1 constructors (empty: nowhere, as
    when this file is the whole tree)."""
    new_source, sites, _ = transform_with_facts(source, target, path, kept_elsewhere)
    return new_source, sites


def transform_with_facts(source: str, target: str, path: str = "<string>",
                         kept_elsewhere: tuple[str, ...] = ()) -> tuple[str, list[dict], dict]:
    """`transform_source`, plus the file's facts: {"kept": [...], "narrowed": bool}."""
    import libcst as cst
    from libcst.codemod import CodemodContext

    from fsdp_bridge.codemods.base import FILE_FACTS_KEY, SITES_KEY, TREE_KEY

    def run(kept: tuple[str, ...]):
        context = CodemodContext(filename=path, scratch={TREE_KEY: kept})
        module = _command(target)(context).transform_module(cst.parse_module(source))
        facts = context.scratch.get(FILE_FACTS_KEY, {"kept": [], "narrowed": False})
        return module.code, [site.as_dict() for site in context.scratch.get(SITES_KEY, [])], facts

    new_source, sites, facts = run(tuple(kept_elsewhere))
    if facts["narrowed"] and facts["kept"]:
        # A check may come before the constructor it depends on: run again, knowing.
        own = tuple(f"this file, {where}" for where in facts["kept"])
        new_source, sites, again = run((*kept_elsewhere, *own))
        facts = {"kept": facts["kept"], "narrowed": again["narrowed"]}
    return new_source, sites, facts


def _yaml_sites(data: bytes) -> list[dict]:
    sites = []
    for match in YAML_FSDP.finditer(data):
        sites.append({
            "rule": rules.ACCELERATE_YAML, "status": "report only", "line": data.count(b"\n", 0, match.start()) + 1,
            "what": "accelerate config enables FSDP",
            "reason": "FSDP is configured in accelerate YAML: set fsdp_version: 2 (and check "
                      "fsdp_reshard_after_forward; `accelerate to-fsdp2` maps HYBRID_SHARD to plain sharding)",
        })
        break  # one line per file is enough
    return sites


def _notebook_sites(data: bytes, target: str) -> list[dict]:
    if PREFILTER[target].search(data) is None:
        return []
    return [{"rule": rules.NOTEBOOK, "status": "report only", "line": 1, "what": "notebook mentions FSDP",
             "reason": "notebooks are not rewritten: convert it to a script (jupytext --to py), "
                       "migrate that, and convert back"}]


def process(path: str, target: str, kept_elsewhere: tuple[str, ...] = ()) -> FileResult:
    """Everything `migrate` does to one file, except writing it (see [Note: type checks are
    settled over the whole tree] for `kept_elsewhere`)."""
    result = FileResult(path)
    try:
        with open(path, "rb") as handle:
            before = os.fstat(handle.fileno())
            data = handle.read()
    except OSError as exc:
        result.error = f"cannot read: {exc}"
        return result
    result.old_source = data
    result.read_stat = (before.st_size, before.st_mtime_ns)
    result.lines = data.count(b"\n")
    if path.endswith(YAML_SUFFIXES):
        result.sites = _yaml_sites(data)
        return result
    if path.endswith(NOTEBOOK_SUFFIXES):
        result.sites = _notebook_sites(data, target)
        return result
    if not may_use_fsdp(data, target):
        logger.debug("%s: no FSDP name in it, not parsed", path)
        return result
    result.parsed = True
    # Decoded as Python decodes it (UTF-8, a PEP 263 declaration such as latin-1, a kept
    # byte-order mark), and written back in the same encoding.
    try:
        source, encode = decode_python(data)
    except (SyntaxError, UnicodeDecodeError) as exc:
        result.error = f"cannot decode as Python source: {exc}"
        return result
    try:
        new_source, result.sites, facts = transform_with_facts(source, target, path, kept_elsewhere)
        result.kept_fsdp1, result.narrowed = list(facts["kept"]), facts["narrowed"]
        if new_source != source:
            result.new_source = encode(new_source)
    except UnicodeEncodeError as exc:
        result.error = f"the rewrite holds a character the file's encoding cannot write: {exc}"
    except Exception as exc:  # a parse error (libcst.ParserSyntaxError) or a codemod bug
        result.error = _error_line(exc, source, path)
    logger.debug("%s: parsed, %d sites%s", path, len(result.sites),
                 ", rewritten" if result.changed else "")
    return result


def _error_line(exc: Exception, source: str, path: str) -> str:
    """One line for a file that could not be rewritten. For a syntax error, Python's own account
    of it (libcst reports where its parser gave up, often lines later than the mistake: an
    unclosed bracket is found at the end of the file)."""
    if type(exc).__name__ == "ParserSyntaxError":
        try:
            compile(source, path, "exec", flags=PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as python:
            return f"SyntaxError: {python.msg} (line {python.lineno})"
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0] if message else ''}"


def _process_star(args: tuple) -> FileResult:
    return process(*args)


# Sites that show a file builds FSDP1 modules without a constructor this run rewrites.
_FSDP1_BUILDERS = {rules.ACCELERATE_YAML: "accelerate config", rules.NOTEBOOK: "notebook, not migrated"}


def fsdp1_kept(results: Iterable[FileResult]) -> list[str]:
    """Where the run's files keep FSDP1 constructors, for the report: "path line 3 (FB302)"."""
    kept = []
    for result in results:
        kept += [f"{result.path} {where}" for where in result.kept_fsdp1]
        kept += [f"{result.path} ({_FSDP1_BUILDERS[s['rule']]})" for s in result.sites if s["rule"] in _FSDP1_BUILDERS]
        if result.error is not None:
            kept.append(f"{result.path} (not migrated: {result.error.split(':')[0]})")
    return kept


def settle_type_checks(results: list[FileResult], target: str, jobs: int) -> list[FileResult]:
    """Rewrite again the files whose type checks were narrowed while the tree keeps FSDP1
    constructors (see [Note: type checks are settled over the whole tree])."""
    kept = tuple(fsdp1_kept(results))
    redo = [r.path for r in results if r.narrowed and r.error is None]
    if not kept or not redo:
        return results
    again = {r.path: r for r in _map(redo, target, jobs, kept)}
    return [again.get(r.path, r) for r in results]


def _map(paths: list[str], target: str, jobs: int, kept: tuple[str, ...] = ()) -> Iterator[FileResult]:
    if jobs <= 1 or len(paths) <= 1:
        for path in paths:
            yield process(path, target, kept)
        return
    with ProcessPoolExecutor(max_workers=min(jobs, len(paths)), initializer=_die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        yield from pool.map(_process_star, [(p, target, kept) for p in paths])


def run_all(paths: Iterable[str], target: str, jobs: int, on_done: Callable[[], None]) -> list[FileResult]:
    """Process files in order (those that need parsing in `jobs` worker processes), then settle
    the type checks over the whole tree."""
    paths = list(paths)
    logger.info("migrating %d files to %s with %d worker process%s", len(paths), target, jobs,
                "es" * (jobs != 1))
    return settle_type_checks(list(_first_pass(paths, target, jobs, on_done)), target, jobs)


def _first_pass(paths: Iterable[str], target: str, jobs: int, on_done: Callable[[], None]) -> Iterator[FileResult]:
    paths = list(paths)
    if jobs <= 1:
        for path in paths:
            yield process(path, target)
            on_done()
        return
    # The prefilter is cheap: only the files it lets through are worth sending to a worker.
    candidates, results = [], {}
    for path in paths:
        if path.endswith(YAML_SUFFIXES + NOTEBOOK_SUFFIXES) or not _passes_prefilter(path, target):
            results[path] = process(path, target)
            on_done()
        else:
            candidates.append(path)
    for result in _map(candidates, target, jobs):
        results[result.path] = result
        on_done()
    for path in paths:
        yield results[path]


def _passes_prefilter(path: str, target: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return may_use_fsdp(handle.read(), target)
    except OSError:
        return True  # let process() report the error


def _die_with_parent(parent: int) -> None:
    """Pool worker start-up: end when the parent process is gone, even killed by SIGKILL (which
    it cannot pass on): a daemon thread looks every 0.2 s."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="fsdp-bridge-parent-watch", daemon=True).start()


def write_problem(path: str) -> str | None:
    """Why `path` cannot be rewritten in place (None: it can). Checked before any file is written."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        return f"cannot rewrite: {exc.strerror}"
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(real, os.W_OK):
        return "read-only file: not rewritten (make it writable, e.g. chmod u+w, and run again)"
    directory = os.path.dirname(real)
    if not os.access(directory, os.W_OK | os.X_OK):
        return (f"directory {directory} is not writable: not rewritten (the rewrite is written next to "
                "the file and renamed over it; make the directory writable and run again)")
    return None


# A rewrite's temporary file: `.fsdp-bridge-<file>-<pid of the writer>-<n>.tmp` (see
# [Note: nothing half-done survives a kill]).
_TEMPORARY = re.compile(r"^\.fsdp-bridge-.+-(?P<pid>\d+)-\d+\.tmp$")


def sweep_temporaries(paths: Iterable[str]) -> list[str]:
    """Remove, in the directories of `paths` (files, symlinks followed), the rewrites' temporary
    files whose writer is no longer running (a killed migrate's); returns their paths."""
    removed = []
    for directory in sorted({os.path.dirname(os.path.realpath(path)) for path in paths}):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            match = _TEMPORARY.match(name)
            if match is None or _running(int(match.group("pid"))):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):  # another sweep got there first
                os.unlink(path)
                removed.append(path)
                logger.info("removed %s, left by a migrate that was killed", path)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ChangedOnDisk(OSError):
    """The file is no longer what the rewrite was computed from: replacing it would lose edits."""


def check_unchanged(real: str, expected: bytes, read_stat: tuple[int, int] | None) -> None:
    """Raise ChangedOnDisk unless `real` still holds `expected` (size, mtime and content)."""
    try:
        with open(real, "rb") as handle:
            now = os.fstat(handle.fileno())
            current = handle.read()
    except OSError as exc:
        raise ChangedOnDisk(f"changed on disk since it was read ({exc.strerror}): not rewritten; run migrate again")
    stat_moved = read_stat is not None and (now.st_size, now.st_mtime_ns) != read_stat
    if stat_moved or hashlib.sha256(current).digest() != hashlib.sha256(expected).digest():
        raise ChangedOnDisk("changed on disk since it was read (size, modification time or content differ): "
                            "not rewritten, so nothing written there since is lost; run migrate again")


class Writer:
    """Atomic in-place rewrites; see [Note: nothing half-done survives a kill].

    Just before the rename, the file is checked to still be what the rewrite was computed from
    (`expected`): an edit made while migrate ran (an editor saving, a second run) would be lost
    by the rename, so the file is refused by name instead."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, path: str, data: bytes, expected: bytes | None = None,
              read_stat: tuple[int, int] | None = None) -> None:
        """Replace `path` (the file a symlink points to, for a link) with `data`, keeping its mode;
        with `expected`, only if the file still holds it (see the class docstring)."""
        real = os.path.realpath(path)
        directory, name = os.path.split(real)
        mode = os.stat(real).st_mode & 0o7777
        temp = os.path.join(directory, f".fsdp-bridge-{name}-{os.getpid()}-{next(self._count)}.tmp")

        def still_expected() -> None:
            if expected is not None:
                check_unchanged(real, expected, read_stat)

        with atomic_path(real, temporary=temp, durable=True, before_replace=still_expected):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.chmod(temp, mode)


def write_atomic(path: str, data: bytes) -> None:
    """One atomic rewrite (see `Writer` for many)."""
    with Writer() as writer:
        writer.write(path, data)
