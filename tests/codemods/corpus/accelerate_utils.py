"""accelerate-style helpers: the state-dict type comes from the plugin."""
import os

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType


def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    with FSDP.state_dict_type(
        model, fsdp_plugin.state_dict_type, fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
    ):
        state_dict = model.state_dict()
        if fsdp_plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
            if accelerator.process_index == 0:
                torch.save(state_dict, os.path.join(output_dir, "pytorch_model.bin"))
        else:
            dist_cp.save(state_dict={"model": state_dict}, checkpoint_id=output_dir)


def save_fsdp_optimizer(fsdp_plugin, model, optimizer, output_dir):
    with FSDP.state_dict_type(
        model, fsdp_plugin.state_dict_type, fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
    ):
        optim_state = FSDP.optim_state_dict(model, optimizer)
        torch.save(optim_state, os.path.join(output_dir, "optimizer.bin"))
