"""Optimizer state save/load with FSDP1's static helpers."""
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def save_optimizer(model, optimizer, path):
    full_osd = FSDP.full_optim_state_dict(model, optimizer)
    torch.save(full_osd, path)


def load_optimizer(model, optimizer, path, rank):
    full_osd = torch.load(path) if rank == 0 else None
    sharded = FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optimizer)
    optimizer.load_state_dict(sharded)


def load_optimizer_keywords(model, optimizer, saved):
    state = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=saved)
    optimizer.load_state_dict(state)
