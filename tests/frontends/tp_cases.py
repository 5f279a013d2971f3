"""FSDP over tensor parallelism, native and ours in one spawned world of 4 ranks (2 data-parallel
x 2 tensor-parallel, see test_fsdp2_edges.py): a tiny Llama's attention and MLP projections are
parallelised with `parallelize_module` (column-wise, then row-wise) on the "tp" dimension, then
every layer and the model are `fully_shard`-ed on the "dp" dimension."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests import models as M
from tests.frontends.parity_cases import dialect
from tests.native_torch import fsdp2_case
from tests.world import device_type, run_case_table

STEPS = 3
GLOBAL_BATCH = 4
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def _mesh():
    return init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))


def _parallel_llama(which, mesh):
    fsdp = dialect(which)
    model = M.tiny_llama()
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], LAYER_PLAN)
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh["dp"])
    fsdp.fully_shard(model, mesh=mesh["dp"])
    return model


def _batch(step, mesh):
    """The data-parallel rank's slice of the global batch (tensor-parallel peers share it)."""
    dp = mesh["dp"]
    return M.rank_slice(M.global_batches(STEPS, GLOBAL_BATCH)[step], dp.get_local_rank(), dp.size())


def train(which, rank, world, directory):
    mesh = _mesh()
    model = _parallel_llama(which, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    losses = []
    for step in range(STEPS):
        loss = M.lm_loss(model, _batch(step, mesh))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item(), mesh["dp"].get_group()))
    state = model.state_dict()
    out = {"losses": losses,
           "full": {k: v.full_tensor().cpu() for k, v in state.items()},
           "layouts": {k: (str(v.placements), tuple(v.to_local().shape)) for k, v in state.items()},
           "local": {k: v.to_local().cpu().clone() for k, v in state.items()}}
    folder = os.path.join(directory, which)
    dcp.save({"model": state}, checkpoint_id=folder)
    return out


def load_other(which, rank, world, directory):
    """Load the checkpoint the other implementation wrote into a fresh model of this one."""
    mesh = _mesh()
    model = _parallel_llama(which, mesh)
    state = model.state_dict()
    other = "native" if which == "ours" else "ours"
    dcp.load({"model": state}, checkpoint_id=os.path.join(directory, other))
    model.load_state_dict(state)
    return {"full": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


def _both(fn, directory):
    @fsdp2_case
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            torch.manual_seed(0)
            out[which] = fn(which, rank, world, directory)
            dist.barrier()
        return out
    return run


def run_cases(rank, world, directory):
    return run_case_table({"train": _both(train, directory),
                           "load_other": _both(load_other, directory)})
