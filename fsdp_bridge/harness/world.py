"""Spawn a torch.distributed world of local ranks, run one function on every rank, and bring the
results back: the one spawner of the harness, the bench and the test suite.

Every rank joins the default process group (a file rendezvous in a temporary folder), runs
`fn(rank, world_size, *args)`, writes ("ok", value) or ("error", traceback) to that folder, waits
for the others at a barrier when it succeeded, and leaves with `leave_world` (see [Note: gloo
teardown abort]). The parent waits for every rank and returns the values in rank order, or
raises `WorldFailed` naming what each failing rank said. On an interrupt (Ctrl-C) or any other
exception while waiting, every rank is stopped before the exception goes on: no rank outlives
the call.

`fn` must be importable by the spawned interpreters (a module-level function), and its value
picklable. torch is imported when a world is spawned, not when this module is.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import pickle
import tempfile
import time
import traceback

from fsdp_bridge.harness.teardown import leave_world


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """How each rank is prepared before `fn` runs."""

    backend: str = "gloo"  # "nccl" for one GPU per rank
    # A rank that fails leaves the others blocked in a collective; they time out instead of
    # hanging for ever.
    group_timeout_s: float = 180.0
    threads: int | None = 1  # torch's intra-op threads per rank; None leaves torch's choice
    one_gpu_per_rank: bool = False  # torch.cuda.set_device(rank % device count)
    # Modules a fork server imports once, for every world this process spawns after: ranks
    # are then forked from it, already holding them, instead of each importing torch (seconds
    # a rank). Empty: each rank is a fresh interpreter (multiprocessing's "spawn"). See
    # [Note: ranks forked from a server].
    preload: tuple[str, ...] = ()


class WorldFailed(RuntimeError):
    """A rank raised, died, or wrote no result; `errors` holds one text per problem."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def spawn(fn, world_size: int, args: tuple = (), setup: RankSetup = RankSetup()) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; their values by rank."""
    import torch.multiprocessing as mp

    start_method = "spawn"
    if setup.preload:
        start_method = "forkserver"
        mp.get_context(start_method).set_forkserver_preload(list(setup.preload))
    parent = _ParentState(dict(os.environ), os.getcwd())
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-world-") as folder:
        context = mp.start_processes(
            _rank_main, args=(world_size, folder, setup, fn, args, parent), nprocs=world_size,
            join=False, start_method=start_method,
        )
        errors = _wait(context)
        outcomes = [_read_outcome(folder, rank) for rank in range(world_size)]
    errors += [f"--- rank {rank} ---\n{value}" for rank, (status, value) in enumerate(outcomes)
               if status == "error"]
    errors += [f"rank {rank} produced no result" for rank, (status, _) in enumerate(outcomes)
               if status == "missing"]
    if errors:
        raise WorldFailed(errors)
    return [value for _, value in outcomes]


def _wait(context) -> list[str]:
    """Wait for every rank; a rank that died hard is an error to report, an interrupt is not."""
    try:
        while not context.join():
            pass
    except Exception as exc:  # noqa: BLE001 - a rank died hard (signal, os._exit)
        stop_processes(context.processes)
        return [f"process failure: {exc}"]
    except BaseException:  # Ctrl-C: stop every rank, then let the interrupt go on
        stop_processes(context.processes)
        raise
    return []


def _read_outcome(folder: str, rank: int) -> tuple[str, object]:
    path = _outcome_path(folder, rank)
    if not os.path.exists(path):
        return "missing", None
    with open(path, "rb") as handle:
        return pickle.load(handle)


def _outcome_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pkl")


def stop_processes(processes, grace: float = 3.0) -> None:
    """Terminate spawned ranks, then kill those still alive after `grace` seconds."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _join_group(rank: int, world_size: int, folder: str, setup: RankSetup) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    if setup.one_gpu_per_rank:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        setup.backend, init_method=f"file://{os.path.join(folder, 'init')}", rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=setup.group_timeout_s),
    )


@dataclasses.dataclass(frozen=True)
class _ParentState:
    """What a rank takes from the parent at the moment of the call.

    [Note: ranks forked from a server] A rank forked from multiprocessing's fork server starts
    with the server's environment and working directory, those of the parent when the server
    started (its first world), not those of this call; so each rank takes the parent's current
    ones first. The server only imports modules (no tensor work, no threads started), so a
    fork of it is as clean as a fresh interpreter; module-level settings those modules read
    from the environment at import are the server's."""

    environ: dict
    cwd: str

    def apply(self) -> None:
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)


def _rank_main(rank: int, world_size: int, folder: str, setup: RankSetup, fn, args,
               parent: _ParentState) -> None:
    import torch.distributed as dist

    parent.apply()
    faulthandler.enable()  # a rank that dies on a signal prints its Python stack to stderr
    _join_group(rank, world_size, folder, setup)
    try:
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - handed to the parent with this rank's traceback
        outcome = ("error", traceback.format_exc())
    with open(_outcome_path(folder, rank), "wb") as handle:
        pickle.dump(outcome, handle)
    if outcome[0] == "ok":
        dist.barrier()  # no rank leaves while another may still talk to it
    leave_world()  # the outcome is on disk; see [Note: gloo teardown abort]
