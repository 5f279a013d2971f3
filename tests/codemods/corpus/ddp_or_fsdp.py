"""A trainer that wraps with DDP or FSDP and saves through one helper."""
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(model, strategy):
    if strategy == "fsdp":
        model = FSDP(model)
    else:
        model = DDP(model)
    return model


def save(model, path):
    torch.save(model.state_dict(), path)


def train_step(model, optimizer, batch, accumulate):
    if accumulate:
        with model.no_sync():
            model(batch).sum().backward()
    else:
        model(batch).sum().backward()
        optimizer.step()
