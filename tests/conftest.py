import os
import sys

import pytest

# Tests import helpers as `tests.world`; make the repository root importable for spawned ranks too.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)


@pytest.fixture
def test_device():
    """The device tests put models and tensors on (tests/world.py: CPU unless
    FSDP_BRIDGE_DEVICE=cuda)."""
    from tests.world import device

    return device()
