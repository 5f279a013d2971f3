"""A runnable FSDP1 fixture that checkpoints the model as a sharded DCP checkpoint and the
optimizer through FSDP1's full-state statics (`full_optim_state_dict` on rank 0, then
`scatter_full_optim_state_dict`), trains on, restores both and replays the same batches: the
losses after the restore repeat those after the save exactly when both were restored."""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def optimizer_totals(optim_state):
    """Parameter name -> the rounded sum of each state tensor, comparable between FSDP1 and DCP."""
    return {name: {key: round(value.float().sum().item(), 4) for key, value in entry.items()}
            for name, entry in optim_state.get("state", {}).items()}


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    losses = []

    def step(batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))

    step(batches[0])
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder[0])
    full_osd = FSDP.full_optim_state_dict(model, optimizer)
    results = {"full optimizer state": optimizer_totals(full_osd)}
    step(batches[1])
    step(batches[2])
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=folder[0])
        model.load_state_dict(state["model"])
    sharded = FSDP.scatter_full_optim_state_dict(full_osd if dist.get_rank() == 0 else None, model, optim=optimizer)
    optimizer.load_state_dict(sharded)
    step(batches[1])
    step(batches[2])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    results["losses"] = losses
    return results
