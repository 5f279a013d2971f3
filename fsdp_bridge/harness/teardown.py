"""Leaving a torch.distributed process without hitting torch's gloo exit race.

[Note: gloo teardown abort]
With torch 2.13 on CPU + gloo, a process that finished its work and called
`destroy_process_group()` sometimes aborts while the interpreter shuts down ("terminate called
without an active exception", SIGABRT; about 1 run in 7 of a 2-rank FSDP2 script on this 2-core
machine). A core dump shows why: a gloo worker thread is still releasing the last collective's
`AsyncWork` after `wait()` returned; its saved `ThreadLocalState` holds a Python object, the
decref needs the GIL, the finalizing interpreter makes the thread exit, and the exit unwinds
through a `noexcept` destructor. It is torch's race (pytorch/pytorch#190489), not the script's:
every line was printed and every file written before it.

- Processes fsdp-bridge owns (spawned ranks, our scripts) end with `leave_world()`: destroy the
  group and leave with `os._exit`, skipping the finalization the race needs.
- User scripts run by `compare-scripts` are not ours to end early: the injected site hook adds a
  short pause at exit (`settle_at_exit`) that lets the worker threads finish (0 aborts in 30
  runs), and `run_torchrun` still runs a command again if it ends in the abort.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import NoReturn

TEARDOWN_ABORT = "terminate called without an active exception"

# Long enough for a gloo worker to drop a finished work; short beside any training run.
SETTLE_SECONDS = 0.2


def leave_world(exit_code: int = 0) -> NoReturn:
    """Destroy the default process group (if any), flush, and exit without finalization.
    Only for processes whose results are already written (files, pipes flushed here)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def settle_at_exit() -> None:
    """Pause briefly at interpreter exit so gloo's worker threads go idle first."""
    atexit.register(time.sleep, SETTLE_SECONDS)
