"""Mesh layouts of FSDP2 beyond one data-parallel dimension beside tensor parallelism, run with
native `fully_shard` and with ours in the four-rank world of fsdp2_round3_cases.py:

- HSDP with tensor parallelism through `mesh=` (torchtitan's HSDP + TP): parameters that
  `parallelize_module` made DTensors on the "tp" sub-mesh of a (dp_replicate, dp_shard, tp)
  mesh, fully_shard given `mesh=mesh["dp_replicate", "dp_shard"]`. Four ranks hold a (2, 1, 2)
  mesh (the replicas' all-reduce, each shard group of one rank) and a (1, 2, 2) one (the shard
  group's split and its strided placements): every index of the three dimensions is exercised.

Each case records the losses, the last step's gradients (placements, local and full values),
the parameters' placements and local values, and the full state dict after three steps.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.world import device_type

STEPS = 3
GLOBAL_BATCH = 4
MESH_NAMES = ("dp_replicate", "dp_shard", "tp")


def _fsdp(which):
    return importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")


def _inputs(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // dp_size
    return batch[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device_type())


def _model() -> nn.Sequential:
    """Ten hidden features: five per tensor-parallel rank, split 3 / 2 over a shard pair."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4)).to(device_type())


def _record(model: nn.Module, step_loss) -> dict:
    """Three AdamW steps (`step_loss(step)` runs a forward and returns the loss tensor); the
    losses, the last step's gradients, the parameters and the full state dict afterwards."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, full_grads = [], {}, {}
    for step in range(STEPS):
        loss = step_loss(step)
        loss.backward()
        if step == STEPS - 1:
            for name, p in model.named_parameters():
                grads[name] = (str(p.grad.placements), p.grad.to_local().cpu().clone())
                full_grads[name] = p.grad.full_tensor().cpu()
        optim.step()
        optim.zero_grad()
        losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item())
    params = {name: (str(p.device_mesh.mesh_dim_names), str(p.placements),
                     p.to_local().cpu().clone()) for name, p in model.named_parameters()}
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "full_grads": full_grads, "params": params,
            "full": full}


def hsdp_tensor_parallel(which, shape: tuple):
    """HSDP + TP through `mesh=`: column-wise then row-wise tensor parallelism on "tp", each
    linear and the root fully_shard-ed over the (dp_replicate, dp_shard) sub-mesh."""
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=MESH_NAMES)
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp = mesh["dp_replicate", "dp_shard"]
    fully_shard = _fsdp(which).fully_shard
    fully_shard(model[0], mesh=dp)
    fully_shard(model[2], mesh=dp)
    fully_shard(model, mesh=dp)
    dp_rank = dp.get_local_rank(0) * dp.size(1) + dp.get_local_rank(1)
    return _record(model, lambda step: model(_inputs(step, dp_rank, dp.size())).pow(2).mean())


def cases(both) -> dict:
    """name -> rank function, each running `fn("native")` then `fn("ours")` through `both`."""
    return {
        "hsdp_tp_replicas": both(hsdp_tensor_parallel, (2, 1, 2)),
        "hsdp_tp_shards": both(hsdp_tensor_parallel, (1, 2, 2)),
    }
