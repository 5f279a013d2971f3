"""A runnable FSDP1 fixture whose model is put under torch's activation checkpoint wrapper after the
FSDP1 wrap: FSDP1's `no_sync()` and `clip_grad_norm_()` are reached through the wrapper, which
forwards attribute reads to the model it wraps. The test runs it before and after `--to fsdp2`
in one 2-rank world: the same losses and gradient norms."""

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), device_id=torch.device("cpu"))
    model = checkpoint_wrapper(model, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses, norms = [], []
    for _ in range(2):
        with model.no_sync():  # the first micro-batch accumulates locally
            model(torch.randn(3, 4, generator=generator)).pow(2).mean().backward()
        loss = model(torch.randn(3, 4, generator=generator)).pow(2).mean()
        loss.backward()
        norms.append(round(model.clip_grad_norm_(0.05).item(), 6))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return {"losses": losses, "norms": norms}
