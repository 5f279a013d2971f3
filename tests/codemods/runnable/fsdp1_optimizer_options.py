"""A runnable FSDP1 fixture with the optimizer state-dict configs real checkpoint code uses:
FSDP1's default optimizer config (a full state on every rank, on the CPU), a full state saved on
rank 0 only, and that state loaded back with `rank0_only=True` (rank 0 passes it, the other ranks
None, and FSDP1 broadcasts it). The test runs it before and after `--to fsdp2` in one 2-rank world
and compares what each state holds and the losses of the steps after the reload."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def describe(optim_state):
    """Parameter name -> state key -> (device, shape, rounded sum), comparable between FSDP1 and DCP."""
    return {
        name: {key: (value.device.type, tuple(value.shape), round(value.float().sum().item(), 4))
               for key, value in entry.items() if torch.is_tensor(value)}
        for name, entry in optim_state.get("state", {}).items()
    }


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7 + rank)
    losses = []

    def step():
        loss = model(torch.randn(2, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))

    step()
    results = {"default": describe(FSDP.optim_state_dict(model, optimizer))}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        saved = FSDP.optim_state_dict(model, optimizer)
    results["rank 0 only"] = describe(saved)
    step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        state = FSDP.optim_state_dict_to_load(model, optimizer, saved if dist.get_rank() == 0 else None)
        optimizer.load_state_dict(state)
    step()
    step()
    results["losses"] = losses
    return results
