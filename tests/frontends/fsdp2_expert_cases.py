"""Expert parallelism beside data parallelism, native `fully_shard` against ours, in the world
of four ranks of test_fsdp2_round3.py: torchtitan's MoE recipe on a (efsdp 2, ep 2) mesh.

The expert weights are DTensors split over the expert-parallel dimension (each ep rank holds
half of the experts, as torchtitan's ExpertParallel partitions them); each block is
`fully_shard`-ed over the flattened data-parallel mesh of all four ranks with a
`shard_placement_fn` that returns a `ShardPlacementResult` naming the expert-data-parallel mesh
for the expert weights and the data-parallel mesh for the rest, as torchtitan's `apply_fsdp`
does. So a block holds two parameter groups: its dense weights sharded over four ranks, its
experts over two."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.world import device_type

STEPS = 3
WIDTH = 8
EXPERTS = 4


def _fsdp(which):
    return importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Experts(nn.Module):
    """EXPERTS two-layer experts, their weights stacked on dim 0. With expert parallelism each
    rank computes with the experts it holds (the local part of the expert-parallel DTensor),
    on its own tokens: the token exchange between ranks is left out, FSDP's part is the same."""

    def __init__(self, hidden: int = 12):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, WIDTH, hidden) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, hidden, WIDTH) * 0.3)

    def forward(self, x):
        w1, w2 = _local(self.w1), _local(self.w2)
        h = torch.einsum("td,edh->eth", x, w1).relu()
        return torch.einsum("eth,ehd->td", h, w2) / w1.shape[0]


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, WIDTH)
        self.experts = _Experts()

    def forward(self, x):
        return x + self.experts(self.router(self.norm(x)))


class _MoE(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.layers = nn.ModuleList(_MoEBlock() for _ in range(depth))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _meshes():
    """(dp: all four ranks, efsdp, ep) from one (efsdp 2, ep 2) mesh, as torchtitan slices them:
    the expert-data-parallel and expert-parallel dimensions, and their flattening."""
    sparse = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("efsdp", "ep"))
    return sparse._flatten("dp"), sparse["efsdp"], sparse["ep"]


def _build(which, divide: bool = True, hsdp_experts: bool = False):
    """The MoE model sharded as torchtitan's recipe shards it (see the module's docstring).
    `hsdp_experts`: no expert parallelism; the experts are sharded over a 2-D (replicate 2,
    shard 2) mesh of their own instead (HSDP: reduced over the shard pair, all-reduced over
    the replica pair), the rest over all four ranks."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    dp, efsdp, ep = _meshes()
    torch.manual_seed(0)
    model = _MoE().to(device_type())
    for block in model.layers if not hsdp_experts else ():  # half of the experts per ep rank
        for attr in ("w1", "w2"):
            full = getattr(block.experts, attr).detach()
            setattr(block.experts, attr, nn.Parameter(distribute_tensor(full, ep, [Shard(0)])))
    fsdp = _fsdp(which)
    dp_info = FSDPMeshInfo(dp, shard_mesh_dim=0)
    if hsdp_experts:
        hsdp = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicate", "shard"))
        efsdp_info = HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        efsdp_info = FSDPMeshInfo(efsdp, shard_mesh_dim=0)
    for block in model.layers:
        experts = set(block.experts.parameters())

        def placement(param, experts=experts):
            info = efsdp_info if param in experts else dp_info
            return ShardPlacementResult(placement=Shard(0), mesh_info=info)

        fsdp.fully_shard(block, mesh=dp, shard_placement_fn=placement)
    fsdp.fully_shard(model, mesh=dp)
    if not divide:  # torchtitan divides the loss itself (disable_fsdp_gradient_division)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model, dp, ep


def _inputs(step: int, rank: int) -> torch.Tensor:
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    return batch[rank * 2:(rank + 1) * 2].to(device_type())


def _clip_by_mesh(model) -> torch.Tensor:
    """torchtitan's gradient clipping under expert parallelism: the norm of the gradients of
    each mesh (DTensors on different meshes cannot meet in one reduction) reduced to a full
    tensor, the norms combined, and each mesh's gradients scaled by torch's helper."""
    by_mesh: dict = {}
    for param in model.parameters():
        by_mesh.setdefault(param.device_mesh, []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
             for params in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, total)
    return total


def _one_norm_over_all(model) -> dict:
    """torch's clip_grad_norm_ over every parameter at once (meshes mixed): its result, or what
    it raises."""
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"raised": type(error).__name__, "message": str(error)[:200]}
    return {"norm": _local(norm).cpu()}


def expert_parallel(which, divide: bool = True, hsdp_experts: bool = False):
    """Three AdamW steps with torchtitan's per-mesh clipping: losses, norms, the parameters'
    and gradients' placements, the full state dict."""
    model, dp, _ = _build(which, divide, hsdp_experts)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss = model(_inputs(step, dp.get_local_rank())).pow(2).mean()
        loss.backward()
        if step == 0:
            grads = {n: (str(p.grad.placements), p.grad.full_tensor().cpu())
                     for n, p in model.named_parameters()}
            all_at_once = _one_norm_over_all(model)
        norms.append(_clip_by_mesh(model).cpu())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    state = model.state_dict()
    return {"losses": losses, "norms": norms, "grads": grads, "all_at_once": all_at_once,
            "placements": {k: (str(v.device_mesh.mesh_dim_names), str(v.placements))
                           for k, v in state.items()},
            "full": {k: v.full_tensor().cpu() for k, v in state.items()}}


def _shared_directory() -> str:
    box = [tempfile.mkdtemp(prefix="fsdp_bridge_ep_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def expert_checkpoints(rank, world):
    """A DCP checkpoint of each side's trained model loaded into a fresh model of the other
    side: the loaded full state dict (expected: the saver's)."""
    directory = _shared_directory()
    saved = {}
    try:
        for which in ("native", "ours"):
            model, dp, _ = _build(which)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model(_inputs(0, dp.get_local_rank())).pow(2).mean().backward()
            optim.step()
            dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, which))
            saved[which] = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        loaded = {}
        for source, target in (("native", "ours"), ("ours", "native")):
            model, _, _ = _build(target)
            state = model.state_dict()
            dcp.load(state, checkpoint_id=os.path.join(directory, source))
            model.load_state_dict(state)
            loaded[f"{source}->{target}"] = {k: v.full_tensor().cpu()
                                             for k, v in model.state_dict().items()}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return {"saved": saved, "loaded": loaded}


def several_meshes_refuse_per_module_comms(which):
    """FSDP2 refuses a per-module collective or all-reduce hook on a module whose parameters
    span several meshes: what each setter raises."""
    model, _, _ = _build(which)
    block = model.layers[0]
    out = {}
    for method, argument in (("set_all_reduce_hook", lambda reduced: None),
                             ("set_custom_all_gather", object()),
                             ("set_custom_reduce_scatter", object())):
        try:
            getattr(block, method)(argument)
            out[method] = None
        except Exception as error:  # noqa: BLE001 - the error is the result
            out[method] = (type(error).__name__, str(error))
    return out


def hook_on_stream(which):
    """`set_all_reduce_hook(hook, stream=...)`: refused under HSDP (a 2-D mesh), run inside the
    stream without it: the error, and the stream the hook saw."""
    fsdp = _fsdp(which)
    backend = torch.get_device_module(device_type())
    stream = backend.Stream()
    hsdp = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fsdp.fully_shard(nn.Linear(4, 4).to(device_type()), mesh=hsdp)
    try:
        model.set_all_reduce_hook(lambda reduced: None, stream=stream)
        refused = None
    except ValueError as error:
        refused = str(error)
    seen = []
    model = fsdp.fully_shard(nn.Linear(4, 4).to(device_type()))
    model.set_all_reduce_hook(lambda reduced: seen.append(backend.current_stream() == stream),
                              stream=stream)
    model(torch.randn(2, 4, device=device_type())).sum().backward()
    return {"refused": refused, "inside_stream": seen}


def cases(both) -> dict:
    """The cases, each run natively and through ours by `both` (round3's runner)."""
    return {
        "expert_parallel": both(expert_parallel),
        "expert_parallel_undivided": both(expert_parallel, False),
        "experts_over_hsdp_mesh": both(expert_parallel, True, True),
        "expert_checkpoints": expert_checkpoints,
        "expert_per_module_comms": both(several_meshes_refuse_per_module_comms),
        "all_reduce_hook_stream": both(hook_on_stream),
    }
