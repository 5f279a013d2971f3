"""What `save` checks before it writes anything, and how it explains a failure while writing.

Before: the state dict holds only values DCP can store (tensors, or objects that pickle: a
lambda does not), and no two of its keys become the same name once nested keys are joined with
"." (`{"a.b": x, "a": {"b": y}}`, `{1: x, "1": y}`), which would keep one value of the two.
After: an error raised deep inside DCP or torch.save (a CheckpointException dump, "enforce fail
at inline_container.cc") is turned into one that says what happened and that the previous
checkpoint is unchanged.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from typing import Any, Iterator, Optional

import torch

from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.outputs import is_file_system_error, os_error_line

_PLAIN = (int, float, str, bytes, bool, type(None))
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
# torch.save's zip writer reports a failed write without its errno.
_FULL_WORDS = ("file write failed", "No space left", "File too large", "Disk quota")


def _show(parts: tuple) -> str:
    return "state_dict" + "".join(f"[{part!r}]" for part in parts)


def leaves(value: Any, parts: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(key path, value) of every non-container value, through dicts, lists and tuples."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, parts + (key,))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from leaves(item, parts + (index,))
    else:
        yield parts, value


def unsaveable(state_dict: dict) -> Optional[str]:
    """Why `state_dict` cannot be saved (a value that does not pickle), or None."""
    for parts, value in leaves(state_dict):
        if isinstance(value, (torch.Tensor,) + _PLAIN):
            continue
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            kind = getattr(value, "__qualname__", None) or type(value).__name__
            return (f"{_show(parts)} is a {type(value).__name__} ({kind}) that cannot be "
                    f"saved: values that are not tensors are pickled, and this one does not "
                    f"pickle ({type(exc).__name__}: {exc}). Store plain data instead (numbers, "
                    "strings, tensors; for a function, its name).")
    return None


def key_collisions(state_dict: dict) -> list[str]:
    """Groups of keys that become the same name once nested dict keys are joined with "."."""
    names: dict[str, list[tuple]] = {}

    def visit(value: Any, parts: tuple) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                visit(item, parts + (key,))
        else:
            names.setdefault(".".join(map(str, parts)), []).append(parts)

    for key, item in state_dict.items():
        visit(item, (key,))
    return [f"{' and '.join(_show(p) for p in group)} become {name!r}"
            for name, group in names.items() if len(group) > 1]


def check_collisions(state_dict: dict, where: str) -> None:
    problems = key_collisions(state_dict)
    if problems:
        raise CheckpointError(
            f"{where}: keys collide: {'; '.join(problems[:4])}. A checkpoint stores one value "
            "per flattened name, so one of them would be lost. Rename the keys so that every "
            "name is unique.")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures of a CheckpointException."""
    seen, stack = set(), [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)


def is_disk_full(exc: BaseException) -> bool:
    for cause in _causes(exc):
        if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS:
            return True
        if any(words in str(cause) for words in _FULL_WORDS):
            return True
    return False


def _free_space(path: str) -> str:
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    try:
        return f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free on its file system"
    except OSError:  # pragma: no cover
        return "free space unknown"


def explain(exc: BaseException, path: str) -> BaseException:
    """A clear error for a save of `path` that failed with `exc` (returned, not raised);
    interrupts (KeyboardInterrupt, SystemExit) are returned unchanged."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, (Exception, CheckpointException)):
        return exc
    if isinstance(exc, CheckpointError):
        return exc
    if is_disk_full(exc):
        error = CheckpointError(
            f"could not write checkpoint {path!r}: the disk is full or a file-size limit "
            f"(ulimit -f, a quota) was reached ({_free_space(path)}). Nothing was published: "
            f"{path!r} is as it was before this save. Free some space and save again.")
    elif any(is_file_system_error(cause) for cause in _causes(exc)):
        cause = next(c for c in _causes(exc) if is_file_system_error(c))
        where = f"{cause.filename}: " if getattr(cause, "filename", None) else ""
        error = CheckpointError(
            f"could not write checkpoint {path!r}: {where}{os_error_line(cause)}. Nothing was "
            f"published: {path!r} is as it was before this save.")
    else:
        inner = [c for c in _causes(exc) if c is not exc and isinstance(c, Exception)]
        detail = inner[0] if inner else exc
        error = CheckpointError(
            f"could not write checkpoint {path!r}: {type(detail).__name__}: "
            f"{str(detail).strip().splitlines()[-1] if str(detail).strip() else ''}. Nothing "
            f"was published: {path!r} is as it was before this save.")
    error.__cause__ = exc
    return error
