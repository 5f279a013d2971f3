"""Hybrid sharding on a 2-D mesh."""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy


def wrap(model, nodes, gpus_per_node):
    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    return FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
