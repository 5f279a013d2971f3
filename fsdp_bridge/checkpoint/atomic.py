"""Atomic publication of a checkpoint directory: where a save may write, one save at a time,
and what a crashed save leaves behind.

[Note: atomic checkpoints]
A checkpoint is written into a sibling temporary directory (`<path>.tmp-<token>`), every file
and the directory are fsync'ed, and only then is it renamed into place. A crash at any point
before the rename leaves `<path>` as it was (the previous checkpoint, or nothing) plus a
`.tmp-` directory that nothing reads. Replacing an existing checkpoint takes two renames
(`<path>` to `<path>.old-<token>`, then the new one to `<path>`); a crash between them leaves no
`<path>` but a complete `.old-` directory, which `resolve()` finds and uses. `os.rename` of a
directory is atomic on POSIX file systems; the parent directory is fsync'ed after each rename
so that the new name survives a power loss too.

Every save of `<path>` holds `lock(<path>)` (filelock) from its checks to its clean-up, so no
other save of the same path runs meanwhile; a second one is refused with the holder's pid. Under the lock,
any `.tmp-`/`.old-` sibling of `<path>` is a leftover of a crashed save: the next save removes
them before it writes (`clean_before_save`, keeping an `.old-` that is the only copy) and again
once its own checkpoint is in place (`clean_leftovers`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import warnings

import filelock

from fsdp_bridge.checkpoint import manifest
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.outputs import fsync_dir, fsync_file

TMP, OLD = ".tmp-", ".old-"
LOCK_SUFFIX = ".fsdp-bridge-lock"


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def temporary_path(path: str, token: str) -> str:
    return f"{os.path.abspath(path)}{TMP}{token}"


# -- where a save may write ---------------------------------------------------------------------


def check_parent(path: str, what: str = "save to") -> None:
    """The nearest existing ancestor of `path` must be a directory (missing ones are created)."""
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise CheckpointError(f"cannot {what} {path!r}: {probe!r} is a file, not a directory. "
                              "Choose a path below a directory.")


def check_target(path: str, overwrite: bool = False) -> None:
    """Refuse, before anything is written, a target that a save would destroy: a file, a
    symbolic link, or a non-empty directory that is not one of our checkpoints (no manifest,
    see [Note: the manifest]) unless `overwrite`."""
    check_parent(path)
    if os.path.islink(path):
        raise CheckpointError(f"cannot save to {path!r}: it is a symbolic link; save to the "
                              f"directory it points to ({os.path.realpath(path)!r}) or to a new "
                              "path. Nothing was changed.")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise CheckpointError(f"cannot save to {path!r}: it is a file, and a checkpoint is a "
                              "directory. Nothing was changed; choose another path (or move "
                              "the file away yourself).")
    entries = sorted(os.listdir(path))
    if not entries or overwrite or manifest.is_ours(path):
        return
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries) - 5} more)"
                                      if len(entries) > 5 else "")
    raise CheckpointError(
        f"cannot save to {path!r}: the directory exists and is not a checkpoint written by "
        f"fsdp-bridge (no {manifest.MANIFEST} file); it holds {shown}. Saving would replace it "
        "and everything in it. Nothing was changed: save to a new path, or pass "
        "overwrite=True to replace it.")


# -- one save of a path at a time ---------------------------------------------------------------


def lock_path(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_SUFFIX}")


@contextlib.contextmanager
def lock(path: str):
    """Hold the save lock of checkpoint `path` (filelock's lock on a hidden sibling file, an
    flock that the kernel releases if the process dies); refuse at once if another save holds
    it, naming the holder written in the file."""
    file = lock_path(path)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    held = filelock.FileLock(file, is_singleton=False, thread_local=False)
    try:
        held.acquire(blocking=False)
    except filelock.Timeout:
        raise CheckpointError(
            f"another save to {path!r} is in progress ({_read_holder(file) or 'holder unknown'}): "
            "two saves of one path would overwrite each other. Wait for it to finish, or save "
            "to another path.") from None
    try:
        with open(file, "w") as handle:
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        yield
    finally:
        # Removed before the release: a save waiting on this file then finds it gone and
        # takes a new one (filelock checks the file it locked is still linked).
        with contextlib.suppress(OSError):
            os.remove(file)
        held.release()


@contextlib.contextmanager
def locked_target(path: str, overwrite: bool = False):
    """Hold `lock(path)` with `path` checked by `check_target` under it. The check must follow
    the lock: another save may be replacing `path` until then, and between its two renames
    `path` is briefly missing, which a check made then would misread (a directory listed a
    moment before, now without a manifest: "not a checkpoint")."""
    check_parent(path)  # before the lock, which creates missing directories for its file
    with lock(path):
        check_target(path, overwrite)
        yield


def _read_holder(file: str) -> str:
    try:
        with open(file, errors="replace") as handle:
            return handle.read(200).strip()
    except OSError:
        return ""


# -- publication and leftovers ------------------------------------------------------------------


def publish(tmp: str, path: str, token: str) -> None:
    """Move the finished directory `tmp` to `path`, replacing what was there (the caller holds
    `lock(path)` and has passed `check_target`), then remove crash leftovers of `path`."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_tree(tmp)
    if os.path.lexists(path):
        old = f"{path}{OLD}{token}"
        os.rename(path, old)
        fsync_dir(parent)
        os.rename(tmp, path)
    else:
        os.rename(tmp, path)
    fsync_dir(parent)
    clean_leftovers(path)


def leftovers(path: str) -> list[str]:
    """`.tmp-<token>` and `.old-<token>` siblings of `path` (our names, exactly)."""
    path = os.path.abspath(path)
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.(tmp|old)-[0-9a-f]{12}$")
    candidates = glob.glob(glob.escape(path) + ".*-*")
    return sorted(c for c in candidates if pattern.match(os.path.basename(c)))


def clean_leftovers(path: str, keep_old: bool = False) -> None:
    """Remove what crashed saves of `path` left (call with `lock(path)` held; `.old-` copies
    too unless `keep_old`: with a complete checkpoint at `path` none is needed for recovery)."""
    for leftover in leftovers(path):
        if keep_old and OLD in os.path.basename(leftover):
            continue
        if os.path.isdir(leftover) and not os.path.islink(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(leftover)


def clean_before_save(path: str) -> None:
    """Under `lock(path)`, before writing: every `.tmp-` sibling is a crashed save's, and so
    is every `.old-` once `path` exists (without `path`, an `.old-` is the previous checkpoint
    and stays until this save has published its own). A run of crashes therefore never leaves
    more than one `.tmp-` and one `.old-`."""
    clean_leftovers(path, keep_old=not os.path.isdir(path))


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def resolve(path: str) -> str:
    """The directory to read for checkpoint `path`: itself, or the previous checkpoint left by
    a save that crashed between its two renames."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    olds = sorted((p for p in leftovers(path) if OLD in os.path.basename(p)),
                  key=os.path.getmtime)
    if olds:
        warnings.warn(f"fsdp_bridge: checkpoint {path} is missing but {olds[-1]} is the "
                      "complete previous checkpoint (a save crashed while replacing it); "
                      "loading that.", stacklevel=3)
        return olds[-1]
    raise FileNotFoundError(f"checkpoint {path!r} does not exist.")
