"""A runnable FSDP1 fixture in the low-CPU-memory style: rank 0 builds the real model, the other
ranks build it on the meta device, and `sync_module_states=True` with a `param_init_fn` makes
every rank start from rank 0's weights. `--to fsdp2` routes the constructor through the runtime
helper, which must materialise the meta tensors before it broadcasts (or the ranks deadlock), one
unit of the wrap policy at a time as FSDP1 does.

Native FSDP1 refuses `sync_module_states=True` on CPU, so its run here is `low_memory=False`
(every rank builds the same seeded model): the numbers the low-memory recipe must reproduce."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def init_on_cpu(module):
    # Only this module's own tensors: FSDP1 calls the function on every module holding meta tensors.
    module.to_empty(device=torch.device("cpu"), recurse=False)


def train(rank, steps=3, low_memory=True):
    if dist.get_rank() == 0 or not low_memory:
        model = build()
    else:
        with torch.device("meta"):
            model = build()
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        sync_module_states=low_memory,
        param_init_fn=init_on_cpu if low_memory else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses
