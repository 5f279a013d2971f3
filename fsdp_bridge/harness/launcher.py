"""Run several backends of one recipe in one spawned torch.distributed world.

Spawning a world and importing torch and transformers costs seconds per rank, more than training
a tiny model for a few steps, so one world runs every backend in turn (the `reference` on rank 0
while the other ranks wait at a barrier). gloo on CPU, NCCL on GPU (one GPU per rank).
"""

from __future__ import annotations

import sys
import time
from typing import Sequence, Union

import torch
import torch.distributed as dist

from fsdp_bridge.harness.backends import Backend, RankEnv, get_backend
from fsdp_bridge.harness.recipes import Recipe
from fsdp_bridge.harness.runner import RunRecord, cpu_count, train
from fsdp_bridge.harness.world import RankSetup, spawn


def resolve_device(device: str, nproc: int) -> str:
    """"auto" is "cuda" when there is one GPU per rank, else "cpu"."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported: use auto, cpu or cuda.")
    if device == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "cuda" if gpus >= nproc else "cpu"
    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"device='cuda' with nproc={nproc} needs {nproc} GPUs, found "
                         f"{torch.cuda.device_count()}: lower --nproc or use --device cpu.")
    return device


def rank_env(rank: int, world_size: int, device_type: str) -> RankEnv:
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return RankEnv(rank, world_size, device)


def run_on_rank(recipe: Recipe, backends: Sequence[Union[str, Backend]],
                env: RankEnv, announce: bool = False) -> list[RunRecord]:
    """Every rank of an initialised world calls this; rank 0 gets every backend's record, and
    with `announce` says on stderr when each backend is done (the progress of `compare`)."""
    records = []
    backends = [get_backend(backend) for backend in backends]
    threads = max(1, cpu_count() // env.world_size)
    started = time.perf_counter()
    for index, backend in enumerate(backends, start=1):
        if backend.distributed:
            torch.set_num_threads(threads)
            records.append(train(backend, recipe, env))
        elif env.rank == 0:  # the reference uses every core while the others wait
            torch.set_num_threads(max(threads, cpu_count()))
            records.append(train(backend, recipe, env))
        dist.barrier()
        if announce and env.rank == 0:
            print(f"fsdp-bridge compare: {backend.name} trained ({index}/{len(backends)} "
                  f"backends, {time.perf_counter() - started:.0f} s so far)", file=sys.stderr,
                  flush=True)
    torch.set_num_threads(threads)
    return records


def _rank_records(rank, world_size, recipe, backends, device_type,
                  announce) -> list[RunRecord] | None:
    """What one rank of the world runs: every backend in turn; rank 0 returns the records."""
    records = run_on_rank(recipe, backends, rank_env(rank, world_size, device_type), announce)
    return records if rank == 0 else None


def run_backends(recipe: Recipe, backends: Sequence[Union[str, Backend]], nproc: int = 2,
                 device: str = "auto", timeout: float = 300.0,
                 announce: bool = False) -> list[RunRecord]:
    """Train `recipe` under each backend on `nproc` spawned ranks; one record per backend
    (`announce`: rank 0 says on stderr when each backend is done)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: expected a positive int (ranks to spawn).")
    backends = [get_backend(backend) for backend in backends]
    for backend in backends:
        backend.check_available()
    recipe.check_world(nproc)
    device_type = resolve_device(device, nproc)
    # run_on_rank sets the threads per rank itself; rank_env picks each rank's GPU.
    setup = RankSetup(backend="nccl" if device_type == "cuda" else "gloo",
                      group_timeout_s=timeout, threads=None)
    return spawn(_rank_records, nproc, (recipe, backends, device_type, announce), setup)[0]
