"""TorchAcc's configuration dataclasses (`torchacc.Config` and its parts), same fields and
defaults as AlibabaPAI/torchacc's `torchacc/config.py`."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass
class ComputeConfig:
    fp16: bool = False
    bf16: bool = False
    acc_scaled_dot_attn: bool = False
    disable_kernel_patches: bool = False


@dataclasses.dataclass
class MemoryConfig:
    gc: bool = False
    gc_cls: Optional[set] = None
    gc_cnt: Optional[int] = None


@dataclasses.dataclass
class DPConfig:
    size: Optional[int] = None


@dataclasses.dataclass
class _SizeOnly:
    size: int = 1


class TPConfig(_SizeOnly):
    """TorchAcc's tensor-parallel settings: only a size."""


@dataclasses.dataclass
class PPConfig:
    size: int = 1
    num_micro_batches: int = 1
    input_names: Optional[list] = None
    split_points: list = dataclasses.field(default_factory=list)
    broadcast_loss: bool = True


@dataclasses.dataclass
class FSDPConfig:
    size: int = 1
    wrap_layer_cls: set = dataclasses.field(default_factory=set)
    flatten_parameters: bool = True
    sync_module_states: bool = False
    use_spmd: bool = False
    shard_output_callable: Optional[Callable] = None


class SPConfig(_SizeOnly):
    """TorchAcc's sequence-parallel settings: only a size."""


@dataclasses.dataclass
class DistConfig:
    dp: DPConfig = dataclasses.field(default_factory=DPConfig)
    tp: TPConfig = dataclasses.field(default_factory=TPConfig)
    pp: PPConfig = dataclasses.field(default_factory=PPConfig)
    fsdp: FSDPConfig = dataclasses.field(default_factory=FSDPConfig)
    sp: SPConfig = dataclasses.field(default_factory=SPConfig)
    topology: list = dataclasses.field(default_factory=lambda: ["dp", "fsdp", "pp", "tp"])


@dataclasses.dataclass
class DataLoaderConfig:
    buckets: Optional[list] = None
    max_length: Optional[int] = None
    num_buckets: Optional[int] = None
    pad_value_dict: Optional[dict] = None


@dataclasses.dataclass
class Config:
    backend: str = "eager"
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    dataloader: DataLoaderConfig = dataclasses.field(default_factory=DataLoaderConfig)
