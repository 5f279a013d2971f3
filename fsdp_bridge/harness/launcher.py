"""Run several backends of one recipe in one spawned torch.distributed world.

Spawning a world and importing torch and transformers costs seconds per rank, more than training
a tiny model for a few steps, so one world runs every backend in turn (the `reference` on rank 0
while the other ranks wait at a barrier). gloo on CPU, NCCL on GPU (one GPU per rank).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
from typing import Sequence, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_bridge.harness.backends import Backend, RankEnv, get_backend
from fsdp_bridge.harness.recipes import Recipe
from fsdp_bridge.harness.runner import RunRecord, cpu_count, train
from fsdp_bridge.harness.teardown import leave_world


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
                env: RankEnv) -> list[RunRecord]:
    """Every rank of an initialised world calls this; rank 0 gets every backend's record."""
    records = []
    backends = [get_backend(backend) for backend in backends]
    threads = max(1, cpu_count() // env.world_size)
    for backend in backends:
        if backend.distributed:
            torch.set_num_threads(threads)
            records.append(train(backend, recipe, env))
        elif env.rank == 0:  # the reference uses every core while the others wait
            torch.set_num_threads(max(threads, cpu_count()))
            records.append(train(backend, recipe, env))
        dist.barrier()
    torch.set_num_threads(threads)
    return records


def _rank_main(rank, world_size, init_file, out_dir, recipe, backends, device_type, timeout):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),  # a failed rank must not hang the others
    )
    try:
        records = run_on_rank(recipe, backends, rank_env(rank, world_size, device_type))
        if rank == 0:
            with open(os.path.join(out_dir, "records.pkl"), "wb") as handle:
                pickle.dump(records, handle)
    except BaseException:
        dist.destroy_process_group()
        raise  # the spawn machinery reports it with this rank's traceback
    leave_world()  # [Note: gloo teardown abort]


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


def run_backends(recipe: Recipe, backends: Sequence[Union[str, Backend]], nproc: int = 2,
                 device: str = "auto", timeout: float = 300.0) -> list[RunRecord]:
    """Train `recipe` under each backend on `nproc` spawned ranks; one record per backend."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: expected a positive int (ranks to spawn).")
    backends = [get_backend(backend) for backend in backends]
    for backend in backends:
        backend.check_available()
    recipe.check_world(nproc)
    device_type = resolve_device(device, nproc)
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-compare-") as tmp:
        context = mp.start_processes(
            _rank_main,
            args=(nproc, os.path.join(tmp, "init"), tmp, recipe, backends, device_type, timeout),
            nprocs=nproc, join=False, start_method="spawn",
        )
        try:
            while not context.join():
                pass
        except BaseException:  # a failed rank, Ctrl-C: no rank may outlive this call
            stop_processes(context.processes)
            raise
        with open(os.path.join(tmp, "records.pkl"), "rb") as handle:
            return pickle.load(handle)
