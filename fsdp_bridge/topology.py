"""Which process groups a model is sharded over: one resolver for every front-end.

A sharding mode (`fsdp_bridge.plan.ShardingMode`) and what the user passed (one process group,
a (shard, replicate) pair, a DeviceMesh, or nothing) become a `Topology`: the group each unit
is sharded over, the group gradients are all-reduced across, and the world group. Front-ends
name their own dialect in its errors. `Topology` itself and the defaults for groups already
chosen (`topology_of_groups`) belong to the engine, which uses them for direct callers.

[Note: hybrid without groups]
torch's FSDP1 uses one shard group per node, sized by the accelerator count: 1 on CPU, where
it then silently never synchronises replicas (pytorch#154888). We shard within a node (the
CUDA device count on CUDA, else LOCAL_WORLD_SIZE, else the whole world) and all-reduce across
nodes, which is always correct.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_bridge.engine.topology import Topology, topology_of_groups
from fsdp_bridge.plan import ShardingMode
from fsdp_bridge.translation import bad_argument

# Dimension names of the 2-D meshes built here: dim 0 replicates, dim 1 shards (as FSDP1 and
# FSDP2 read a 2-D mesh).
MESH_DIM_NAMES = ("replicate", "shard")


def resolve_topology(mode: ShardingMode, *, process_group=None, device_mesh=None,
                     node_size: Optional[int] = None, device_type: str = "cpu",
                     frontend: str = "fsdp_bridge", setting: Optional[str] = None) -> Topology:
    """The groups for `mode` from what the user passed: `process_group` (one group, or a
    (shard, replicate) pair in hybrid mode), `device_mesh` (1-D, or 2-D in hybrid mode), or
    nothing (every rank; hybrid: nodes of `node_size` ranks, see [Note: hybrid without groups]).
    `setting` is the user's name for the mode in messages (e.g. "HYBRID_SHARD")."""
    setting = setting or mode.value
    _check_one_source(frontend, process_group, device_mesh)
    if device_mesh is not None:
        return _from_mesh(mode, device_mesh, frontend, setting)
    if mode is ShardingMode.HYBRID:
        if process_group is None:
            return _node_mesh(frontend, node_size, device_type)
        return topology_of_groups(mode, *_checked_pair(process_group, frontend, setting))
    _check_single_group(process_group, frontend, setting)
    return topology_of_groups(mode, process_group)


def _check_one_source(frontend: str, process_group, device_mesh) -> None:
    if process_group is not None and device_mesh is not None:
        raise bad_argument(frontend, "device_mesh", device_mesh, "only one of process_group "
                           "and device_mesh", "Pass the mesh alone (it carries the groups).")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise bad_argument(frontend, "device_mesh", device_mesh, "a DeviceMesh", "Build one "
                           "with torch.distributed.device_mesh.init_device_mesh.", exc=TypeError)


def _from_mesh(mode: ShardingMode, mesh: DeviceMesh, frontend: str, setting: str) -> Topology:
    if mode is ShardingMode.HYBRID:
        if mesh.ndim != 2:
            raise bad_argument(frontend, "device_mesh", mesh, f"a 2-D mesh (replicate, shard) "
                               f"for {setting}", "e.g. init_device_mesh('cuda', (nodes, "
                               "gpus_per_node), mesh_dim_names=('replicate', 'shard')).")
        return topology_of_groups(mode, mesh.get_group(1), mesh.get_group(0), mesh)
    if mesh.ndim != 1:
        raise bad_argument(frontend, "device_mesh", mesh, f"a 1-D mesh for {setting} (2-D "
                           "meshes need HYBRID_SHARD or _HYBRID_SHARD_ZERO2)", "Pass a 1-D "
                           "mesh, or a hybrid strategy.")
    return topology_of_groups(mode, mesh.get_group(), None, mesh)


def _checked_pair(process_group, frontend: str, setting: str) -> tuple:
    if not (isinstance(process_group, tuple) and len(process_group) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in process_group)):
        raise bad_argument(frontend, "process_group", process_group, f"a tuple "
                           f"(shard_group, replicate_group) for {setting}",
                           "Pass both groups, or a 2-D device_mesh.", exc=TypeError)
    return process_group


def _check_single_group(process_group, frontend: str, setting: str) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise bad_argument(frontend, "process_group", process_group, f"None or one "
                           f"ProcessGroup for {setting} (a tuple only with a hybrid "
                           "strategy)", "Pass one group, or sharding_strategy=HYBRID_SHARD.",
                           exc=TypeError)


def default_node_size(device_type: str) -> int:
    """Ranks per node when nobody said: the CUDA devices of this host on CUDA (FSDP1's own
    rule), else the launcher's LOCAL_WORLD_SIZE, else the whole world."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _node_mesh(frontend: str, node_size: Optional[int], device_type: str) -> Topology:
    world = dist.get_world_size()
    local = node_size if node_size is not None else default_node_size(device_type)
    if local < 1 or world % local:
        raise bad_argument(frontend, "process_group", None, f"a (shard, replicate) tuple or "
                           f"a 2-D device_mesh: the node size {local} does not divide the "
                           f"world size {world}", "Pass the groups explicitly.")
    mesh = init_device_mesh(device_type, (world // local, local), mesh_dim_names=MESH_DIM_NAMES)
    return topology_of_groups(ShardingMode.HYBRID, mesh.get_group(1), mesh.get_group(0), mesh)


def mesh_of_pair(shard_group, replicate_group, device_type: str) -> DeviceMesh:
    """The 2-D mesh (replicate, shard) of a hybrid group pair: every rank says where it sits
    in the pair, so the grid of global ranks is the same on all of them. A collective."""
    layout: list = [None] * dist.get_world_size()
    dist.all_gather_object(layout, (dist.get_rank(replicate_group), dist.get_rank(shard_group)))
    grid = torch.empty(dist.get_world_size(replicate_group), dist.get_world_size(shard_group),
                       dtype=torch.int)
    for global_rank, (replica, shard) in enumerate(layout):
        grid[replica, shard] = global_rank
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=grid,
                                 mesh_dim_names=MESH_DIM_NAMES)
