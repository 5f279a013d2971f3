"""A full disk and a read-only destination under the checkpoint writers and a command's output
file (scripts/file_system_faults.py, one child process): each fails in one line that names the
path and what to do, and the previous checkpoint, the user's files beside it and the files
converted before all load as they were. The disk is a 1 MiB tmpfs mounted in a mount namespace
of the child's own (`unshare -rm`); where that is not possible, a file-size limit stands for
the full disk and a directory without write permission for the read-only one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                      "file_system_faults.py")
WRITERS = ("save", "to_dcp", "to_torch", "output")


def _run(mode: str, directory) -> subprocess.CompletedProcess:
    command = [sys.executable, SCRIPT, mode, str(directory)]
    if mode == "tmpfs":
        command = ["unshare", "-rm", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    if shutil.which("unshare"):
        done = _run("tmpfs", tmp_path_factory.mktemp("tmpfs") / "disk")
        if done.returncode == 0:
            return json.loads(done.stdout)
        # 3: the tmpfs was not mounted; else unshare itself was refused (no user namespaces)
    done = _run("limits", tmp_path_factory.mktemp("limits") / "disk")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _one_line_naming_the_path(case: dict, words: tuple) -> None:
    message = case["message"].strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert any(word in message for word in words), message
    assert "/disk/" in message, message  # the path written
    assert case.get("code", 2) == 2, case


def _previous_state_kept(after: dict) -> None:
    assert after == {"save_loads": True, "dcp_loads": True, "torch_loads": True,
                     "user_files_intact": True, "leftovers": []}, after


def test_a_full_disk_fails_each_writer_in_one_line_and_keeps_the_previous_state(faults):
    full = faults["disk_full"]
    for writer in WRITERS:
        _one_line_naming_the_path(full[writer], ("disk is full", "file-size limit"))
    if faults["mode"] == "tmpfs":  # DCP's CheckpointException, said in one line
        assert "0.0 MiB free" in full["to_dcp"]["message"], full["to_dcp"]
    _previous_state_kept(full["after"])


def test_a_read_only_destination_fails_each_writer_in_one_line_and_keeps_the_previous_state(
        faults):
    if "read_only" not in faults:
        pytest.skip("no mount namespace here, and root writes through directory permissions")
    read_only = faults["read_only"]
    for writer in WRITERS:
        _one_line_naming_the_path(read_only[writer], ("read-only", "not writable",
                                                      "permission denied"))
    if faults["mode"] == "tmpfs":  # the lock file, taken before anything else
        assert "its lock file" in read_only["to_dcp"]["message"], read_only["to_dcp"]
    _previous_state_kept(read_only["after"])
