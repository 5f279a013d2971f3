"""Like train_tiny.py, but every rank prints the loss of its own slice, and which rank prints
first alternates from run to run (a counter file, `--order-file`): a run's losses must be read
per rank, not first line wins."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--order-file", required=True)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
runs = [0]
dist.barrier()
if rank == 0:
    runs[0] = int(open(args.order_file).read()) if os.path.exists(args.order_file) else 0
    with open(args.order_file, "w") as handle:
        handle.write(str(runs[0] + 1))
dist.broadcast_object_list(runs)
first = runs[0] % world  # the rank that prints first in this run
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    y = x.sum(1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    for turn in range(world):  # one rank at a time, `first` first
        if rank == (first + turn) % world:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        dist.barrier()
dist.destroy_process_group()
