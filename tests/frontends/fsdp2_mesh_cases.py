"""Mesh layouts of FSDP2 beyond one data-parallel dimension beside tensor parallelism, run with
native `fully_shard` and with ours in the four-rank world of fsdp2_round3_cases.py:

- HSDP with tensor parallelism through `mesh=` (torchtitan's HSDP + TP): parameters that
  `parallelize_module` made DTensors on the "tp" sub-mesh of a (dp_replicate, dp_shard, tp)
  mesh, fully_shard given `mesh=mesh["dp_replicate", "dp_shard"]`. Four ranks hold a (2, 1, 2)
  mesh (the replicas' all-reduce, each shard group of one rank) and a (1, 2, 2) one (the shard
  group's split and its strided placements): every index of the three dimensions is exercised.
  On the (1, 2, 2) one, torchao's float8 training with float8 all-gather and its float8
  tensor-parallel plans (torchtitan's float8 HSDP + TP), recording the mesh the weights'
  pre-all-gather hook is given.
- `dp_mesh_dims` (torch >= 2.12), every parameter a DTensor on the whole SPMD mesh (Replicate on
  its data-parallel dimensions, column-wise then row-wise on "tp"): a replicate dimension beside
  tensor parallelism (the SPMD spelling of HSDP + TP, on a (2, 1, 2) mesh), a replicate
  dimension with two shard names (flattened into one shard dimension of two ranks, placed after
  the replicate one: a (dp_replicate 2, dp_shard 1, cp 2) mesh), two shard names splitting the
  parameters four ways (a (2, 2) mesh), and replication alone (DDP: a (dp_replicate 2, tp 2)
  mesh), and HSDP on a (dp_replicate 2, dp_shard 2) mesh with a weight gathering through
  FSDP2's all-gather extension (the mesh its hook is given recorded: the shard dimension is
  not the mesh's first; a 3-D mesh would cost seconds more). Tensor parallelism with a shard
  dimension of two ranks is fsdp2_round3_cases.py's `spmd_tensor_parallel`. (A mesh of four
  dimensions, to combine them all, costs DTensor's sharding propagation over a minute.)
- a `shard_placement_fn` under `dp_mesh_dims` giving expert weights an SPMD mesh info of their
  own (shard "efsdp" of a sparse (efsdp 2, ep 2) mesh; the dense parameters on a mesh "dp" of
  the four ranks), torchtitan's MoE layout in the SPMD spelling; FSDP2's refusals of any
  `shard_placement_fn` with replication alone and of an int `reshard_after_forward` with a
  shard dimension.

Each case records the losses, the last step's gradients (placements, local and full values),
the parameters' placements and local values, and the full state dict after three steps.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Optional

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


def _inputs(step: int, dp_rank: int, dp_size: int, width: int = 6) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, width, generator=torch.Generator().manual_seed(step))
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


@contextlib.contextmanager
def _meshes_handed_to(kind: type):
    """The (ndim, dimension names, size) of every mesh `kind`'s pre-all-gather hook is given
    while the block runs (the hook is wrapped on the class for that time)."""
    seen: set = set()
    original = kind.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen.add((mesh.ndim, mesh.mesh_dim_names, mesh.size()))
        return original(self, mesh, outer_size, outer_stride, module, mp_policy)

    def recording_short(self, mesh):  # FSDP2's other signature (torchao's float8 weights)
        seen.add((mesh.ndim, mesh.mesh_dim_names, mesh.size()))
        return original(self, mesh)

    short = len(inspect.signature(original).parameters) == 2
    kind.fsdp_pre_all_gather = recording_short if short else recording
    try:
        yield seen
    finally:
        kind.fsdp_pre_all_gather = original


def hsdp_tensor_parallel_float8(which):
    """HSDP + TP with float8 all-gather, torchtitan's float8 recipe on a (1, 2, 2) mesh:
    torchao float8 training (emulated), its float8 tensor-parallel plans on "tp", each linear
    and the root fully_shard-ed over (dp_replicate, dp_shard); the meshes the float8 weights'
    pre-all-gather hook was given (FSDP2 gives it the shard dimension's)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    mesh = init_device_mesh(device_type(), (1, 2, 2), mesh_dim_names=MESH_NAMES)
    torch.manual_seed(0)
    # Biases beside the float8 weights: FSDP2 gathers a group of float8 inputs alone in
    # float8, which gloo cannot send, and mixed dtypes as bytes.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(device_type())
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config)
    parallelize_module(model, mesh["tp"], {"0": Float8ColwiseParallel(),
                                           "2": Float8RowwiseParallel()})
    dp = mesh["dp_replicate", "dp_shard"]
    fully_shard = _fsdp(which).fully_shard
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=dp)
    dp_rank = dp.get_local_rank(1)
    with _meshes_handed_to(WeightWithDynamicFloat8CastTensor) as meshes:
        out = _record(model, lambda step: model(_inputs(step, dp_rank, 2, 16)).pow(2).mean())
    return {**out, "hook_meshes": sorted(meshes)}


def spmd(which, shape: tuple, names: tuple, shard=None, replicate=None, extension=False):
    """`dp_mesh_dims` naming `shard` / `replicate` of a mesh of `shape` and `names`: each
    parameter distributed on the whole mesh (tensor-parallel on "tp" when the mesh has it),
    the batch split over the data-parallel dimensions, each linear and the root fully_shard-ed
    with the same dp_mesh_dims. With `extension`, "2.weight"'s local tensor gathers through
    FSDP2's all-gather extension (in bf16), and the meshes its pre-all-gather hook was given
    are recorded."""
    from tests.frontends.fsdp2_round3_cases import GathersInBf16

    with _meshes_handed_to(GathersInBf16) as meshes:
        out = _spmd(which, shape, names, shard, replicate, GathersInBf16 if extension else None)
    return {**out, "hook_meshes": sorted(meshes)} if extension else out


def _spmd(which, shape: tuple, names: tuple, shard, replicate, extension: Optional[type]):
    fsdp = _fsdp(which)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    model = _model()
    layouts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
    for name, param in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        placements = [layouts.get(name, Replicate()) if dim == "tp" else Replicate()
                      for dim in names]
        value = distribute_tensor(param.detach(), mesh, placements)
        if extension is not None and name == "2.weight":
            value = DTensor.from_local(extension(value.to_local()), mesh, placements,
                                       shape=value.shape, stride=value.stride())
        setattr(model.get_submodule(module), attr, nn.Parameter(value))
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
        "hsdp_tp_float8": both(hsdp_tensor_parallel_float8),
        "spmd_hsdp_tp": both(spmd, (2, 1, 2), MESH_NAMES, "dp_shard", "dp_replicate"),
        "spmd_hsdp_extension": both(spmd, (2, 2), ("dp_replicate", "dp_shard"), "dp_shard",
                                    "dp_replicate", True),
        "spmd_hsdp_two_shard_names": both(spmd, (2, 1, 2), ("dp_replicate", "dp_shard", "cp"),
                                          ("dp_shard", "cp"), "dp_replicate"),
        "spmd_two_shard_names": both(spmd, (2, 2), ("dp_shard", "cp"), ("dp_shard", "cp")),
        "spmd_experts": both(spmd_experts),
        "spmd_replicate_only": both(spmd, (2, 2), ("dp_replicate", "tp"), None,
                                    "dp_replicate"),
        "refused_with_dp_mesh_dims": both(refused_with_dp_mesh_dims),
    }
