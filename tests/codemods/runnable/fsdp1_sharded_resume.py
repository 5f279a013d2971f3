"""A runnable FSDP1 fixture with the sharded resume of FSDP1's recipes: model and optimizer saved
in one DCP checkpoint under SHARDED_STATE_DICT, then read back with
`load_sharded_optimizer_state_dict` and `FSDP.optim_state_dict_to_load`, once as a static method
and once reached through the model inside an `isinstance(model, FSDP)` branch; then the model
alone, with a load_state_dict form the migration leaves under a TODO. Training goes on after each
resume from the same batches: the losses after a resume repeat those after the save exactly when
model and optimizer both came back."""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from torch import nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def save(model, optimizer, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        dist_cp.save(state, checkpoint_id=folder)


def resume(model, optimizer, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dist_cp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"], optimizer_key="optim", storage_reader=dist_cp.FileSystemReader(folder))
        flattened = FSDP.optim_state_dict_to_load(model, optimizer, optim_state["optim"])
        optimizer.load_state_dict(flattened)


def resume_through_the_model(model, optimizer, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dist_cp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        loaded = dist_cp.load_sharded_optimizer_state_dict(state["model"], "optim", dist_cp.FileSystemReader(folder))
        if isinstance(model, FSDP):
            optimizer.load_state_dict(model.optim_state_dict_to_load(model, optimizer, loaded["optim"]))


def reload_model_only(model, folder):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dist_cp.load(state, checkpoint_id=folder)
        # A form the migration leaves under a TODO, which names the setting it ran under.
        model.load_state_dict(state["model"], strict=True, assign=False)


def train(rank, reload_model=False):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    losses = []

    def step(batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))

    step(batches[0])
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    save(model, optimizer, folder[0])
    step(batches[1])
    step(batches[2])
    resume(model, optimizer, folder[0])
    step(batches[1])
    step(batches[2])
    resume_through_the_model(model, optimizer, folder[0])
    step(batches[1])
    step(batches[2])
    if reload_model:  # under --to fsdp2 the TODO'd call still loads FSDP2's sharded state dict
        reload_model_only(model, folder[0])
        step(batches[1])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    return {"losses": losses}
