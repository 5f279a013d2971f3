"""Works with torch's FSDP, or fairscale's on older stacks."""
try:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
except ImportError:
    from fairscale.nn import FullyShardedDataParallel as FSDP


def wrap(model):
    return FSDP(model)
