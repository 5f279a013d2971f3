"""A runnable FSDP1 fixture with the activation-checkpointing check function real recipes write:
it picks the blocks by an attribute and skips FSDP1's wrapper objects (which forward attribute
reads to the block they wrap) with `not isinstance(m, FSDP)`. The test runs it before and after
`--to fsdp2` in one 2-rank world: the same blocks must be checkpointed, with the same losses."""

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.attn(x)) + x


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Block(), Block(), nn.Linear(4, 2)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=torch.device("cpu"))
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: hasattr(m, "attn") and not isinstance(m, FSDP))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(3, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 5))
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return {"checkpointed blocks": checkpointed, "losses": losses}
