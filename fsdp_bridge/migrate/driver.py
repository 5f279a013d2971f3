"""Run one codemod over one file; run many files in worker processes; write atomically."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator

from fsdp_bridge.migrate.files import YAML_FSDP, YAML_SUFFIXES, may_use_fsdp

TARGETS = ("bridge", "fsdp2", "yafsdp")


@dataclasses.dataclass
class FileResult:
    path: str
    parsed: bool = False  # False: the prefilter showed it cannot contain FSDP usage
    new_source: bytes | None = None  # set only when the file changes
    old_source: bytes = b""
    sites: list[dict] = dataclasses.field(default_factory=list)
    error: str | None = None
    lines: int = 0

    @property
    def changed(self) -> bool:
        return self.new_source is not None


def _command(target: str):
    # Imported lazily: a run where the prefilter rejects everything never loads libcst.
    from codemods.to_bridge import ToBridgeCommand
    from codemods.to_fsdp2 import ToFsdp2Command
    from codemods.to_yafsdp import ToYafsdpCommand

    return {"bridge": ToBridgeCommand, "fsdp2": ToFsdp2Command, "yafsdp": ToYafsdpCommand}[target]


def transform_source(source: str, target: str, path: str = "<string>") -> tuple[str, list[dict]]:
    """Rewrite one file's text; returns (new text, report sites). Raises on a parse error."""
    import libcst as cst
    from libcst.codemod import CodemodContext

    from codemods._common import SITES_KEY

    context = CodemodContext(filename=path)
    command = _command(target)(context)
    module = command.transform_module(cst.parse_module(source))
    return module.code, [site.as_dict() for site in context.scratch.get(SITES_KEY, [])]


def _yaml_sites(data: bytes) -> list[dict]:
    sites = []
    for match in YAML_FSDP.finditer(data):
        sites.append({
            "rule": "FB401", "status": "report only", "line": data.count(b"\n", 0, match.start()) + 1,
            "what": "accelerate config enables FSDP",
            "reason": "FSDP is configured in accelerate YAML: set fsdp_version: 2 (and check "
                      "fsdp_reshard_after_forward; `accelerate to-fsdp2` maps HYBRID_SHARD to plain sharding)",
        })
        break  # one line per file is enough
    return sites


def process(path: str, target: str) -> FileResult:
    """Everything `migrate` does to one file, except writing it."""
    result = FileResult(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        result.error = f"cannot read: {exc}"
        return result
    result.old_source = data
    result.lines = data.count(b"\n")
    if path.endswith(YAML_SUFFIXES):
        result.sites = _yaml_sites(data)
        return result
    if not may_use_fsdp(data, target):
        return result
    result.parsed = True
    try:
        source = data.decode("utf-8")
        new_source, result.sites = transform_source(source, target, path)
    except UnicodeDecodeError as exc:
        result.error = f"not UTF-8: {exc}"
    except Exception as exc:  # a parse error (libcst.ParserSyntaxError) or a codemod bug
        message = str(exc).strip().splitlines()
        result.error = f"{type(exc).__name__}: {message[0] if message else ''}"
    else:
        if new_source != source:
            result.new_source = new_source.encode("utf-8")
    return result


def _process_star(args: tuple[str, str]) -> FileResult:
    return process(*args)


def run_all(paths: Iterable[str], target: str, jobs: int, on_done: Callable[[], None]) -> Iterator[FileResult]:
    """Process files in order; files that need parsing go to `jobs` worker processes."""
    paths = list(paths)
    if jobs <= 1:
        for path in paths:
            yield process(path, target)
            on_done()
        return
    # The prefilter is cheap: only the files it lets through are worth sending to a worker.
    candidates, results = [], {}
    for path in paths:
        if path.endswith(YAML_SUFFIXES) or not _passes_prefilter(path, target):
            results[path] = process(path, target)
            on_done()
        else:
            candidates.append(path)
    if len(candidates) <= 1:
        for path in candidates:
            results[path] = process(path, target)
            on_done()
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(candidates))) as pool:
            for result in pool.map(_process_star, [(p, target) for p in candidates]):
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


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never a mix."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o7777
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".fsdp-bridge-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
