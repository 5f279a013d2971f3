"""A runnable FSDP1 fixture with sites that have a form in torch alone: a wrap policy on a model
built inside the constructor call, an optimizer state taken inside a `state_dict_type` block and
saved right after it, and a sharded optimizer state loaded through
`optimizer.load_state_dict(FSDP.optim_state_dict_to_load(...))` written as one call; and one that
has none: that sharded state is kept in memory across two steps before it is loaded back, so the
copies FSDP1 returned (Adam's `step` included) matter, and `fsdp1_optim_state_dict` stays. The
test runs it before and after `--to fsdp2` in one 2-rank world: same losses, same saved state."""

import io

import torch
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def saved_totals(buffer):
    """Parameter name -> state key -> rounded sum, of a full optimizer state saved with torch.save."""
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    return {name: {key: round(value.float().sum().item(), 4) for key, value in entry.items()}
            for name, entry in state.get("state", {}).items()}


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3 + rank)
    losses = []

    def step():
        loss = model(torch.randn(2, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))

    step()
    buffer = io.BytesIO()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full_osd = FSDP.optim_state_dict(model, optimizer)
    torch.save(full_osd, buffer)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        sharded_osd = FSDP.optim_state_dict(model, optimizer)
        torch.save(sharded_osd, io.BytesIO())
    step()
    step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, sharded_osd))
    step()
    step()
    return {"losses": losses, "saved": saved_totals(buffer) if rank == 0 else None}
