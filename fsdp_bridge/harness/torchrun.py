"""Running a script under torchrun, with one retry for torch's gloo teardown abort.

[Note: gloo teardown abort]
With torch 2.13 on CPU + gloo, a process that has finished its work and called
`destroy_process_group()` sometimes aborts while exiting ("terminate called without an active
exception", SIGABRT). It is torch's, not the script's: native FSDP2 training scripts hit it too
(5 of 15 runs on a loaded 2-core machine; 1 of 15 with a barrier before the destroy). Its only
effect is the exit status, after every line was printed; so a run that ends this way is run
once more rather than reported as a failed script.
"""

from __future__ import annotations

import subprocess
from typing import Callable, Optional, Sequence

TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(command: Sequence[str], env: dict, timeout: float,
                 before_retry: Optional[Callable[[], None]] = None) -> tuple[int, str, bool]:
    """Run `command`; returns (exit code, stdout+stderr, whether it was retried).
    `before_retry` clears what the first attempt left behind (e.g. recorded digests)."""
    for attempt in range(2):
        if attempt and before_retry is not None:
            before_retry()
        done = subprocess.run(list(command), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if done.returncode == 0 or TEARDOWN_ABORT not in done.stdout:
            return done.returncode, done.stdout, attempt > 0
    return done.returncode, done.stdout, True
