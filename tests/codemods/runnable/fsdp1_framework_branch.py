"""A runnable FSDP1 fixture in the style of RL trainers built on accelerate: the framework wraps
the model in torch's FSDP1 (here `prepare`, given by the test, stands in for accelerate's FSDP1
plugin), and a branch taken only for FSDP1 wrappers gathers the full weights to hand to an
inference engine. After `--to fsdp2` the check must still accept torch's FSDP1 wrapper, or the
weight sync silently stops."""

import accelerate  # noqa: F401  (the framework that wraps the model)
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def weights_for_inference(model):
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False):
            return {name: round(p.sum().item(), 5) for name, p in model.named_parameters()}
    return None


def train(rank, prepare):
    torch.manual_seed(0)
    model = prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    return weights_for_inference(model)
