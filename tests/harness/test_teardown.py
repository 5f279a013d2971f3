"""leave_world ends a rank without interpreter finalization; settle_at_exit adds the exit pause."""

import atexit
import subprocess
import sys

from fsdp_bridge.harness import teardown

CHILD = """
import atexit, sys, tempfile
import torch.distributed as dist
from fsdp_bridge.harness.teardown import leave_world
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
atexit.register(print, "finalization ran")
print("work done", end="")  # no newline: only an explicit flush gets it out
leave_world(3)
"""


def test_leave_world_flushes_and_skips_finalization():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "work done"  # flushed, and the atexit handler never ran


def test_settle_at_exit_registers_one_exit_handler():
    before = atexit._ncallbacks()
    teardown.settle_at_exit()
    try:
        assert atexit._ncallbacks() == before + 1
    finally:
        atexit.unregister(teardown.time.sleep)
