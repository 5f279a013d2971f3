"""`torchacc.accelerate(model, dataloader=None, config=Config())` over our engine."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictSettings, StateDictType

from fsdp_bridge import engine
from fsdp_bridge.mixed_dialects import refuse_other_dialects
from fsdp_bridge.state_dicts.torch_helpers import called_by_torch_helpers
from fsdp_bridge.topology import resolve_topology
from fsdp_bridge.torchacc._translate import FRONTEND, build_plan, sizes
from fsdp_bridge.torchacc.config import Config
from fsdp_bridge.translation import bad_argument
from fsdp_bridge.wrapper import ShardedWrapper, shard_flat


class AcceleratedModel(ShardedWrapper):
    """What `accelerate` returns: the model, sharded, with TorchAcc's (torch_xla FSDP's)
    checkpoint view: `state_dict()` is this rank's shard and `get_shard_metadata()` says how to
    put the shards back together (`consolidate_sharded_model_checkpoints`)."""

    _frontend = FRONTEND

    def __init__(self, model: nn.Module, sharded):
        super().__init__()
        # TorchAcc's eager backend builds torch's FSDP1 without use_orig_params (so False):
        # clip_grad_norm_ then takes one gradient per unit, as natively.
        self._attach(model, sharded, {"use_orig_params": False})
        self._set_state_dict_settings(StateDictSettings(
            StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
            ShardedOptimStateDictConfig()))

    def get_shard_metadata(self) -> dict:
        sharded = self._sharded
        shapes = {}
        for group in sharded.flat_groups():
            for slot in group.slots:
                for key in slot.state_keys:
                    shapes[key] = tuple(slot.shape)
        rank = dist.get_rank(sharded.comm.shard_group) if sharded.comm.shard_group else 0
        return {"shard_shapes": shapes, "shard_rank": rank,
                "shard_world_size": sharded.comm.shard_size,
                "rank": dist.get_rank() if dist.is_initialized() else 0,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1}

    # torch_xla FSDP's sharded view: this rank's own flat pieces, which
    # `consolidate_sharded_model_checkpoints` puts together offline on one process with
    # `get_shard_metadata()`. (FSDP1's SHARDED_STATE_DICT, DTensors gathered by rows for
    # torch.distributed.checkpoint, would need every rank to read them.)
    def _sharded_state_dict(self, settings: StateDictSettings) -> dict:
        return engine.sharded_state_dict(self._sharded)

    def _load_sharded_state_dict(self, state_dict: dict, strict: bool):
        engine.load_sharded_state_dict(self._sharded, state_dict, strict=strict)
        return nn.modules.module._IncompatibleKeys([], [])

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if called_by_torch_helpers():
            return super().load_state_dict(state_dict, strict=strict)
        shapes = self.get_shard_metadata()["shard_shapes"]
        full = all(tuple(state_dict[k].shape) == shape for k, shape in shapes.items()
                   if k in state_dict)
        if full:  # a consolidated checkpoint
            engine.load_full_state_dict(self._sharded, state_dict, strict=strict)
            return nn.modules.module._IncompatibleKeys([], [])
        return super().load_state_dict(state_dict, strict=strict)


class RankSliceLoader:
    """Iterates a dataloader of global batches and yields this data-parallel rank's slice of
    each (dim 0 of every tensor), on `device`."""

    def __init__(self, loader, rank: int, size: int, device: torch.device):
        self.loader, self.rank, self.size, self.device = loader, rank, size, device

    def __len__(self):
        return len(self.loader)

    def _slice(self, value):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                return value.to(self.device)
            if value.shape[0] % self.size:
                raise bad_argument("torchacc.accelerate", "dataloader", f"<batch of "
                                   f"{value.shape[0]}>", f"batches divisible by the "
                                   f"data-parallel size {self.size}", "Choose a batch size that "
                                   "is a multiple of the number of data-parallel ranks.")
            per = value.shape[0] // self.size
            return value[self.rank * per:(self.rank + 1) * per].to(self.device)
        if isinstance(value, dict):
            return type(value)({k: self._slice(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(self._slice(v) for v in value)
        return value

    def __iter__(self):
        for batch in self.loader:
            yield self._slice(batch)


def accelerate(model: nn.Module, dataloader=None, config: Optional[Config] = None):
    """Shard `model` as `config` says; returns the model, or (model, dataloader) when a
    dataloader is given (each data-parallel rank then iterates its slice of each batch)."""
    config = config if config is not None else Config()
    refuse_other_dialects(FRONTEND, model)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    world = dist.get_world_size()
    plan = build_plan(model, config, world)
    _, fsdp = sizes(config, world)
    device = None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    # Hybrid: fsdp groups of consecutive ranks, all-reduced across dp (TorchAcc's mesh).
    topology = resolve_topology(plan.mode, node_size=fsdp, frontend=FRONTEND,
                                device_type=device.type if device is not None else "cpu")
    sharded = shard_flat(model, plan, shard_group=topology.shard_group,
                         replicate_group=topology.replicate_group, device=device)
    wrapped = AcceleratedModel(model, sharded)
    if dataloader is None:
        return wrapped
    # Every rank is a data-parallel rank of the global batch (fsdp ranks see different data).
    dp_rank, dp_size = dist.get_rank(), world
    return wrapped, RankSliceLoader(dataloader, dp_rank, dp_size, sharded.device)
