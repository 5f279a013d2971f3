"""A tiny FSDP2 training script for the compare-scripts tests: prints `step N loss X`."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

LR = 1e-2
SEED = 0

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(SEED)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
for step in range(1, args.steps + 1):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    y = x.sum(1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
dist.destroy_process_group()
