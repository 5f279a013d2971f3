"""A checkpoint manager that picks its state-dict context at run time."""
import contextlib

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType


class CheckpointManager:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def context(self, sharded):
        if not sharded:
            return contextlib.nullcontext()
        return FSDP.state_dict_type(
            self.model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        )

    def save(self, sharded=True):
        with self.context(sharded):
            model_state = self.model.state_dict()
            optim_state = self.optimizer.state_dict()
        return model_state, optim_state
