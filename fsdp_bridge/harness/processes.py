"""Commands the harness starts, and how it stops all of their processes.

[Note: stopping a process tree]
`torchrun` starts each rank with `start_new_session=True`, so killing torchrun alone (what
`subprocess.run(timeout=...)` does) leaves the ranks running, adopted by PID 1, and signalling
torchrun's process group does not reach them either. So on a timeout or an interrupt (Ctrl-C)
we first list every descendant of the command with psutil (while the parent links still exist),
send SIGTERM to the command's process group and to each descendant (torchrun also forwards it to
its workers), wait a few seconds, then SIGKILL whatever is left. psutil identifies a descendant
by pid *and* start time, so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

import psutil

GRACE_SECONDS = 3.0


def descendants(root: int) -> dict[int, psutil.Process]:
    """{pid: process} of every live descendant of `root`. A psutil.Process remembers its start
    time, so signalling it later never reaches another process that reused the pid."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:  # gone already
        return {}
    return {child.pid: child for child in children}


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(tree: dict[int, psutil.Process], sig: int) -> None:
    for process in tree.values():
        with contextlib.suppress(psutil.Error):  # gone, or its pid taken by another process
            process.send_signal(sig)


def stop_tree(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Stop `proc` (the leader of its own process group) and every process below it; see
    [Note: stopping a process tree]."""
    tree = descendants(proc.pid)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    _signal(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in tree.values()):
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
