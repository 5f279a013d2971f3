"""`migrate --write -j 2` killed with SIGKILL at random points leaves every file either as it was
or fully rewritten and no process (pool worker) behind; the temporary file a kill may leave is
removed by the next `migrate --write` in that directory."""

import glob
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import uuid

from fsdp_bridge.migrate.driver import transform_source

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = [
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef build(model):\n"
    "    model = FSDP(model)  # variant 0\n    return model\n",
    "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef step(model, x):\n"
    "    model = FSDP(model)\n    with model.no_sync():\n        model(x).sum().backward()\n",
    "from torch.distributed.fsdp import FullyShardedDataParallel\n\n\ndef check(m):\n"
    "    return isinstance(m, FullyShardedDataParallel)  # variant 2\n",
    "import torch\n\nx = torch.ones(2)  # no FSDP here\n",
    '"""Mentions FullyShardedDataParallel in prose only: the prefilter lets it through, ast rejects it."""\n',
    "from torch.nn.parallel import DistributedDataParallel as DDP\n\nmodel = DDP(model)\n",
    "def is_fsdp_enabled():\n    return False\n",
    "print('hello')\n",
]
CHANGED_VARIANTS = 3  # the first three use FSDP1; the rest must stay byte-identical
FILES = 200


def _marked_processes(marker: str) -> list[int]:
    found = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(environ.split("/")[2]))
        except OSError:
            pass
    return found


def _start(path: pathlib.Path, marker: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FSDP_BRIDGE_KILL_TEST": marker, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fsdp_bridge", "migrate", str(path), "--to", "fsdp2", "--write",
                             "-j", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _temporaries(tree: pathlib.Path) -> list[pathlib.Path]:
    return list(tree.glob(".*.tmp")) + list(tree.glob("*.tmp"))


def _check_tree(tree: pathlib.Path, originals: list[str], rewrites: list[str], marker: str,
                killed: bool = False) -> int:
    deadline = time.monotonic() + 15
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked_processes(marker) == [], "a process of the killed run survived"
    # A kill between a temporary file's creation and its rename leaves it (the next run sweeps
    # it): one file at most, named after the killed process.
    left = _temporaries(tree)
    assert len(left) <= int(killed), left
    rewritten = 0
    for index in range(FILES):
        text = (tree / f"f{index:03d}.py").read_text()
        variant = index % len(VARIANTS)
        assert text in (originals[variant], rewrites[variant]), f"f{index:03d}.py is half-done"
        rewritten += text != originals[variant] and text == rewrites[variant]
    return rewritten


def test_sigkill_at_random_points(tmp_path):
    rewrites = [transform_source(text, "fsdp2")[0] for text in VARIANTS]
    assert all((new != old) == (i < CHANGED_VARIANTS) for i, (new, old) in enumerate(zip(rewrites, VARIANTS)))
    tree = tmp_path / "tree"
    tree.mkdir()
    for index in range(FILES):
        (tree / f"f{index:03d}.py").write_text(VARIANTS[index % len(VARIANTS)])
    # One complete run on a copy measures how long a run takes here (machines differ a lot).
    full = tmp_path / "full"
    full.mkdir()
    for path in tree.iterdir():
        (full / path.name).write_text(path.read_text())
    marker = uuid.uuid4().hex
    started = time.monotonic()
    assert _start(full, marker).wait(timeout=300) == 0
    duration = time.monotonic() - started
    assert _check_tree(full, VARIANTS, rewrites, marker) == FILES * CHANGED_VARIANTS // len(VARIANTS)
    rng = random.Random(13)
    for _ in range(3):
        marker = uuid.uuid4().hex
        process = _start(tree, marker)
        time.sleep(rng.uniform(0.05, 1.0) * duration)
        process.send_signal(signal.SIGKILL)
        process.wait()
        for left in _temporaries(tree):
            assert f"-{process.pid}-" in left.name, left
        _check_tree(tree, VARIANTS, rewrites, marker, killed=True)
    # What the kills left in the directory is swept by the next --write there, even of one file.
    (tree / f".fsdp-bridge-f000.py-{2**22 + 7}-0.tmp").write_text("a killed run's")  # no such pid
    marker = uuid.uuid4().hex
    assert _start(tree / "f003.py", marker).wait(timeout=300) == 0  # a file without FSDP
    _check_tree(tree, VARIANTS, rewrites, marker)
