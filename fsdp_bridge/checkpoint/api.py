"""Saving and loading checkpoints: `save` / `load` (torch.distributed.checkpoint, atomic and
checked), `save_state` / `load_state` (a model and its optimizers in one call), and
`CheckpointManager` (numbered checkpoints in one directory, resume from the latest)."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.checkpoint import atomic, validate
from fsdp_bridge.checkpoint.parts import world_rank


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree(value):
    """Rank 0's value on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save(state_dict: dict, path: str) -> str:
    """`dcp.save(state_dict)` into `path`, atomically (see [Note: atomic checkpoints]): after
    a crash, `path` holds the previous checkpoint (or nothing), never a partial one. A
    collective when a process group exists."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = os.path.abspath(path)
    token = _agree(uuid.uuid4().hex[:12])
    tmp = atomic.temporary_path(path, token)
    if world_rank() == 0:
        os.makedirs(tmp)
    _barrier()
    failed = None
    try:
        dcp.save(state_dict, storage_writer=FileSystemWriter(tmp, sync_files=True),
                 no_dist=not _distributed())
    except BaseException as exc:  # noqa: BLE001 - reported after cleaning up on every rank
        failed = exc
    failures = [failed is not None]
    if _distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failed is not None)
        failures = everyone
    if any(failures):
        if world_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            raise failed
        raise RuntimeError(f"saving checkpoint {path!r} failed on another rank; {path!r} is "
                           "unchanged.")
    if world_rank() == 0:
        atomic.publish(tmp, path, token)
    _barrier()
    return path


def load(state_dict: dict, path: str, *, strict: bool = True) -> str:
    """Check, then `dcp.load` into `state_dict` (in place; `Stateful` values get their
    `load_state_dict` called, as DCP does). Raises `CheckpointError` naming what is wrong
    (no metadata, a truncated file, missing / unexpected keys, wrong shapes) before anything
    is read; reads only, writes nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.stateful import Stateful

    path = atomic.resolve(path)
    metadata = validate.read_metadata(path)
    validate.check_files(path, metadata)
    statefuls = {k: v for k, v in state_dict.items() if isinstance(v, Stateful)}
    plain = {k: (v.state_dict() if k in statefuls else v) for k, v in state_dict.items()}
    validate.check_contents(path, metadata, plain, strict=strict)
    dcp.load(plain, storage_reader=FileSystemReader(path), no_dist=not _distributed())
    for key, obj in statefuls.items():
        obj.load_state_dict(plain[key])
    for key, value in plain.items():
        if key not in statefuls:
            state_dict[key] = value
    return path


# -- a model and its optimizers -----------------------------------------------------------------


def _optims(optimizers) -> tuple:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def training_state(model: nn.Module, optimizers=None, extra: Optional[dict] = None) -> dict:
    """{"model": sharded model state, "optim": name-keyed sharded optimizer state, **extra}."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    optims = _optims(optimizers)
    if optims:
        state["optim"] = get_optimizer_state_dict(model, optims)
    state.update(extra or {})
    return state


def save_state(path: str, model: nn.Module, optimizers=None,
               extra: Optional[dict] = None) -> str:
    return save(training_state(model, optimizers, extra), path)


def load_state(path: str, model: nn.Module, optimizers=None, extra: Optional[dict] = None,
               *, strict: bool = True) -> dict:
    """Load into `model` (and `optimizers`) from a checkpoint written at any world size by
    any of our front-ends or by native FSDP2; returns the loaded state (with `extra`)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
        StateDictOptions,
    )

    state = training_state(model, optimizers, extra)
    load(state, path, strict=strict)
    options = StateDictOptions(strict=strict)
    set_model_state_dict(model, state["model"], options=options)
    optims = _optims(optimizers)
    if optims:
        set_optimizer_state_dict(model, optims, state["optim"], options=options)
    return state


class CheckpointManager:
    """Numbered checkpoints `<root>/step_<n>`, each written atomically; `latest()` is the
    highest complete one (a crash during a save never leaves a partial `step_<n>`)."""

    PATTERN = re.compile(r"^step_(\d+)$")

    def __init__(self, root: str, keep: int = 2):
        self.root = os.path.abspath(root)
        self.keep = keep

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = self.PATTERN.match(name)
            if match and os.path.isfile(os.path.join(self.root, name, ".metadata")):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Optional[int]:
        steps = _agree(self.steps())
        return steps[-1] if steps else None

    def save(self, step: int, model: nn.Module, optimizers=None,
             extra: Optional[dict] = None) -> str:
        if world_rank() == 0:
            os.makedirs(self.root, exist_ok=True)
        path = save_state(self.path(step), model, optimizers, extra)
        if world_rank() == 0 and self.keep:
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        _barrier()
        return path

    def load_latest(self, model: nn.Module, optimizers=None,
                    extra: Optional[dict] = None) -> Optional[int]:
        step = self.latest()
        if step is None:
            return None
        load_state(self.path(step), model, optimizers, extra)
        return step


def iter_paths(paths: Iterable[str]):  # pragma: no cover - convenience for callers
    yield from (os.path.abspath(p) for p in paths)
