import os
import signal
import sys

import pytest

# Tests import helpers as `tests.world`; make the repository root importable for spawned ranks too.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)

# A shell starts background jobs (`make test &`) with SIGINT ignored, and an ignored signal stays
# ignored across exec: the command-line processes the Ctrl-C tests start would then never see
# their SIGINT. A handler (reset to the default in each child) gives them the terminal's.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def test_device():
    """The device tests put models and tensors on (tests/world.py: CPU unless
    FSDP_BRIDGE_DEVICE=cuda)."""
    from tests.world import device

    return device()
