"""Checkpoint handler with a full (rank 0) branch and a sharded (DCP) branch."""
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

fullstate_save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)


def save_model_checkpoint(model, path):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, fullstate_save_policy):
        cpu_state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(cpu_state, path)


def save_model_sharded(model, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        dist_cp.save_state_dict(state_dict=state_dict, storage_writer=FileSystemWriter(folder))


def load_model_sharded(model, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        checkpoint = {"model": model.state_dict()}
        dist_cp.load_state_dict(state_dict=checkpoint, storage_reader=FileSystemReader(folder))
        model.load_state_dict(checkpoint["model"])
