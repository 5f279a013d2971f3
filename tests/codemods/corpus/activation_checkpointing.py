"""Wrap policy plus activation checkpointing on the wrapped layers."""
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from mymodel import Block


def build(model):
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    for unit in FSDP.fsdp_modules(model):
        print(type(unit).__name__)
    return model
