"""Files fsdp-bridge writes: checked before any work starts (`check_output_file`), so a long run
never ends in a traceback about its output path, and written atomically (`atomic_path`: a
temporary sibling renamed into place), so an interrupted write never leaves half a file. The one
file writer of the package: the command line's outputs (`--json`, `--plot`, `--write-docs`,
`--report`, demo's copies), migrate's rewrites and converted checkpoint files all go through
`atomic_path`, which replaces the one file it names and nothing else. `os_error_line` says in
one line what a failed file-system call means and what to do."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import math
import os
import sys
import uuid
from typing import BinaryIO, Callable, Optional

# A `--json` path that means standard output.
STDOUT = "-"


def check_output_file(flag: str, path: Optional[str], stdout: bool = False) -> None:
    """Raise ValueError naming `flag` unless `path` can be written as a file (or, with
    `stdout`, is "-": standard output)."""
    if path is None or (stdout and path == STDOUT):
        return
    if not path:
        raise ValueError(f"{flag} '': expected a file path{' (or - for stdout)' * stdout}.")
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        state = "is a file" if os.path.lexists(parent) else "does not exist"
        raise ValueError(f"{flag} {path!r}: the directory {parent!r} {state}; create it first "
                         "or write somewhere else.")
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path, e.g. "
                         f"{os.path.join(path, 'report')!r} with its extension.")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path!r}: the directory {parent!r} is not writable; write "
                         "somewhere else.")


def check_plot_file(flag: str, path: Optional[str]) -> None:
    """Raise ValueError naming `flag` unless `path` can be written as a file in an image format
    matplotlib writes, told by its suffix (matplotlib picks the format from it)."""
    check_output_file(flag, path)
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} {path!r} needs matplotlib, which is not installed: pip "
                         "install 'fsdp-bridge[plot]' (or matplotlib), or leave out the plot.")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    root, suffix = os.path.splitext(path)
    if suffix.lstrip(".").lower() not in formats:
        said = f"its suffix {suffix!r} is" if suffix else "it has no suffix, which is"
        raise ValueError(f"{flag} {path!r}: {said} not an image format matplotlib writes; end "
                         f"the name with one of {', '.join('.' + f for f in formats)}, e.g. "
                         f"{root + '.png'!r}.")


@contextlib.contextmanager
def atomic_path(path: str, *, temporary: Optional[str] = None, durable: bool = False,
                before_replace: Callable[[], None] = lambda: None):
    """Yield a temporary sibling of `path` to write; it replaces `path` only if the block
    succeeds (and `before_replace()`, a last check, raises nothing), and is removed otherwise.

    `temporary`: its name (default: `path` with a random infix, same extension, since writers
    infer formats from it). `durable`: fsync the file before the rename and the directory after
    it, so that the new content survives a power loss, not only a crash. A symbolic link at
    `path` stays a link: the file it points to is replaced, as a shell's `>` would write it.
    Only `path` is replaced; every other file in its directory stays as it was."""
    full = os.path.realpath(path)
    root, ext = os.path.splitext(full)
    tmp = temporary or f"{root}.tmp-{uuid.uuid4().hex[:12]}{ext}"
    try:
        yield tmp
        if durable:
            fsync_file(tmp)
        before_replace()
        os.replace(tmp, full)
        if durable:
            fsync_dir(os.path.dirname(full))
    except OSError as exc:
        if exc.errno is not None and exc.filename in (None, tmp):
            exc.filename = path  # name the file the caller asked for
        raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename in directory `path` durable (where directories can be opened and synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# What a failed file-system call means for the one who asked for the write, and what to do.
_ADVICE = {
    errno.ENOSPC: "the disk is full: free some space and run again",
    getattr(errno, "EDQUOT", errno.ENOSPC): "the disk quota is used up: free some space and run again",
    errno.EFBIG: "a file-size limit was reached (ulimit -f): raise it, or write less",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.EACCES: "permission denied: make it writable (chmod u+w) or write somewhere else",
    errno.EPERM: "the operation is not permitted there: write somewhere else",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOENT: "it, or a directory on the way, does not exist: create the directory first",
    errno.EXDEV: "it lies on another file system than its temporary copy: write elsewhere",
}


def is_file_system_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _ADVICE


def os_error_line(exc: OSError) -> str:
    """One line for a failed file-system call: what happened and what to do (the caller
    names the path), e.g. "the file system is read-only: write somewhere else [Errno 30]"."""
    said = _ADVICE.get(exc.errno or 0) or (exc.strerror or str(exc)).strip().splitlines()[0]
    return f"{said} [Errno {exc.errno}]" if exc.errno else said


def human_stream(json_path: Optional[str]):
    """Where a command prints its text: stdout, unless its JSON goes there (`--json -`), which
    then holds the JSON alone."""
    return sys.stderr if json_path == STDOUT else sys.stdout


def write_json(path: str, data) -> None:
    """`data` as JSON to the file `path` (atomically) or, for "-", to stdout. inf and NaN,
    which JSON lacks, are written as the strings "inf" and "nan", so that any reader loads it."""
    text = json.dumps(_finite(data), indent=2) + "\n"
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text(path, text)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)


def write_with(path: str, write: Callable[[BinaryIO], None]) -> None:
    """`write(file)` into a temporary sibling that then replaces `path`, durably: for writers
    that take an open file (`torch.save`), whose failures then keep their errno."""
    with atomic_path(path, durable=True) as tmp:
        with open(tmp, "wb") as handle:
            write(handle)


def write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
