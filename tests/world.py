"""Spawn a real torch.distributed world (gloo on CPU) and run one function on every rank.

Spawning costs a few seconds, so a test module runs *many cases inside one world*: the rank
function loops over its cases and returns a dict of results; the parent asserts on them.

    results = run_world(my_cases, world_size=2)   # -> [rank0_result, rank1_result]

`fn(rank, world_size, *args)` must be importable (a module-level function). Exceptions on any
rank are re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_bridge.harness.teardown import leave_world


def _entry(rank, world_size, init_file, out_dir, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        # A rank that fails leaves the others blocked in a collective; time out instead of hanging.
        timeout=datetime.timedelta(seconds=180),
    )
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)
    if result[0] == "ok":
        dist.barrier()
    leave_world()  # results are on disk; see [Note: gloo teardown abort]


def run_world(fn, world_size: int = 2, *args, timeout: float = 600.0):
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return results."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(
            _entry,
            args=(world_size, init_file, tmp, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        errors = []
        try:
            while not context.join(timeout=timeout):
                pass
        except Exception as exc:  # a rank died hard (segfault, os._exit)
            errors.append(f"process failure: {exc}")
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank} produced no result")
                results.append(None)
                continue
            with open(path, "rb") as handle:
                status, value = pickle.load(handle)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results
