"""A runnable FSDP1 fixture that saves adapters one unit at a time, as LoRA recipes do: the units
are found by name in a walk over the wrapped model, and each one's full state dict is taken
under its own `state_dict_type` (on rank 0 only). YaFSDP's units are plain modules, so
the migration takes the root's full state dict and keeps the keys under each unit's name. The
test runs it before and after the migration in one 2-rank world: the same adapters are saved."""

import torch
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Adapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Linear(4, 2)
        self.up = nn.Linear(2, 4)

    def forward(self, x):
        return self.up(self.down(x))


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.adapter = Adapter()

    def forward(self, x):
        return self.base(x) + self.adapter(x)


def save_adapters(model):
    saved = []
    for name, module in model.named_modules():
        if name.endswith("adapter"):
            with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
                state = module.state_dict()
            saved.append(state)
    return saved


def train(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Adapted(), Adapted()), auto_wrap_policy=ModuleWrapPolicy({Adapter}),
                 device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean()
    loss.backward()
    optimizer.step()
    return [{key: [round(x, 5) for x in value.flatten().tolist()] for key, value in state.items()}
            for state in save_adapters(model)]
