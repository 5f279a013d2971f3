"""A runnable FSDP1 fixture whose settings are *not* literals: a kwargs dict, a policy, a mixed
precision and a state-dict config built elsewhere, a model passed in as a parameter. `--to fsdp2`
routes all of it through the runtime helpers; the test runs it before and after rewriting in one
2-rank world."""

import torch
from torch import nn
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.relu(self.inner(x)) + x


def make_settings(zero2):
    policy = ModuleWrapPolicy({Block})
    mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32)
    strategy = ShardingStrategy.SHARD_GRAD_OP if zero2 else ShardingStrategy.FULL_SHARD
    return {"auto_wrap_policy": policy, "mixed_precision": mp, "sharding_strategy": strategy}


def make_state_dict_config(rank0_only):
    return FullStateDictConfig(offload_to_cpu=rank0_only, rank0_only=rank0_only)


def accumulate(wrapped, micro_batches):
    for x in micro_batches[:-1]:
        with wrapped.no_sync():
            wrapped(x).pow(2).mean().backward()
    loss = wrapped(micro_batches[-1]).pow(2).mean()
    loss.backward()
    return loss, wrapped.clip_grad_norm_(1.0)


def train(rank, steps=3, zero2=True):
    torch.manual_seed(0)
    model = nn.Sequential(Block(8), Block(8), nn.Linear(8, 1))
    settings = make_settings(zero2)
    model = FSDP(model, device_id=torch.device("cpu"), **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        batches = [torch.randn(4, 8, generator=generator) for _ in range(2)]
        loss, norm = accumulate(model, batches)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((round(loss.item(), 6), round(float(norm), 6)))
    config = make_state_dict_config(rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    return losses, {k: v.sum().item() for k, v in state.items()}
