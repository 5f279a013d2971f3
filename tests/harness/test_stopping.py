"""No process outlives the harness: a run that hangs (rank 1 never reaches a collective) is
stopped at `--timeout`, and Ctrl-C (SIGINT) stops `compare-scripts` and `compare`, with
torchrun, every rank and the spawned world gone afterwards.

Each command runs in a new session; afterwards `pgrep -s <its session>` must be empty. torchrun
starts its ranks in sessions of their own, so those are also looked up by a tag on their
command line (`pgrep -f`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from tests.checkpoint import user_files

HERE = os.path.dirname(os.path.abspath(__file__))
HANG = os.path.join(HERE, "scripts", "hang_rank1.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _pgrep(*args) -> list[int]:
    done = subprocess.run(["pgrep", *args], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead child that its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def _survivors(session: int, tag: str, grace: float = 5.0) -> list[int]:
    """Processes of the session (or tagged) still running once `grace` seconds have passed: a
    rank killed as the command returns may still be tearing down its memory (its command line
    already empty) for a moment on a loaded machine."""
    deadline = time.monotonic() + grace
    while True:
        found = set(_pgrep("-s", str(session)))
        if tag:
            found |= set(_pgrep("-f", tag))
        left = sorted(pid for pid in found if _running(pid))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"


def _stopped_within(cli: subprocess.Popen, seconds: float) -> str:
    """The command's stderr once it exits after Ctrl-C; if it does not within `seconds`, fail
    with what its process shows (signal masks, where it waits), to tell a lost signal from a
    slow stop."""
    try:
        return cli.communicate(timeout=seconds)[1]
    except subprocess.TimeoutExpired:
        try:
            with open(f"/proc/{cli.pid}/status") as handle:
                state = [line.strip() for line in handle if line.startswith(("State", "Sig", "Shd"))]
            with open(f"/proc/{cli.pid}/wchan") as handle:
                state.append(f"wchan: {handle.read()}")
        except OSError as error:
            state = [f"no /proc entry: {error}"]
        raise AssertionError(f"still running {seconds} s after SIGINT: {state}") from None


def _kill_survivors(pids) -> None:
    """Leave the machine clean even when the assertion fails (only our own pids)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start(argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fsdp_bridge", *argv], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(condition, timeout: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "timed out waiting"
        time.sleep(0.2)
    return time.monotonic() - started


def _hang_run(tmp_path, name, timeout):
    markers = tmp_path / name
    markers.mkdir()
    tag = f"fsdp-bridge-test-{uuid.uuid4().hex}"
    cli = _start(["compare-scripts", HANG, HANG, "--nproc", "2", "--no-determinism-check",
                  "--timeout", str(timeout), "--", "--markers", str(markers), "--tag", tag])
    return cli, markers, tag


def test_ctrl_c_and_timeout_stop_torchrun_and_every_rank(tmp_path):
    before = user_files.make(tmp_path / "outputs")
    # Ctrl-C once both ranks are running (rank 0 in a collective, rank 1 asleep).
    cli, markers, tag = _hang_run(tmp_path, "interrupt", 600)
    try:
        startup = _wait_for(lambda: len(os.listdir(markers)) == 2, 300)
        assert len(_pgrep("-f", tag)) >= 3  # torchrun and two ranks carry the tag
        cli.send_signal(signal.SIGINT)
        err = _stopped_within(cli, 60)
    finally:
        left = _survivors(cli.pid, tag)
        _kill_survivors(left)
    assert cli.returncode == 130, err
    assert "interrupted; torchrun and every rank it started were stopped" in err
    assert left == [], [_command(pid) for pid in left]
    # A timeout long enough for the ranks to start (measured above), then a hang.
    cli, markers, tag = _hang_run(tmp_path, "timeout", round(1.5 * startup + 5))
    try:
        out, err = cli.communicate(timeout=600)
    finally:
        left = _survivors(cli.pid, tag)
        _kill_survivors(left)
    assert cli.returncode == 2, out + err
    assert len(os.listdir(markers)) == 2, "the ranks should have been running"
    assert "did not finish within --timeout" in err and "were stopped" in err
    assert "the other scripts were not run" in out
    assert left == [], [_command(pid) for pid in left]
    assert user_files.unchanged(tmp_path / "outputs", before)


def test_ctrl_c_stops_the_spawned_world_of_compare(tmp_path):
    before = user_files.make(tmp_path / "outputs")
    cli = _start(["compare", "--recipe", "mlp", "--steps", "100000", "--backends",
                  "reference,torch-fsdp2", "--nproc", "2"])
    try:
        # The command, its two ranks (and multiprocessing's resource tracker).
        _wait_for(lambda: len(_pgrep("-s", str(cli.pid))) >= 3 or cli.poll() is not None, 300)
        assert cli.poll() is None, cli.communicate()
        time.sleep(2)  # into training
        cli.send_signal(signal.SIGINT)
        err = _stopped_within(cli, 60)
    finally:
        left = _survivors(cli.pid, "")
        _kill_survivors(left)
    assert cli.returncode == 130, err[-2000:]
    assert "interrupted; every rank it started was stopped" in err
    assert left == [], [_command(pid) for pid in left]
    assert user_files.unchanged(tmp_path / "outputs", before)
