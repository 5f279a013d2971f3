"""Running a script under torchrun, with retries for torch's gloo teardown abort
(see [Note: gloo teardown abort] in `fsdp_bridge/harness/teardown.py`): its only effect is the
exit status, after every line was printed, so a run that ends this way is run again (up to
ATTEMPTS runs in all) rather than reported as a failed script."""

from __future__ import annotations

import logging
import shlex
import time
from typing import Callable, Optional, Sequence

from fsdp_bridge.harness import processes
from fsdp_bridge.harness.teardown import TEARDOWN_ABORT

# The abort hits about 1 two-rank run in 7 without the exit pause, so three runs in a row
# ending in it is about 1 in 350; a real failure (other output) is never rerun.
ATTEMPTS = 3
logger = logging.getLogger(__name__)


def run_torchrun(command: Sequence[str], env: dict, timeout: float,
                 before_retry: Optional[Callable[[], None]] = None) -> tuple[int, str, bool]:
    """Run `command`; returns (exit code, stdout+stderr, whether it was retried).
    `before_retry` clears what the first attempt left behind (e.g. recorded digests).
    On a timeout (`subprocess.TimeoutExpired`) or Ctrl-C, torchrun and every rank it started
    are stopped first (see [Note: stopping a process tree] in processes.py)."""
    for attempt in range(ATTEMPTS):
        if attempt and before_retry is not None:
            before_retry()
        logger.info("running %s%s", shlex.join(command),
                    f" (attempt {attempt + 1} of {ATTEMPTS})" if attempt else "")
        logger.debug("with PYTHONPATH=%s", env.get("PYTHONPATH", ""))
        started = time.perf_counter()
        returncode, output = processes.run(command, env, timeout)
        logger.info("exit %d after %.1f s", returncode, time.perf_counter() - started)
        if returncode == 0 or TEARDOWN_ABORT not in output:
            return returncode, output, attempt > 0
        logger.info("torch's gloo teardown abort after every line was printed: running again")
    return returncode, output, True
