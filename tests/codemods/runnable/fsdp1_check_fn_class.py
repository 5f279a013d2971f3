"""A runnable FSDP1 fixture that picks the modules to checkpoint (and walks the wrapped model) by
class: by the class's name, and by its bases. fully_shard gives each block it shards the class
FSDP<Block>(FSDPModule, Block), so both tests would now answer otherwise for every block. The
test runs it before and after `--to fsdp2` in one 2-rank world: the same blocks must be
checkpointed and counted, with the same losses."""

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.attn(x)) + x


def _build():
    torch.manual_seed(0)
    return FSDP(nn.Sequential(DecoderLayer(), DecoderLayer(), nn.Linear(4, 2)),
                auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), device_id=torch.device("cpu"))


def _run(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(3, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return {"checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()), "losses": losses}


def train_by_name(rank):
    model = _build()
    layers = [name for name, module in model.named_modules() if type(module).__name__ == "DecoderLayer"]
    apply_activation_checkpointing(model, check_fn=lambda m: m.__class__.__name__ == "DecoderLayer")
    return {"layers found": len(layers), **_run(model, rank)}


def train_by_bases(rank):
    model = _build()
    apply_activation_checkpointing(
        model, check_fn=lambda m: any("Layer" in base.__name__ for base in type(m).__bases__))
    return _run(model, rank)


def train(rank):
    return {"by name": train_by_name(rank), "by bases": train_by_bases(rank)}
