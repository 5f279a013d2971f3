"""Drop-in for `torch.distributed.fsdp` (FSDP1 and FSDP2 names) over fsdp_bridge's engine.

Change `torch.distributed.fsdp` to `fsdp_bridge.fsdp` and keep the script. Torch's own enums,
config dataclasses and policies are re-exported as they are (the same objects: user code mixes
them with ours); `FullyShardedDataParallel`, `fully_shard`, `FSDPModule` (with `UnshardHandle`,
`register_fsdp_forward_method`) and `share_comm_ctx` are ours.
Also reachable as `fsdp_bridge.fsdp.fully_sharded_data_parallel` and, for FSDP2's legacy path
`torch.distributed._composable.fsdp`, this module itself.
Names torch added after our oldest supported torch (`_NEWER_TORCH`) are re-exported where the
installed torch has them.
"""

import torch.distributed.fsdp as _torch_fsdp
from torch.distributed.fsdp import (  # noqa: F401  (torch's own objects)
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FlatParameter,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

from fsdp_bridge.fsdp import _newer_torch, api, fully_sharded_data_parallel, wrap  # noqa: F401
from fsdp_bridge.fsdp._comm_ctx import share_comm_ctx
from fsdp_bridge.fsdp._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from fsdp_bridge.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "CPUOffloadPolicy",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "share_comm_ctx",
]

# Torch's names that only newer releases have (name -> the torch that has it).
_NEWER_TORCH = {"DataParallelMeshDims": ">= 2.12"}
__all__ += _newer_torch.reexport(globals(), _torch_fsdp, _NEWER_TORCH)


def __getattr__(name: str):
    raise _newer_torch.missing(__name__, "torch.distributed.fsdp", _NEWER_TORCH, name)
