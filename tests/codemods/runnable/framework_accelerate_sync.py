"""A runnable accelerate script whose Accelerator builds the FSDP2 wrapper (the CPU switch of
fsdp_bridge.examples.frameworks makes accelerate take its FSDP path without a GPU), with a
"weight sync" that runs only on sharded models. `migrate --to bridge` must put the Accelerator
on fsdp_bridge's route together with the FSDPModule import; swapping the import alone leaves
torch's wrapper, which fsdp_bridge's FSDPModule does not match: the sync silently stops."""

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule

from fsdp_bridge.examples import frameworks as F

STEPS = 3


def train(rank):
    accelerator = F.fsdp_accelerator(Accelerator, "no")
    model = F.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    world = accelerator.num_processes
    batches = F.token_rows(STEPS).view(STEPS, world, F.PER_DEVICE, F.SEQ)
    losses = []
    for step in range(STEPS):
        ids = batches[step, rank]
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(F.global_mean(loss))
    synced = isinstance(model, FSDPModule)  # where a real script pushes weights to an inference engine
    return {"losses": losses, "synced": synced, "engine": type(model).__module__.split(".")[0]}
