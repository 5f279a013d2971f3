"""run_torchrun reruns a command when it ends in torch's gloo teardown abort, and only then."""

import sys

from fsdp_bridge.harness.teardown import TEARDOWN_ABORT
from fsdp_bridge.harness.torchrun import ATTEMPTS, run_torchrun

FLAKY = f"""
import os, sys
marker = sys.argv[1]
print("step 1 loss 1.0")
if not os.path.exists(marker):
    open(marker, "w").close()
    print({TEARDOWN_ABORT!r}, flush=True)
    sys.exit(134)
"""


def test_teardown_abort_is_retried_once(tmp_path):
    marker, cleared = tmp_path / "marker", []
    code, output, retried = run_torchrun(
        [sys.executable, "-c", FLAKY, str(marker)], {}, timeout=60,
        before_retry=lambda: cleared.append(True),
    )
    assert (code, retried, cleared) == (0, True, [True])
    assert TEARDOWN_ABORT not in output and "step 1 loss" in output


def test_other_failures_are_not_retried(tmp_path):
    code, output, retried = run_torchrun(
        [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], {}, timeout=60
    )
    assert (code, retried) == (3, False) and "boom" in output


def test_retries_stop_after_the_last_attempt(tmp_path):
    always = f"import sys; print({TEARDOWN_ABORT!r}, flush=True); sys.exit(134)"
    cleared = []
    code, output, retried = run_torchrun([sys.executable, "-c", always], {}, timeout=60,
                                         before_retry=lambda: cleared.append(True))
    assert (code, retried, len(cleared)) == (134, True, ATTEMPTS - 1)
