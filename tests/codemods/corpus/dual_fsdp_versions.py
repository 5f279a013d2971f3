"""Utilities that already support both FSDP1 and FSDP2."""
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def fsdp_version(model):
    if isinstance(model, FSDP):
        return 1
    if isinstance(model, FSDPModule):
        return 2
    return 0


def shard(model, config):
    if config.fsdp_version == 2:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return FSDP(model, use_orig_params=True)
