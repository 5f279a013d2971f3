"""What the modern FSDP2 training stacks (torchtitan, torchtune) turn on, checked against native
`fully_shard` in one CPU/gloo world (see test_fsdp2_modern.py): transformer blocks compiled in
place with `fullgraph=True` before `fully_shard`."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from tests.world import device_type, run_case_table

STEPS = 3
GLOBAL_BATCH = 4
WIDTH = 8


def _fsdp(which):
    return importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")


def _inputs(step: int, rank: int, world: int, width: int = WIDTH) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, width, generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // world
    return batch[rank * per_rank:(rank + 1) * per_rank].to(device_type())


def _full(param) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu()


def _train(model, steps: int = STEPS, width: int = WIDTH) -> dict:
    """AdamW steps on the mean square of the output, each rank on its slice: losses and the
    full parameters after them."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = model(_inputs(step, rank, world, width)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "full": {n: _full(p) for n, p in model.named_parameters()}}


# -- per-block compile -----------------------------------------------------------------------------


class Block(nn.Module):
    """A residual MLP block, the shape of a transformer block's feed-forward half."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def per_block_compile(which, backend: str = "aot_eager"):
    """torchtitan's order: each block compiled in place (`block.compile(fullgraph=True)`),
    then `fully_shard` on each block and on the root; three AdamW steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack().to(device_type())
    for block in model.layers:
        block.compile(backend=backend, fullgraph=True)
    fully_shard = _fsdp(which).fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return _train(model)


def _both(fn, *args):
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            torch.manual_seed(0)
            out[which] = fn(which, *args)
            dist.barrier()
        return out
    return run


def cases() -> dict:
    return {
        "per_block_compile": _both(per_block_compile),
    }


def slow_cases() -> dict:
    """Opt-in (see test_fsdp2_modern.py): inductor compiles C++ kernels, tens of seconds."""
    return {"per_block_compile_inductor": _both(per_block_compile, "inductor")}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)


def run_slow_cases(rank, world, names=None):
    return run_case_table(slow_cases(), names)
