"""The spawner reports how a world failed: a rank killed by a signal is named with the signal,
and (faulthandler) the Python stack it died in reaches stderr, so a crash inside a native
library still says where it happened."""

from __future__ import annotations

import pytest

from fsdp_bridge.harness.world import WorldFailed, spawn


def _segfault_on_rank_1(rank, world_size):
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return rank


def test_a_rank_killed_by_a_signal_is_named_with_its_python_stack(capfd):
    with pytest.raises(WorldFailed) as failed:
        spawn(_segfault_on_rank_1, 2)
    assert "process 1 terminated with signal SIGSEGV" in str(failed.value)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err
    assert "in _segfault_on_rank_1" in err, err[-3000:]
