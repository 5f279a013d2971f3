"""One phase of the gpu-check: a command in its own process group under a wall-clock timeout
(on timeout the whole group is ended, spawned ranks included, so no rank keeps the GPU), its
output in a bounded log, and the GPU memory in use sampled by nvidia-smi while it runs."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time

LOG_HEAD_BYTES = 2 * 2**20  # a log keeps its first 2 MiB as written...
LOG_TAIL_LINES = 400  # ...and, past them, its last lines (written when the phase ends)
GRACE_S = 10  # between SIGTERM and SIGKILL
DRAIN_S = 3  # for what a command that ended left running to end by itself


class BoundedLog:
    """Lines written to a file until it holds LOG_HEAD_BYTES; past that only the last
    LOG_TAIL_LINES are kept, and appended by `close` after a line counting the dropped ones."""

    def __init__(self, path: str):
        self.handle = open(path, "w", errors="replace")
        self.written = 0
        self.tail: collections.deque = collections.deque(maxlen=LOG_TAIL_LINES)
        self.dropped = 0
        self.lock = threading.Lock()  # the reader thread writes; the phase's end closes

    def write(self, line: str) -> None:
        with self.lock:
            if not self.handle.closed:
                self._keep(line)

    def _keep(self, line: str) -> None:
        if self.written < LOG_HEAD_BYTES:
            self.handle.write(line)
            self.handle.flush()
            self.written += len(line)
            return
        if len(self.tail) == self.tail.maxlen:
            self.dropped += 1
        self.tail.append(line)

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.tail:
            self.handle.write(f"\n[gpu-check: {self.dropped} lines left out here; the log keeps "
                              f"its first {LOG_HEAD_BYTES} bytes and its last {LOG_TAIL_LINES} "
                              "lines]\n")
            self.handle.writelines(self.tail)
        self.handle.close()


class MemorySampler:
    """The most GPU memory in use on any GPU (MiB, every process counted), sampled each second
    by `nvidia-smi` while a phase runs; None where nvidia-smi does not run."""

    def __init__(self):
        self.peak = None
        try:
            self.process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-lms", "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.process = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak or 0, int(line.strip()))

    def stop(self):
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.thread.join(timeout=5)
        return self.peak


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reaps the leader once it has ended (a zombie still counts in its group)
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group(process: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` for the group to empty; whether it did."""
    deadline = time.monotonic() + seconds
    while _group_alive(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the command's process group, SIGKILL after GRACE_S to what is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        if _wait_group(process, GRACE_S):
            return


def run_phase(argv: list[str], env: dict, log_path: str, timeout_s: float, cwd: str) -> dict:
    """Run `argv`; its status ("passed", "failed" or "timeout"), exit code, seconds, and the
    peak GPU memory seen. Output (stdout and stderr together) goes to a BoundedLog."""
    log = BoundedLog(log_path)
    sampler = MemorySampler()
    start = time.monotonic()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace",
                               start_new_session=True)
    reader = threading.Thread(target=lambda: [log.write(line) for line in process.stdout],
                              daemon=True)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on Ctrl-C: no rank of ours is left holding the GPU
        # A command that ended may leave processes (a rank, a helper) that end by themselves
        # a moment later; those still there after DRAIN_S are ended and reported.
        leftovers = process.poll() is not None and not _wait_group(process, DRAIN_S)
        _end_group(process)
        reader.join(timeout=GRACE_S)
        peak = sampler.stop()
        if timed_out:
            log.write(f"\n[gpu-check: stopped at the phase's timeout of {timeout_s:.0f} s]\n")
        if leftovers:
            log.write("\n[gpu-check: the command ended, leaving processes of its group running: "
                      "ended them]\n")
        log.close()
    status = "timeout" if timed_out else ("passed" if process.returncode == 0 else "failed")
    return {"status": status, "exit_code": process.returncode,
            "duration_s": round(time.monotonic() - start, 1), "peak_gpu_memory_mib": peak,
            "left_processes_running": leftovers}
