"""Fault injection for `checkpoint.save`: a forked saver is killed with SIGKILL at random points,
ROUNDS times, then one save runs into a small file-size limit (a full disk); after each, the
checkpoint is loaded and compared bit for bit with what was saved. Prints one JSON object.

    python fault_save.py DIRECTORY ROUNDS SEED

Forked children (not new interpreters) keep each round to a fraction of a second; this process
runs no parallel torch code before forking (one thread).
"""

import json
import os
import random
import resource
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fsdp_bridge import checkpoint  # noqa: E402
from fsdp_bridge.checkpoint import atomic  # noqa: E402

ELEMENTS = 1 << 18  # 1 MiB of fp32 per checkpoint


def state(i: int) -> dict:
    generator = torch.Generator().manual_seed(i)
    return {"w": torch.randn(ELEMENTS, generator=generator), "b": torch.full((7,), float(i)),
            "step": i}


def load(path: str) -> tuple[int, bool]:
    """(step, bit-exact) of the checkpoint at `path`."""
    loaded = {"w": torch.empty(ELEMENTS), "b": torch.empty(7), "step": -1}
    checkpoint.load(loaded, path)
    expected = state(loaded["step"])
    exact = all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
    return loaded["step"], exact


def _read_all(fd: int) -> list[int]:
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return [int(x) for x in b"".join(chunks).split()]


def _saver(path: str, start: int, fd: int) -> None:
    step = start
    while True:
        checkpoint.save(state(step), path)
        os.write(fd, f"{step}\n".encode())
        step += 1


def kill_round(path: str, last: int, delay: float) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the saver
        os.close(read_fd)
        try:
            _saver(path, last + 1, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    completed = _read_all(read_fd)
    newest = completed[-1] if completed else last
    leftovers = atomic.leftovers(path)
    step, exact = load(path)
    # The newest completed save, or the one in flight if it was published before the kill.
    return {"completed": len(completed), "loaded": step, "allowed": [newest, newest + 1],
            "bit_exact": exact, "leftovers": len(leftovers)}


def disk_full_round(path: str, last: int, limit: int) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # SIGXFSZ: ignored by Python
        try:
            checkpoint.save(state(last + 1), path)
            message = "saved"
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            message = f"{type(exc).__name__}: {exc}"
        os.write(write_fd, message.encode())
        os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    step, exact = load(path)
    return {"message": b"".join(chunks).decode(), "loaded": step, "expected": last,
            "bit_exact": exact, "tmp_leftovers": [os.path.basename(p) for p in
                                                  atomic.leftovers(path) if ".tmp-" in p]}


def main() -> None:
    directory, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    path = os.path.join(directory, "ckpt")
    checkpoint.save(state(0), path)  # first use: imports what a save needs (not timed)
    duration = 0.0
    for _ in range(3):  # the slowest of three saves sets the range of kill times
        started = time.perf_counter()
        checkpoint.save(state(0), path)
        duration = max(duration, time.perf_counter() - started)
    rng = random.Random(seed)
    results, last, most_leftovers = [], 0, 0
    for _ in range(rounds):
        result = kill_round(path, last, rng.uniform(0.0, 3 * duration))
        results.append(result)
        last = max(last, result["loaded"])
        most_leftovers = max(most_leftovers, result["leftovers"])
    full = disk_full_round(path, last, limit=64 * 1024)
    checkpoint.save(state(last + 1), path)  # the next save: cleans every leftover
    step, exact = load(path)
    siblings = sorted(n for n in os.listdir(directory) if n.startswith("ckpt") or
                      n.startswith(".ckpt"))
    print(json.dumps({"save_seconds": duration, "rounds": results, "disk_full": full,
                      "most_leftovers": most_leftovers, "final": {"loaded": step,
                      "expected": last + 1, "bit_exact": exact, "siblings": siblings}}))


if __name__ == "__main__":
    main()
