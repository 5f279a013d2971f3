"""A layout-independent parameter digest and the global gradient norm.

Every rank sums its *local* pieces of the parameters (and squares, and squared gradients) in
float64; the sums over ranks give numbers that do not depend on how the model is sharded, so two
runs with different sharding compare without gathering any parameter.

[Note: replicated pieces]
A piece held by several ranks (a replicated parameter, FSDP1 NO_SHARD, the replicate dimension
of HSDP) must count once, so each piece is weighted by 1/replicas:
- a DTensor knows: replicas = product of the mesh sizes of its `Replicate()` dimensions;
- an FSDP1 `FlatParameter` knows its unsharded size: replicas = world * shard / unsharded;
- a parameter may say so itself with an int attribute `_fsdp_bridge_replicas` (our engine sets
  it on every parameter it shards);
- any other tensor is judged by comparison: a piece counts once over the ranks that hold an
  identical (numel, sum, sum of squares) one (every rank for a replicated parameter, the
  replicas of a hybrid mesh's shard). This heuristic is exact for plain data-parallel models,
  for flat shards and for FSDP1's original parameters under HYBRID_SHARD; a real shard that is
  bit-identical on other ranks (e.g. an untouched all-ones norm weight split evenly) would be
  undercounted.
Padding in flat shards is zero and adds nothing.

This module imports only torch: the step hook injected into user scripts uses it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

_SUM, _SUMSQ, _SUM4, _GRADSQ, _NUMEL, _REPLICAS = range(6)


@dataclasses.dataclass(frozen=True)
class Digest:
    """Global sums over every parameter element (each counted once)."""

    sum: float
    sumsq: float
    sum4: float  # sum of fourth powers: sizes the tolerance on sumsq, see compare.py
    grad_norm: float  # L2 norm of all gradients (0.0 where none)
    numel: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's piece of `tensor` and how many ranks hold the same piece (0: unknown)."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:  # DTensor
        replicas = 1
        for dim, placement in enumerate(tensor.placements):
            if placement.is_replicate():
                replicas *= tensor.device_mesh.size(dim)
        return to_local(), replicas
    hint = getattr(tensor, "_fsdp_bridge_replicas", None)
    if hint is not None:
        return tensor, int(hint)
    unsharded = getattr(tensor, "_unpadded_unsharded_size", None)  # FSDP1 FlatParameter
    if unsharded is not None and dist.is_initialized() and tensor.numel() > 0:
        padded = getattr(tensor, "_padded_unsharded_size", unsharded).numel()
        shard_world = max(1, round(padded / tensor.numel()))
        return tensor, max(1, dist.get_world_size() // shard_world)
    return tensor, 0


def _row(param: torch.Tensor) -> list[torch.Tensor]:
    data, replicas = _local(param)
    data = data.detach().to(torch.float64)
    grad_sq = torch.zeros((), dtype=torch.float64, device=data.device)
    if param.grad is not None:
        grad, _ = _local(param.grad)
        grad_sq = grad.detach().to(torch.float64).square().sum()
    numel = torch.tensor(float(data.numel()), dtype=torch.float64, device=data.device)
    replicas_t = torch.tensor(float(replicas), dtype=torch.float64, device=data.device)
    square = data.square()
    return [data.sum(), square.sum(), square.square().sum(), grad_sq, numel, replicas_t]


def local_table(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """One float64 row per parameter: sum, sum of squares, sum of fourth powers, gradient sum
    of squares, numel, replicas."""
    rows = [torch.stack(_row(p)) for p in params]
    if not rows:
        return torch.zeros((0, 6), dtype=torch.float64)
    return torch.stack(rows)


def _weights(tables: torch.Tensor) -> torch.Tensor:
    """[world, P] weights 1/replicas, resolving unknown replication by comparing ranks: a piece
    is held by as many ranks as hold an identical one (all of them for a replicated parameter,
    the replicate dimension's for a hybrid mesh's shards)."""
    replicas = tables[:, :, _REPLICAS].clone()
    keys = tables[:, :, [_SUM, _SUMSQ, _NUMEL]]  # [world, P, 3]
    same = (keys.unsqueeze(0) == keys.unsqueeze(1)).all(dim=3)  # [world, world, P]
    guess = same.sum(dim=1).to(tables.dtype)  # [world, P]: ranks holding this rank's piece
    replicas = torch.where(replicas == 0, guess, replicas)
    return 1.0 / replicas


def global_digest(params: Iterable[torch.Tensor], group: Optional[object] = None,
                  distributed: bool = True) -> Digest:
    """The digest of `params` over all ranks of `group` (collective unless `distributed=False`).

    Every rank of the group must call it with its parameters in the same order."""
    table = local_table(params)
    if distributed and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, table.contiguous(), group=group)
        tables = torch.stack(gathered)
    else:
        tables = table.unsqueeze(0)
        tables[:, :, _REPLICAS] = 1.0
    weighted = tables[:, :, :_REPLICAS] * _weights(tables).unsqueeze(2)
    total = weighted.sum(dim=(0, 1)).cpu().tolist()
    return Digest(sum=total[_SUM], sumsq=total[_SUMSQ], sum4=total[_SUM4], grad_norm=math.sqrt(total[_GRADSQ]),
                  numel=int(round(total[_NUMEL])))
