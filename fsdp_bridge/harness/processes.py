"""Commands the harness starts, and how it stops all of their processes.

[Note: stopping a process tree]
`torchrun` starts each rank with `start_new_session=True`, so killing torchrun alone (what
`subprocess.run(timeout=...)` does) leaves the ranks running, adopted by PID 1, and signalling
torchrun's process group does not reach them either. So on a timeout or an interrupt (Ctrl-C)
we first list every descendant of the command from /proc (while the parent links still exist),
send SIGTERM to the command's process group and to each descendant (torchrun also forwards it to
its workers), wait a few seconds, then SIGKILL whatever is left. A descendant is identified by
pid *and* start time, so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

GRACE_SECONDS = 3.0


def _stat(pid: int) -> Optional[tuple[int, str, int]]:
    """(parent pid, state, start time) of `pid` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                info = _stat(int(name))
                if info is not None and info[1] != "Z":
                    children.setdefault(info[0], []).append(int(name))
                    starts[int(name)] = info[2]
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found[child] = starts[child]
                stack.append(child)
    return found


def _alive(pid: int, start: int) -> bool:
    info = _stat(pid)
    return info is not None and info[1] != "Z" and info[2] == start


def _signal(tree: dict[int, int], sig: int) -> None:
    for pid, start in tree.items():
        if _alive(pid, start):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def stop_tree(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Stop `proc` (the leader of its own process group) and every process below it; see
    [Note: stopping a process tree]."""
    tree = descendants(proc.pid)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    _signal(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p, s) for p, s in tree.items()):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        tree.update(descendants(proc.pid))
    for pid in list(tree):
        tree.update(descendants(pid))
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    _signal(tree, signal.SIGKILL)
    proc.wait()


def run(command: Sequence[str], env: Optional[dict], timeout: float) -> tuple[int, str]:
    """Run `command` in its own process group; (exit code, stdout+stderr). On a timeout
    (`subprocess.TimeoutExpired`, with the output so far) or an interrupt, every process it
    started is stopped before the exception propagates."""
    # A group of its own (same session): signalling it never reaches this process.
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **group)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        stop_tree(proc)
        rest, _ = proc.communicate()
        exc.output = (exc.output or b"").decode(errors="replace") if isinstance(
            exc.output, bytes) else (exc.output or "")
        exc.output += rest or ""
        raise
    except BaseException:
        stop_tree(proc)
        proc.communicate()
        raise
    return proc.returncode, output
