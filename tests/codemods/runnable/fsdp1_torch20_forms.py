"""A runnable FSDP1 fixture written in torch 2.0's spellings: the constructor's
`ignored_parameters=` (torch 2.1 renamed it `ignored_states`) and
`FSDP.optim_state_dict_to_load(optim_state_dict, model, optim)` in torch 2.0's argument order.
Current torch runs neither, so the test's reference is this file with the two spellings updated
(`current_spellings`); the migrated file must give the same numbers."""

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def train(rank):
    return {"ignored parameters": ignored_parameters(rank), "optimizer reload": optimizer_reload(rank)}


def _stepper(model, optimizer, rank, losses):
    generator = torch.Generator().manual_seed(7 + rank)

    def step():
        loss = model(torch.randn(2, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))

    return step


def ignored_parameters(rank):
    """Losses of a model whose last layer is left out of sharding (each rank keeps its own copy)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = FSDP(inner, ignored_parameters=list(inner[1].parameters()), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    step = _stepper(model, optimizer, rank, losses)
    for _ in range(3):
        step()
    return losses


def optimizer_reload(rank):
    """Losses of steps taken after the optimizer state is reloaded: equal only if it came back."""
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    step = _stepper(model, optimizer, rank, losses)
    step()
    saved = FSDP.optim_state_dict(model, optimizer)
    step()
    state = FSDP.optim_state_dict_to_load(saved, model, optimizer)
    optimizer.load_state_dict(state)
    step()
    step()
    return losses


def current_spellings(source: str) -> str:
    """This file as torch 2.1+ spells it (the reference the migrated file is compared with)."""
    return (source.replace("ignored_parameters=", "ignored_states=")
            .replace("optim_state_dict_to_load(saved, model, optimizer)",
                     "optim_state_dict_to_load(model, optimizer, saved)"))
