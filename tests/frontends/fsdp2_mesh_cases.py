"""Mesh layouts of FSDP2 beyond one data-parallel dimension beside tensor parallelism, run with
native `fully_shard` and with ours in the four-rank world of fsdp2_round3_cases.py:

- HSDP with tensor parallelism through `mesh=` (torchtitan's HSDP + TP): parameters that
  `parallelize_module` made DTensors on the "tp" sub-mesh of a (dp_replicate, dp_shard, tp)
  mesh, fully_shard given `mesh=mesh["dp_replicate", "dp_shard"]`. Four ranks hold a (2, 1, 2)
  mesh (the replicas' all-reduce, each shard group of one rank) and a (1, 2, 2) one (the shard
  group's split and its strided placements): every index of the three dimensions is exercised.
- `dp_mesh_dims` (torch >= 2.12), every parameter a DTensor on the whole SPMD mesh (Replicate on
  its data-parallel dimensions, column-wise then row-wise on "tp"): a replicate dimension beside
  tensor parallelism (the SPMD spelling of HSDP + TP, on a (2, 1, 2) mesh), a replicate
  dimension with two shard names (flattened into one shard dimension of two ranks, placed after
  the replicate one: a (dp_replicate 2, dp_shard 1, cp 2) mesh), two shard names splitting the
  parameters four ways (a (2, 2) mesh), and replication alone (DDP: a (dp_replicate 2, tp 2)
  mesh). Tensor parallelism with a shard dimension of two ranks is fsdp2_round3_cases.py's
  `spmd_tensor_parallel`. (A mesh of four dimensions, to combine them all, costs DTensor's
  sharding propagation over a minute.)
- a `shard_placement_fn` under `dp_mesh_dims` giving expert weights an SPMD mesh info of their
  own (shard "efsdp" of a sparse (efsdp 2, ep 2) mesh; the dense parameters on a mesh "dp" of
  the four ranks), torchtitan's MoE layout in the SPMD spelling; FSDP2's refusals of any
  `shard_placement_fn` with replication alone and of an int `reshard_after_forward` with a
  shard dimension.

Each case records the losses, the last step's gradients (placements, local and full values),
the parameters' placements and local values, and the full state dict after three steps.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.world import device_type

STEPS = 3
GLOBAL_BATCH = 4
MESH_NAMES = ("dp_replicate", "dp_shard", "tp")


def _fsdp(which):
    return importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")


def _inputs(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // dp_size
    return batch[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device_type())


def _model() -> nn.Sequential:
    """Ten hidden features: five per tensor-parallel rank, split 3 / 2 over a shard pair."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4)).to(device_type())


def _record(model: nn.Module, step_loss) -> dict:
    """Three SGD steps (`step_loss(step)` runs a forward and returns the loss tensor; SGD
    rather than AdamW: AdamW's many operations on DTensors of a 3-D mesh each cost DTensor's
    sharding propagation, about 3 s more over this module's cases); the losses, the last
    step's gradients, the parameters and the full state dict afterwards."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, full_grads = [], {}, {}
    for step in range(STEPS):
        loss = step_loss(step)
        loss.backward()
        if step == STEPS - 1:
            for name, p in model.named_parameters():
                grads[name] = (str(p.grad.placements), p.grad.to_local().cpu().clone())
                full_grads[name] = p.grad.full_tensor().cpu()
        optim.step()
        optim.zero_grad()
        losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item())
    params = {name: (str(p.device_mesh.mesh_dim_names), str(p.placements),
                     p.to_local().cpu().clone()) for name, p in model.named_parameters()}
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "full_grads": full_grads, "params": params,
            "full": full}


def hsdp_tensor_parallel(which, shape: tuple):
    """HSDP + TP through `mesh=`: column-wise then row-wise tensor parallelism on "tp", each
    linear and the root fully_shard-ed over the (dp_replicate, dp_shard) sub-mesh."""
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=MESH_NAMES)
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp = mesh["dp_replicate", "dp_shard"]
    fully_shard = _fsdp(which).fully_shard
    fully_shard(model[0], mesh=dp)
    fully_shard(model[2], mesh=dp)
    fully_shard(model, mesh=dp)
    dp_rank = dp.get_local_rank(0) * dp.size(1) + dp.get_local_rank(1)
    return _record(model, lambda step: model(_inputs(step, dp_rank, dp.size())).pow(2).mean())


def spmd(which, shape: tuple, names: tuple, shard=None, replicate=None):
    """`dp_mesh_dims` naming `shard` / `replicate` of a mesh of `shape` and `names`: each
    parameter distributed on the whole mesh (tensor-parallel on "tp" when the mesh has it),
    the batch split over the data-parallel dimensions, each linear and the root fully_shard-ed
    with the same dp_mesh_dims."""
    fsdp = _fsdp(which)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    model = _model()
    layouts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
    for name, param in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        placements = [layouts.get(name, Replicate()) if dim == "tp" else Replicate()
                      for dim in names]
        setattr(model.get_submodule(module), attr,
                nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    dims = fsdp.DataParallelMeshDims(shard=shard, replicate=replicate)
    for layer in (model[0], model[2], model):
        fsdp.fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    data = [dim for dim in names if dim != "tp"]
    dp_rank, dp_size = 0, 1
    for dim in data:
        dp_rank, dp_size = dp_rank * mesh[dim].size() + mesh[dim].get_local_rank(), \
            dp_size * mesh[dim].size()
    batch_placements = [Replicate() if dim == "tp" else Shard(0) for dim in names]

    def step_loss(step):
        batch = DTensor.from_local(_inputs(step, dp_rank, dp_size), mesh, batch_placements)
        return model(batch).pow(2).mean()

    return _record(model, step_loss)


class _Experts(nn.Module):
    """A dense input and output layer around expert weights: each rank applies the experts it
    holds (its expert-parallel share) to its rows, so the experts live on a mesh of their own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) / 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        hidden = self.inp(x).relu()
        mine = self.experts.to_local()
        mixed = torch.einsum("bi,eio->bo", hidden.to_local(), mine)
        return self.out(DTensor.from_local(mixed, hidden.device_mesh, hidden.placements))


def spmd_experts(which):
    """`dp_mesh_dims` over a dense SPMD mesh of the four ranks ("dp"), the dense parameters
    DTensors on it; the experts DTensors on a sparse SPMD mesh (efsdp 2, ep 2), split over ep,
    that a `shard_placement_fn` gives an SPMD FSDPMeshInfo of their own (shard efsdp): sharded
    over efsdp and reduced and averaged there, as FSDP2's parameter groups."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    fsdp = _fsdp(which)
    dense = init_device_mesh(device_type(), (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = _Experts().to(device_type())
    for name, param in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        value = (distribute_tensor(param.detach(), sparse, [Replicate(), Shard(0)])
                 if name == "experts" else distribute_tensor(param.detach(), dense, [Replicate()]))
        setattr(model.get_submodule(module), attr, nn.Parameter(value))
    expert_dims = fsdp.DataParallelMeshDims(shard="efsdp")
    expert_info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0, dp_mesh_dims=expert_dims,
                               spmd_mesh=sparse)

    def placement(param):
        return ShardPlacementResult(Shard(0), expert_info) if param is model.experts else None

    dims = fsdp.DataParallelMeshDims(shard="dp")
    fsdp.fully_shard(model.inp, mesh=dense, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=dense, dp_mesh_dims=dims, shard_placement_fn=placement)
    rank = dense.get_local_rank()

    def step_loss(step):
        batch = DTensor.from_local(_inputs(step, rank, dense.size()), dense, [Shard(0)])
        return model(batch).pow(2).mean()

    return _record(model, step_loss)


def _refusal(call) -> dict:
    """The type (with its bases) and message of what `call()` raises; empty when it does not."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the result is the exception
        return {"types": [t.__name__ for t in type(error).__mro__], "message": str(error)}
    return {"types": [], "message": ""}


def refused_with_dp_mesh_dims(which):
    """What FSDP2 refuses with `dp_mesh_dims`, at fully_shard time: a `shard_placement_fn`
    when no shard dimension is named (ValueError), an int `reshard_after_forward` when one is
    (NotImplementedError). Each exception's type and message."""
    fsdp = _fsdp(which)
    # Names of its own: after this case, a case building an equal mesh saw native FSDP2's check
    # that a parameter's mesh is the very mesh fully_shard is given fail (not investigated).
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicas", "tp"))

    def replicated():  # a new module per call: a refused native call leaves its module marked
        model = nn.Linear(4, 4).to(device_type())
        for attr in ("weight", "bias"):
            value = getattr(model, attr).detach()
            setattr(model, attr, nn.Parameter(distribute_tensor(value, mesh,
                                                                [Replicate(), Replicate()])))
        return model

    return {
        "placement_fn": _refusal(lambda: fsdp.fully_shard(
            replicated(), mesh=mesh, shard_placement_fn=lambda param: None,
            dp_mesh_dims=fsdp.DataParallelMeshDims(replicate="replicas"))),
        "reshard_int": _refusal(lambda: fsdp.fully_shard(
            replicated(), mesh=mesh, reshard_after_forward=2,
            dp_mesh_dims=fsdp.DataParallelMeshDims(shard="replicas"))),
    }


def cases(both) -> dict:
    """name -> rank function, each running `fn("native")` then `fn("ours")` through `both`."""
    return {
        "hsdp_tp_replicas": both(hsdp_tensor_parallel, (2, 1, 2)),
        "hsdp_tp_shards": both(hsdp_tensor_parallel, (1, 2, 2)),
        "spmd_hsdp_tp": both(spmd, (2, 1, 2), MESH_NAMES, "dp_shard", "dp_replicate"),
        "spmd_hsdp_two_shard_names": both(spmd, (2, 1, 2), ("dp_replicate", "dp_shard", "cp"),
                                          ("dp_shard", "cp"), "dp_replicate"),
        "spmd_two_shard_names": both(spmd, (2, 2), ("dp_shard", "cp"), ("dp_shard", "cp")),
        "spmd_experts": both(spmd_experts),
        "spmd_replicate_only": both(spmd, (2, 2), ("dp_replicate", "tp"), None,
                                    "dp_replicate"),
        "refused_with_dp_mesh_dims": both(refused_with_dp_mesh_dims),
    }
