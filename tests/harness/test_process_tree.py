"""Stopping a command's process tree (psutil): a grandchild in a session of its own, as
torchrun starts its ranks, is stopped with the command; a process gone before the signal is
skipped."""

from __future__ import annotations

import subprocess
import time

import psutil

from fsdp_bridge.harness import processes


def test_a_grandchild_in_its_own_session_is_stopped_with_the_command():
    command = subprocess.Popen(["sh", "-c", "setsid sleep 120 & sleep 120"], process_group=0)
    deadline = time.monotonic() + 30
    while len(processes.descendants(command.pid)) < 2:
        assert time.monotonic() < deadline, "the tree never started"
        time.sleep(0.05)
    tree = processes.descendants(command.pid)
    assert all(isinstance(process, psutil.Process) for process in tree.values())
    assert {process.name() for process in tree.values()} == {"sleep"}
    processes.stop_tree(command, grace=1.0)
    time.sleep(0.2)
    assert command.returncode is not None
    assert not any(processes._alive(process) for process in tree.values())


def test_a_process_gone_before_the_signal_is_skipped():
    done = subprocess.Popen(["true"])
    gone = {done.pid: psutil.Process(done.pid)}
    done.wait()
    processes._signal(gone, 9)  # no error, nothing signalled
    assert not processes._alive(gone[done.pid])
    assert processes.descendants(done.pid) == {}
