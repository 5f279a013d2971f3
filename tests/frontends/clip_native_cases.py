"""FSDP1 training with `clip_grad_norm_` against native FSDP1 in one CPU/gloo world of two ranks
(see test_clip_native.py): per step the total norm, the clipped gradients and the weights."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.world import run_case_table

STEPS = 4


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(3)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(which, dtype, use_orig_params):
    fsdp = importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp").FullyShardedDataParallel
    torch.manual_seed(0)
    model = Net()
    mp = (MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
          if dtype != torch.float32 else None)
    wrapped = fsdp(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp,
                   device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    out: dict = {"norms": [], "grads": [], "weights": []}
    for _ in range(STEPS):
        x, y = torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)
        loss = nn.functional.mse_loss(wrapped(x).float(), y)
        loss.backward()
        out["norms"].append(wrapped.clip_grad_norm_(0.05).detach().clone())
        if use_orig_params:
            with fsdp.summon_full_params(wrapped, with_grads=True):
                out["grads"].append({_clean(n): p.grad.clone() for n, p in
                                     wrapped.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        with fsdp.summon_full_params(wrapped):
            out["weights"].append({_clean(n): p.detach().clone()
                                   for n, p in wrapped.named_parameters()})
    return out


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _both(dtype, use_orig_params):
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            out[which] = _train(which, dtype, use_orig_params)
            dist.barrier()
        return out
    return run


def cases() -> dict:
    return {
        "fp32_orig": _both(torch.float32, True),
        "bf16_orig": _both(torch.bfloat16, True),
        "fp32_flat": _both(torch.float32, False),
        "bf16_flat": _both(torch.bfloat16, False),
    }


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
