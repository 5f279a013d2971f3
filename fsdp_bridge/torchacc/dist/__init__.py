"""`torchacc.dist`: process helpers used around checkpoints."""

from __future__ import annotations

import torch.distributed as dist

from fsdp_bridge.torchacc.dist import fsdp  # noqa: F401


def rendezvous(tag: str = "") -> None:
    """All ranks wait here (torch_xla's rendezvous; `tag` only names the point)."""
    if dist.is_initialized():
        dist.barrier()


def mark_step() -> None:
    """XLA's graph cut; nothing to do in eager mode."""


def is_master_ordinal(local: bool = True) -> bool:
    if not dist.is_initialized():
        return True
    if local:
        import os

        return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    return dist.get_rank() == 0


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
