"""The true global gradient norm of any list of parameters, and clipping by it."""

from __future__ import annotations

from typing import Iterable

import torch

from fsdp_bridge.engine.flat_group import local_part
from fsdp_bridge.engine.norms import clip_coefficient, grad_norm_of, scale_, tensor_norms
from fsdp_bridge.engine.ownership import owner_of
from fsdp_bridge.engine.runtime import ShardedModel


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The true global norm of the gradients of `parameters`, which may mix local shards of
    sharded models (combined over their shard groups) and ordinary parameters."""
    norm_type = float(norm_type)
    by_owner: dict[int, tuple[ShardedModel, list]] = {}
    plain = []
    for param in parameters:
        if param.grad is None:
            continue
        owner = owner_of(param)
        if owner is None:
            plain.append(param.grad)
        else:
            by_owner.setdefault(id(owner), (owner, []))[1].append(local_part(param.grad))
    if not by_owner:
        grads = plain
        if not grads:
            return torch.zeros(())
        norms = tensor_norms(grads, norm_type, grads[0].device)
        return norms.max() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)
    parts = []
    for index, (owner, grads) in enumerate(by_owner.values()):
        local = plain if index == 0 else []
        parts.append(grad_norm_of(grads, local, norm_type, owner.comm, owner.device))
    if norm_type == float("inf"):
        return torch.stack(parts).max()
    return torch.stack(parts).pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grads_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    scale_([local_part(param.grad) for param in parameters], clip_coefficient(max_norm, total))
    return total
