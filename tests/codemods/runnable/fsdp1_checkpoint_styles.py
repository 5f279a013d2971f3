"""A runnable FSDP1 fixture with the checkpoint code real repositories write: the state-dict
setting chosen at run time and held in a variable, a helper that saves whatever module it is given
(an FSDP model on one path, DDP on the other), a state dict taken outside any context (FULL),
blocks on a parameter with configs held in variables, and an optimizer saved full on rank 0, scattered back, and loaded by keyword arguments.
The test runs it before and after `--to fsdp2` in one 2-rank world and compares what each
state dict holds."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(model, use_fsdp):
    if use_fsdp:
        module = FSDP(model, device_id=torch.device("cpu"))
    else:
        module = DDP(model)
    return module


def checkpoint_context(model, sharded):
    # Chosen at run time, as an accelerate plugin or a config flag would.
    if sharded:
        return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
    return FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True))


def save(module):
    return module.state_dict()


# Configs held in variables with a literal value, used by blocks whose model is a parameter: the
# migration writes DCP calls with literal options here (torch alone).
FULL_CONFIG = FullStateDictConfig()


def save_full(model):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FULL_CONFIG):
        return model.state_dict()


def save_sharded(model):
    config = ShardedStateDictConfig(offload_to_cpu=False)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config):
        return model.state_dict()


def describe(state):
    """Key -> ("sharded", shape) or ("full", sum), comparable between FSDP1 and FSDP2."""
    out = {}
    for key, value in state.items():
        if type(value) is torch.Tensor:
            out[key] = ("full", round(value.sum().item(), 5))
        else:  # ShardedTensor (FSDP1) or DTensor (FSDP2)
            out[key] = ("sharded", tuple(value.shape))
    return out


def train(rank):
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), use_fsdp=True)
    model(torch.randn(2, 4)).sum().backward()
    results = {"default": describe(save(model))}
    for sharded in (True, False):
        ctx = checkpoint_context(model, sharded)
        with ctx:
            results[f"sharded={sharded}"] = describe(model.state_dict())
    results["full, literal config in a variable"] = describe(save_full(model))
    results["fsdp units"] = len(FSDP.fsdp_modules(model))  # rewritten as a list of FSDPModules
    results["sharded, literal config in a variable"] = describe(save_sharded(model))
    ddp = wrap(nn.Linear(2, 2), use_fsdp=False)
    results["ddp"] = sorted(save(ddp))
    results["rank"] = dist.get_rank()
    results["optimizer losses"] = optimizer_round_trip(rank)
    return results


def optimizer_round_trip(rank):
    """Losses of steps taken after each optimizer reload: equal only if the state came back."""
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
    full_osd = FSDP.full_optim_state_dict(model, optimizer)
    saved = FSDP.optim_state_dict(model, optimizer)
    step()
    sharded = FSDP.scatter_full_optim_state_dict(full_osd if dist.get_rank() == 0 else None, model, optim=optimizer)
    optimizer.load_state_dict(sharded)
    step()
    state = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=saved)
    optimizer.load_state_dict(state)
    step()
    return losses
