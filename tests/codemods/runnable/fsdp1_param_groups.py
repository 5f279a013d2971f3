"""A runnable FSDP1 fixture that builds AdamW parameter groups by walking the wrapped model's
names (no weight decay for norms and biases), as training scripts do. With use_orig_params=False
(FSDP1's default) the walk finds only flat parameters, whose names hold neither "norm" nor
"bias": every parameter is decayed. With use_orig_params=True it finds the original names. The
test runs both before and after the migration in one 2-rank world: the True variant trains the
same; the False variant is flagged (FB216), and its groups do change."""

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

NO_DECAY = ("bias", "norm")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x))) + x


def _run(model, groups, rank):
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(3, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return {"group sizes": [len(group["params"]) for group in groups], "losses": losses}


def train_flat(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Block(), Block(), nn.Linear(4, 2)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=torch.device("cpu"))
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in NO_DECAY)], "weight_decay": 0.5},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in NO_DECAY)], "weight_decay": 0.0},
    ]
    return _run(model, groups, rank)


def train_original_names(rank):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Block(), Block(), nn.Linear(4, 2)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=torch.device("cpu"), use_orig_params=True)
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in NO_DECAY)], "weight_decay": 0.5},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in NO_DECAY)], "weight_decay": 0.0},
    ]
    return _run(model, groups, rank)


def train(rank):
    return {"flat": train_flat(rank), "original names": train_original_names(rank)}
