"""A runnable FSDP1 fixture with the wrapper reads real training code writes around checkpoints:
a compiled model loaded through `model._orig_mod.load_state_dict(...)`, and a state dict taken
inside a `state_dict_type` context held in a variable, from a name the file does not show to hold
the wrapped model. The test runs it before and after `--to fsdp2` in one 2-rank world."""

import torch
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def load(model, state):
    if hasattr(model, "_orig_mod"):  # compiled with torch.compile
        model._orig_mod.load_state_dict(state)
    else:
        model.load_state_dict(state)


def take_state(model, unwrapped):
    cfg = FullStateDictConfig()  # every rank a full copy
    ctx = FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg)
    with ctx:
        state = unwrapped.state_dict()
    return state


def describe(state):
    return {key: (type(value).__name__, tuple(value.shape), round(value.sum().item(), 5)) for key, value in state.items()}


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(rank)

    def step():
        model(torch.randn(2, 4, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # (FSDP1 takes no full state dict before its first forward)
    full = take_state(model, model)
    taken = describe(full)
    compiled = torch.compile(model, backend="eager")
    step()
    changed = describe(take_state(model, model))
    load(compiled, full)
    return {"taken": taken, "changed": changed != taken, "after load": describe(take_state(model, model))}
