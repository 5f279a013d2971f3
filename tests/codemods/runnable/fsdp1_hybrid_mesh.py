"""A runnable FSDP1 fixture: hybrid sharding over a 2-D device mesh the script builds (replicas
over its first dimension, shards over its second). `--to fsdp2` writes `fully_shard(model,
mesh=mesh)`, FSDP2's HSDP on the same mesh."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy


def train(rank, shape=(1, 2)):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh, device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses
