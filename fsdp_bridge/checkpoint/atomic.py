"""Atomic publication of a checkpoint directory.

[Note: atomic checkpoints]
A checkpoint is written into a sibling temporary directory (`<path>.tmp-<token>`), every file
and the directory are fsync'ed, and only then is it renamed into place. A crash at any point
before the rename leaves `<path>` as it was (the previous checkpoint, or nothing) plus a
`.tmp-` directory that nothing reads and the next save may clean. Replacing an existing
checkpoint takes two renames (`<path>` to `<path>.old-<token>`, then the new one to `<path>`);
a crash between them leaves no `<path>` but a complete `.old-` directory, which `resolve()`
finds and uses. `os.rename` of a directory is atomic on POSIX file systems; the parent
directory is fsync'ed after each rename so that the new name survives a power loss too.
"""

from __future__ import annotations

import glob
import os
import shutil
import warnings

TMP, OLD = ".tmp-", ".old-"


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(path: str) -> None:
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


def temporary_path(path: str, token: str) -> str:
    return f"{os.path.abspath(path)}{TMP}{token}"


def publish(tmp: str, path: str, token: str) -> None:
    """Move the finished directory `tmp` to `path`, replacing what was there."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_tree(tmp)
    if os.path.lexists(path):
        old = f"{path}{OLD}{token}"
        os.rename(path, old)
        fsync_dir(parent)
        os.rename(tmp, path)
        fsync_dir(parent)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
    else:
        os.rename(tmp, path)
    fsync_dir(parent)
    clean_stale(path)


def clean_stale(path: str) -> None:
    """Remove `.tmp-` leftovers of crashed saves (never the `.old-` of a live recovery)."""
    if os.path.lexists(path):
        for leftover in glob.glob(glob.escape(path) + TMP + "*"):
            shutil.rmtree(leftover, ignore_errors=True)


def resolve(path: str) -> str:
    """The directory to read for checkpoint `path`: itself, or the previous checkpoint left by
    a save that crashed between its two renames."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    olds = sorted(glob.glob(glob.escape(path) + OLD + "*"), key=os.path.getmtime)
    if olds:
        warnings.warn(f"fsdp_bridge: checkpoint {path} is missing but {olds[-1]} is the "
                      "complete previous checkpoint (a save crashed while replacing it); "
                      "loading that.", stacklevel=3)
        return olds[-1]
    raise FileNotFoundError(f"checkpoint {path!r} does not exist.")
