"""Run cells: many per spawned world, one world per world size, a world that dies respawned
for the cells it left.

Every rank of a world runs the same cells in order; rank 0 judges each (verdict.py) and writes
its outcome to a folder the parent reads, so a cell that kills or hangs the world (a rank that
raises inside a collective the others wait in is stopped by the process group's timeout) loses
only itself: the parent marks it `crash` and spawns a new world for the rest. Rank 0 decides
when the time budget is spent (the others follow, so every rank runs the same cells) and draws
the progress bar.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import tempfile
import time
from typing import Callable, Optional, Sequence

from fsdp_bridge.harness.matrix.axes import Cell, native_limit, native_stand_in
from fsdp_bridge.harness.matrix.verdict import Outcome, crashed, judge, not_run
from fsdp_bridge.outputs import write_bytes

# A rank left waiting in a collective gives up after this long: the cell is a crash.
HANG_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    device: str = "auto"
    deadline: Optional[float] = None  # time.time() after which no new cell starts
    quiet: bool = False
    seed: int = 0


def _rank_cells(rank: int, world_size: int, cells: Sequence[Cell], done_before: int,
                total: int, device_type: str, folder: str, options: SweepOptions) -> None:
    import torch.distributed as dist

    from fsdp_bridge import progress
    from fsdp_bridge.harness.launcher import rank_env

    env = rank_env(rank, world_size, device_type)
    bar = progress.bar(total, "conformance cells", "cell", quiet=options.quiet or rank != 0)
    bar.update(done_before)
    for index, cell in enumerate(cells):
        go = [options.deadline is None or time.time() < options.deadline]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        outcome = run_cell(cell, env, options.seed)
        if rank == 0:
            _write(folder, index, outcome)
        bar.update(1)
    bar.close()


def _write(folder: str, index: int, outcome: Outcome) -> None:
    path = os.path.join(folder, f"cell-{index:05d}.pkl")
    write_bytes(path, pickle.dumps(outcome))


def _read(folder: str) -> list[Outcome]:
    outcomes = []
    for path in sorted(glob.glob(os.path.join(folder, "cell-*.pkl"))):
        with open(path, "rb") as handle:
            outcomes.append(pickle.load(handle))
    return outcomes


def run_cell(cell: Cell, env, seed: int = 0) -> Outcome:
    """Train one cell on this rank (every rank of the world calls it); rank 0's outcome is the
    verdict, the others' is a placeholder."""
    import torch.distributed as dist

    from fsdp_bridge.harness.matrix.dialects import cell_backend, cell_recipe
    from fsdp_bridge.harness.matrix.verdict import first_difference
    from fsdp_bridge.harness.runner import train

    started = time.perf_counter()
    recipe = cell_recipe(cell, seed)
    limit = native_limit(cell, env.device.type)
    has_native = cell.frontend in ("fsdp1", "fsdp2", "zeta")
    sides = ["native" if has_native else "reference", "ours"]
    runs = {}

    def run(side: str, key: str) -> None:
        backend = cell_backend(native_stand_in(cell) if limit and side == "native" else cell,
                               side)
        if backend.distributed or env.rank == 0:
            runs[key] = train(backend, recipe, env)
        dist.barrier()

    for side in sides:
        run(side, side)
    if has_native:
        again = [env.rank == 0 and not runs["native"].error and not runs["ours"].error
                 and first_difference(runs["native"], runs["ours"]) is not None]
        dist.broadcast_object_list(again, src=0)
        if again[0]:
            run("native", "native-again")
    _reset_compiler(cell)
    if env.rank != 0:
        return not_run(cell, "judged on rank 0")
    return judge(cell, runs, limit, time.perf_counter() - started)


def _reset_compiler(cell: Cell) -> None:
    if cell.compile != "off":
        import torch

        torch._dynamo.reset()  # no guard or cache of this cell's models leaks into the next


def run_sweep(cells: Sequence[Cell], options: SweepOptions,
              on_world: Optional[Callable[[int, int], None]] = None) -> list[Outcome]:
    """Every cell's outcome, in the order given (`not run` for those the budget left out)."""
    from fsdp_bridge.harness.launcher import resolve_device
    from fsdp_bridge.harness.world import RankSetup, WorldFailed, spawn

    by_world: dict[int, list[int]] = {}
    for index, cell in enumerate(cells):
        by_world.setdefault(cell.world, []).append(index)
    outcomes: dict[int, Outcome] = {}
    for world in sorted(by_world):
        device_type = resolve_device(options.device, world)
        setup = RankSetup(backend="nccl" if device_type == "cuda" else "gloo",
                          group_timeout_s=HANG_SECONDS, threads=1)
        left = by_world[world]
        while left:
            if options.deadline is not None and time.time() >= options.deadline:
                break
            if on_world is not None:
                on_world(world, len(left))
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="fsdp-bridge-matrix-") as folder:
                failure = None
                try:
                    spawn(_rank_cells, world, ([cells[i] for i in left], len(outcomes),
                                               len(cells), device_type, folder, options), setup)
                except WorldFailed as exc:
                    failure = exc
                done = _read(folder)
            for index, outcome in zip(left, done):
                outcomes[index] = outcome
            left = left[len(done):]
            if failure is not None and left:
                why = "the world died or hung in this cell: " + _short(failure)
                outcomes[left[0]] = crashed(cells[left[0]], why, started)
                left = left[1:]
    return [outcomes.get(i) or not_run(cell, "time budget spent")
            for i, cell in enumerate(cells)]


def _short(failure: Exception) -> str:
    lines = [line for line in str(failure).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors[-1] if errors else lines[-1] if lines else "no message")[:300]
