"""Model set-up in the llama-recipes style: every setting comes from a config."""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def setup_model(model, train_config, fsdp_config, wrapping_policy, mixed_precision_policy, local_rank):
    model = FSDP(
        model,
        auto_wrap_policy=wrapping_policy,
        mixed_precision=mixed_precision_policy if not fsdp_config.pure_bf16 else None,
        sharding_strategy=fsdp_config.sharding_strategy,
        device_id=local_rank,
        limit_all_gathers=True,
        sync_module_states=train_config.low_cpu_fsdp,
        param_init_fn=(lambda module: module.to_empty(device=torch.device("cuda"), recurse=False))
        if train_config.low_cpu_fsdp and dist.get_rank() != 0
        else None,
    )
    return model
