"""Rank-side cases of test_bugs.py: what frameworks (HF Trainer, accelerate, Lightning) do to a
`fully_shard`-ed model, done natively and with ours on the same tiny models (one spawned world).

Each case returns {"native": ..., "ours": ...}; the parent compares them."""

from __future__ import annotations

import torch
from torch import nn

from tests import models as M
from tests.frontends.method_cases import _train, fsdp2_full_state
from tests.frontends.parity_cases import dialect
from tests.world import run_case_table

WHICH = ("native", "ours")


def _sharded_llama(which):
    fsdp = dialect(which)
    model = M.tiny_llama()
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def generate_after_torch_registration(rank, world):
    """HF Trainer calls torch's own register_fsdp_forward_method(model, "generate")."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    prompt = M.global_batches(1, 2)[0][:, :5]
    out = {}
    for which in WHICH:
        model = _sharded_llama(which)
        register_fsdp_forward_method(model, "generate")
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        # and training still runs after generating
        optimizer = M.make_adamw(model.parameters())
        losses = _train(model, optimizer, rank, world, range(2))
        out[which] = {"tokens": tokens, "losses": losses}
    return out


def other_private_state_is_named(rank, world):
    model = _sharded_llama("ours")
    try:
        model._get_fsdp_state()._fsdp_param_group
    except AttributeError as error:
        return str(error)
    return None


def checkpoint_wrapper_after_shard(rank, world):
    """accelerate's FSDP2 with activation checkpointing: each layer is sharded, then the
    CheckpointWrapper around it (its policy matches both), then the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    out = {}
    for which in WHICH:
        fsdp = dialect(which)
        model = M.tiny_llama()
        layers = model.model.layers
        for index, layer in enumerate(layers):
            wrapper = checkpoint_wrapper(layer, preserve_rng_state=False)
            fsdp.fully_shard(layer)
            layers[index] = wrapper
            fsdp.fully_shard(wrapper)
        fsdp.fully_shard(model)
        optimizer = M.make_adamw(model.parameters())
        losses = _train(model, optimizer, rank, world, range(3))
        out[which] = {"losses": losses, "state": fsdp2_full_state(model),
                      "classes": [type(layer).__name__ for layer in layers]}
    return out


class TwoRows(nn.Module):
    """Parameters with fewer rows than ranks: on rank 1 of 2 both local shards are empty."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)  # weight (1, 8), bias (1,)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def empty_shards_share_data_ptr(rank, world):
    """Why a mapping by data_ptr fails (the premise of the accelerate adapter's mapping)."""
    fsdp = dialect("ours")
    torch.manual_seed(0)
    model = fsdp.fully_shard(TwoRows())
    return [p.to_local().data_ptr() for p in model.head.parameters()]


def cpu_built_on_cuda_mesh(rank, world):
    """A model built on the CPU, sharded over a CUDA mesh (as a framework hands it over): its
    shards live on the mesh's device and a step runs there. Needs a CUDA device."""
    from torch.distributed.device_mesh import init_device_mesh

    fsdp = dialect("ours")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (world,))
    model = M.tiny_llama(device="cpu")
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    devices = sorted({p.to_local().device.type for p in model.parameters()})
    ids = M.global_batches(1, 2)[0].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    return {"devices": devices, "trained": all(p.grad is not None for p in model.parameters())}


CASES = {
    "generate_after_torch_registration": generate_after_torch_registration,
    "other_private_state_is_named": other_private_state_is_named,
    "checkpoint_wrapper_after_shard": checkpoint_wrapper_after_shard,
    "empty_shards_share_data_ptr": empty_shards_share_data_ptr,
}
CUDA_CASES = {"cpu_built_on_cuda_mesh": cpu_built_on_cuda_mesh}


def run_cases(rank, world, names):
    return run_case_table({**CASES, **CUDA_CASES}, names)
