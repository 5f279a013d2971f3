"""A Lightning-style strategy: the strategy owns the wrapped module."""
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel


class FSDPStrategy:
    def __init__(self, cpu_offload=False):
        self.model = None
        self.cpu_offload = cpu_offload

    def setup(self, module):
        self.model = FullyShardedDataParallel(
            module,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            use_orig_params=True,
        )

    def backward(self, loss, accumulate):
        if accumulate:
            with self.model.no_sync():
                loss.backward()
        else:
            loss.backward()

    def clip_gradients(self, max_norm):
        return self.model.clip_grad_norm_(max_norm)

    def lightning_module_state_dict(self):
        return self.model.state_dict()
