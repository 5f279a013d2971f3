"""A deterministic script whose loss and parameters turn NaN at step NAN_STEP (an input of
NaN): prints `step N loss X` on rank 0."""

import argparse

import torch
import torch.distributed as dist

NAN_STEP = 2

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, args.steps + 1):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    if step == NAN_STEP:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
