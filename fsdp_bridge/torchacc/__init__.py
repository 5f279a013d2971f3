"""Drop-in for TorchAcc (`import fsdp_bridge.torchacc as torchacc`): `Config`, `accelerate`,
`save`, and `dist` (`rendezvous`, `mark_step`, `is_master_ordinal`,
`dist.fsdp.consolidate_sharded_model_checkpoints`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as _dist

from fsdp_bridge.outputs import write_with
from fsdp_bridge.torchacc import dist  # noqa: F401
from fsdp_bridge.torchacc.accelerate import AcceleratedModel, accelerate
from fsdp_bridge.torchacc.config import (  # noqa: F401
    ComputeConfig,
    Config,
    DataLoaderConfig,
    DistConfig,
    DPConfig,
    FSDPConfig,
    MemoryConfig,
    PPConfig,
    SPConfig,
    TPConfig,
)

__all__ = ["AcceleratedModel", "Config", "accelerate", "dist", "save"]


def save(obj, path: str, master_only: bool = True, global_master: bool = False) -> None:
    """torch_xla-style save. `master_only=True`: rank 0 writes `path`. `master_only=False`:
    every rank writes; when `path` is a directory each rank writes
    `path/rank{r}-of-{world}-model.pth` (what `consolidate_sharded_model_checkpoints` reads)."""
    rank = _dist.get_rank() if _dist.is_initialized() else 0
    world = _dist.get_world_size() if _dist.is_initialized() else 1
    if master_only:
        if rank == 0:
            _save(obj, path)
        return
    if os.path.isdir(path):
        path = os.path.join(path, f"rank{rank}-of-{world}-model.pth")
    _save(obj, path)


def _save(obj, path: str) -> None:
    """torch.save, replacing `path` atomically: an interrupted save leaves the previous file."""
    write_with(path, lambda handle: torch.save(obj, handle))
