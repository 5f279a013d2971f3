"""The process groups one sharded model uses (`Topology`), and the defaults for groups a caller
has already chosen. Turning what a user passed (a process group, a pair, a DeviceMesh) into
groups is the front-end kit's job (`fsdp_bridge.topology`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_bridge.plan import ShardingMode


@dataclasses.dataclass(frozen=True)
class Topology:
    """The groups of one sharded model. A group is None where the mode has no such group
    (no shard group when replicating, no replicate group when sharding) and, for the world,
    before torch.distributed is initialised."""

    mode: ShardingMode
    shard_group: Optional[dist.ProcessGroup]
    replicate_group: Optional[dist.ProcessGroup]
    world_group: Optional[dist.ProcessGroup]
    mesh: Optional[DeviceMesh] = None  # the mesh the groups came from (given or built)


# Set by torchrun (and other launchers) in every rank it starts.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def world_group() -> Optional[dist.ProcessGroup]:
    """The default group; None without torch.distributed (one process, a world of one). A rank
    started by a launcher of several ranks must have a group: without one it would train alone,
    silently apart from the others (native FSDP1 raises here too)."""
    if dist.is_initialized():
        return dist.group.WORLD
    check_launched_world_has_group()
    return None


def check_launched_world_has_group() -> None:
    """ValueError when the environment says this process is one rank of several (torchrun's
    WORLD_SIZE > 1) but no process group exists."""
    seen = {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}
    try:
        world = int(seen.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1  # not a launcher's value; nothing to say about it
    if world <= 1:
        return
    shown = " ".join(f"{name}={value}" for name, value in seen.items())
    raise ValueError(
        f"fsdp_bridge: this process was launched as one of {world} ranks ({shown}) but "
        "torch.distributed has no process group, so it would train alone as a world of one "
        "and the ranks would silently diverge. Call "
        "torch.distributed.init_process_group(...) (e.g. "
        "torch.distributed.init_process_group(backend='gloo' or 'nccl')) before wrapping the "
        "model.")


def topology_of_groups(mode: ShardingMode, shard_group=None, replicate_group=None,
                       mesh: Optional[DeviceMesh] = None) -> Topology:
    """`mode` over groups already chosen; a missing group means every rank, except in hybrid
    mode, which has no default pair (the shape of the 2-D mesh is the caller's to choose)."""
    world = world_group()
    if mode is ShardingMode.SHARD:
        return Topology(mode, shard_group or world, None, world, mesh)
    if mode is ShardingMode.REPLICATE:
        # One group given for replication may come as the shard group (FSDP1's
        # process_group with NO_SHARD): it is the group replicas live in.
        return Topology(mode, None, replicate_group or shard_group or world, world, mesh)
    if shard_group is None or replicate_group is None:
        raise ValueError(
            "hybrid sharding needs both a shard group and a replicate group (a 2-D mesh "
            f"(replicate, shard)); got shard_group={shard_group!r}, "
            f"replicate_group={replicate_group!r}."
        )
    return Topology(mode, shard_group, replicate_group, world, mesh)
