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

The new directory also gets every entry of `<path>` that the writer does not own (the user's
files, as hard links), and the `.old-` directory is taken apart rather than removed: see
[Note: a writer owns only what it wrote] (`ownership`).

Every save of `<path>` holds `lock(<path>)` (filelock) from its checks to its clean-up, so no
other save of the same path runs meanwhile; a second one is refused with the holder's pid. Under the lock,
any `.tmp-`/`.old-` sibling of `<path>` is a leftover of a crashed save: the next save removes
them before it writes (`clean_before_save`, keeping an `.old-` that is the only copy) and again
once its own checkpoint is in place (`clean_leftovers`). A `.tmp-` holds the writer's files and
links to the user's, so it is removed whole; an `.old-` is taken apart like any replaced
directory, its user files moved back into `<path>`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import warnings
from typing import Optional

import filelock

from fsdp_bridge.checkpoint import manifest, ownership
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.outputs import fsync_dir, fsync_file, os_error_line

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


def check_target(path: str, overwrite: bool = False, kind: str = "dcp") -> None:
    """Refuse, before anything is written, a target a writer of `kind` must not replace: a
    file, a symbolic link, a mount point, the working directory (or one holding it), or a
    non-empty directory that is not one of our checkpoints (no manifest, see [Note: the
    manifest]) unless `overwrite`. A `save_pretrained` directory is shared with tokenizers and
    model cards, so there only model files fsdp-bridge did not write need `overwrite`. Whatever
    passes, only the writer's own files are replaced (see [Note: a writer owns only what it
    wrote])."""
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
    check_replaceable(path)
    entries = sorted(os.listdir(path))
    if not entries or overwrite or manifest.is_ours(path):
        return
    if kind == "save_pretrained":
        models = [name for name in entries if ownership.known(kind, name)]
        if models:
            raise CheckpointError(
                f"cannot save to {path!r}: it holds model files fsdp-bridge did not write "
                f"({_shown(models)}), which saving would replace. Nothing was changed: save "
                "to a new path, or pass overwrite=True to replace them (the directory's other "
                "files, such as a tokenizer or a README, are kept).")
        return
    raise CheckpointError(
        f"cannot save to {path!r}: the directory exists and is not a checkpoint written by "
        f"fsdp-bridge (no {manifest.MANIFEST} file); it holds {_shown(entries)}. Nothing was "
        "changed: save to a new path, or pass overwrite=True to write the checkpoint into it "
        f"(it replaces only files named as its own, {ownership.DESCRIBED[kind]}, and keeps "
        "the rest).")


def check_replaceable(path: str) -> None:
    """A directory is replaced by renaming a new one into place: refuse one that cannot be
    (a mount point) or must not be (the working directory, or one holding it)."""
    if os.path.ismount(path):
        raise CheckpointError(f"cannot replace {path!r}: it is a mount point, and a checkpoint "
                              "is replaced by renaming a new directory into place. Nothing was "
                              "changed; write to a directory inside it.")
    here = os.getcwd()
    if here == path or here.startswith(path.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"cannot replace {path!r}: it is (or holds) the working "
                              "directory, which a replacement would leave pointing at the "
                              "removed copy. Nothing was changed; change directory first, or "
                              "write to another path.")


def _shown(entries: list) -> str:
    return ", ".join(entries[:5]) + (f", ... ({len(entries) - 5} more)"
                                     if len(entries) > 5 else "")


# -- one save of a path at a time ---------------------------------------------------------------


def lock_path(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_SUFFIX}")


@contextlib.contextmanager
def lock(path: str):
    """Hold the save lock of checkpoint `path` (filelock's lock on a hidden sibling file, an
    flock that the kernel releases if the process dies); refuse at once if another save holds
    it, naming the holder written in the file. A lock that cannot be taken (a read-only file
    system, no permission, a full disk) is a CheckpointError naming the path."""
    file = lock_path(path)
    held = filelock.FileLock(file, is_singleton=False, thread_local=False)
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        held.acquire(blocking=False)
    except filelock.Timeout:
        raise CheckpointError(
            f"another save to {path!r} is in progress ({_read_holder(file) or 'holder unknown'}): "
            "two saves of one path would overwrite each other. Wait for it to finish, or save "
            "to another path.") from None
    except OSError as exc:
        raise _lock_error(path, file, exc) from None
    try:
        try:
            with open(file, "w") as handle:
                handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        except OSError as exc:
            raise _lock_error(path, file, exc) from None
        yield
    finally:
        # Removed before the release: a save waiting on this file then finds it gone and
        # takes a new one (filelock checks the file it locked is still linked).
        with contextlib.suppress(OSError):
            os.remove(file)
        held.release()


def _lock_error(path: str, file: str, exc: OSError) -> CheckpointError:
    return CheckpointError(f"cannot write {path!r}: its lock file {file!r} cannot be created: "
                           f"{os_error_line(exc)}. Nothing was changed.")


@contextlib.contextmanager
def locked_target(path: str, overwrite: bool = False, kind: str = "dcp"):
    """Hold `lock(path)` with `path` checked by `check_target` under it. The check must follow
    the lock: another save may be replacing `path` until then, and between its two renames
    `path` is briefly missing, which a check made then would misread (a directory listed a
    moment before, now without a manifest: "not a checkpoint")."""
    check_parent(path)  # before the lock, which creates missing directories for its file
    with lock(path):
        check_target(path, overwrite, kind)
        yield


def _read_holder(file: str) -> str:
    try:
        with open(file, errors="replace") as handle:
            return handle.read(200).strip()
    except OSError:
        return ""


# -- publication and leftovers ------------------------------------------------------------------


def publish(tmp: str, path: str, token: str, kind: str) -> None:
    """Move the finished directory `tmp` (a writer of `kind`'s files) to `path`, replacing what
    was there (the caller holds `lock(path)` and has passed `check_target`) but keeping its
    user's files (carried into `tmp` first), then remove crash leftovers of `path`."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_tree(tmp)
    if os.path.lexists(path):
        owns = ownership.owner(kind, [path], written=manifest.data_files(tmp))
        ownership.carry(path, tmp, owns)
        for directory, _, _ in os.walk(tmp):
            fsync_dir(directory)
        old = f"{path}{OLD}{token}"
        os.rename(path, old)
        fsync_dir(parent)
        os.rename(tmp, path)
        fsync_dir(parent)
        ownership.dismantle(old, path, owns)
    else:
        os.rename(tmp, path)
        fsync_dir(parent)
    clean_leftovers(path, kind)


def leftovers(path: str) -> list[str]:
    """`.tmp-<token>` and `.old-<token>` siblings of `path` (our names, exactly)."""
    path = os.path.abspath(path)
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.(tmp|old)-[0-9a-f]{12}$")
    candidates = glob.glob(glob.escape(path) + ".*-*")
    return sorted(c for c in candidates if pattern.match(os.path.basename(c)))


def clean_leftovers(path: str, kind: Optional[str] = None, keep_old: bool = False) -> None:
    """Remove what crashed saves of `path` left (call with `lock(path)` held; `.old-` copies
    too unless `keep_old`: with a complete checkpoint at `path` none is needed for recovery).
    An `.old-` directory is taken apart: the files a writer of `kind` (default: the kind its
    manifest names) owns go, the user's are moved back into `path`."""
    for leftover in leftovers(path):
        is_old = OLD in os.path.basename(leftover)
        if keep_old and is_old:
            continue
        if not os.path.isdir(leftover) or os.path.islink(leftover):
            with contextlib.suppress(OSError):
                os.remove(leftover)
        elif is_old:
            owns = ownership.owner(kind or ownership.kind_of(leftover) or "", [leftover],
                                   written=ownership.listed(path))
            ownership.dismantle(leftover, path, owns)
        else:  # the writer's files and links to the user's (see [Note: atomic checkpoints])
            shutil.rmtree(leftover, ignore_errors=True)


def clean_before_save(path: str, kind: str) -> None:
    """Under `lock(path)`, before writing: every `.tmp-` sibling is a crashed save's, and so
    is every `.old-` once `path` exists (without `path`, an `.old-` is the previous checkpoint
    and stays until this save has published its own). A run of crashes therefore never leaves
    more than one `.tmp-` and one `.old-`."""
    clean_leftovers(path, kind, keep_old=not os.path.isdir(path))


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
