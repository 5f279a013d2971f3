"""FSDP2 edges checked against native `fully_shard` in one CPU/gloo world of four ranks (see
test_fsdp2_round3.py): tensor parallelism whose split is uneven across tensor-parallel ranks,
parameters that use FSDP2's all-gather extension point (trained), parameters left on meta, and a tied
weight after meta init and `load_state_dict(assign=True)`, a module of a list call run on
its own, fully_shard inside torch's composable `replicate()`, and fp16 gradient reduction."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils._pytree import tree_map

from tests.frontends import fsdp2_expert_cases, fsdp2_mesh_cases
from tests.world import device_type, run_case_table

STEPS = 3
GLOBAL_BATCH = 4


def _fully_shard(which):
    module = "torch.distributed.fsdp" if which == "native" else "fsdp_bridge.fsdp"
    return importlib.import_module(module).fully_shard


def _inputs(step: int, rank: int, world: int) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // world
    return batch[rank * per_rank:(rank + 1) * per_rank].to(device_type())


# -- tensor parallelism with an uneven split -------------------------------------------------


def _uneven_tp_model(which, mesh):
    """Two linears of 9 output features, split column-wise over 2 tensor-parallel ranks: one
    rank holds 5 rows of each weight, its peer 4."""
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 9)).to(device_type())
    plan = {"0": ColwiseParallel(output_layouts=Replicate()),
            "2": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], plan)
    _fully_shard(which)(model, mesh=mesh["dp"])
    return model


def uneven_tensor_parallel(which):
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    model = _uneven_tp_model(which, mesh)
    losses = _train_over_dp(model, mesh["dp"])
    state = model.state_dict()
    return {"losses": losses,
            "local_shapes": {k: tuple(v.to_local().shape) for k, v in state.items()},
            "full": {k: v.full_tensor().cpu() for k, v in state.items()}}


def _train_over_dp(model, dp, after_step=lambda: None) -> list:
    """Three AdamW steps on the mean square of the output, each data-parallel rank on its
    slice (`after_step` runs after each optimizer step): the losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(_inputs(step, dp.get_local_rank(), dp.size())).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        after_step()
        losses.append(loss.item())
    return losses


# -- the all-gather extension point ------------------------------------------------------------


class GathersInBf16(torch.Tensor):
    """A weight that chooses to be gathered in bf16, through FSDP2's extension methods (what
    torchao's float8 and NF4 weights do with their own formats). A wrapper subclass, so that its
    shards stay of this type through the chunking FSDP2 does. `calls` counts the hook calls."""

    calls: list = []

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype,
                                                   device=data.device, strides=data.stride(),
                                                   requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    def __repr__(self):
        return f"GathersInBf16({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return GathersInBf16(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data if isinstance(t, GathersInBf16) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: GathersInBf16(t) if isinstance(t, torch.Tensor) else t, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        GathersInBf16.calls.append("pre")
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        GathersInBf16.calls.append("post")
        (gathered,) = outputs
        if out is not None:
            return None
        return gathered.to(param_dtype), (gathered,)


def _extension_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4)).to(device_type())
    model[0].weight = nn.Parameter(GathersInBf16(model[0].weight.detach().clone()))
    return model


def all_gather_extension(which, mesh_shape):
    """model[0].weight gathers through its extension hooks: the hook calls, and three AdamW
    steps' losses and final weights."""
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh(device_type(), mesh_shape, mesh_dim_names=names)
    model = _extension_model()
    GathersInBf16.calls = []
    fully_shard = _fully_shard(which)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    output = model(_inputs(0, rank, world))
    out = {"output": output.detach().cpu(), "calls": sorted(set(GathersInBf16.calls)),
           "local_type": type(model[0].weight.to_local()).__name__}
    output.pow(2).mean().backward()  # the parameters are sharded again after backward
    model.zero_grad()
    out["losses"] = _train_mse(model)
    out["full"] = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return out


def plain_output():
    """The first forward without FSDP: what a gather that skipped the hooks computes."""
    model = _extension_model()
    return model(_inputs(0, dist.get_rank(), dist.get_world_size())).detach().cpu()


# -- parameters left on meta ---------------------------------------------------------------------


def _meta_model(which):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    fully_shard = _fully_shard(which)
    fully_shard(model[0])
    fully_shard(model)
    return model


def _initialise_and_train(model):
    model.to_empty(device=device_type())
    torch.manual_seed(0)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    return _train_mse(model)


def _train_mse(model) -> list:
    """Three AdamW steps on the mean square of the output, each rank on its slice: the losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        loss = model(_inputs(step, rank, world)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def meta_never_loaded(which):
    """A model built on meta and sharded, used before its parameters were materialised: the
    error. Ours then still trains once initialised (native's state is broken by the error)."""
    model = _meta_model(which)
    try:
        model(_inputs(0, dist.get_rank(), dist.get_world_size()))
        return {"error": None}
    except RuntimeError as raised:
        error = str(raised)
    return {"error": error, "losses": _initialise_and_train(model) if which == "ours" else None}


def meta_initialised(which):
    """The same model initialised before its first use: the recipe's training."""
    return {"losses": _initialise_and_train(_meta_model(which))}


# -- a tied weight after meta init and loading --------------------------------------------------


class TiedHead(nn.Module):
    """An embedding whose weight the output layer shares (GPT-2's and many Llamas' tie)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


def tied_after_assign_load(which):
    """Built on meta, sharded, then loaded with `load_state_dict(sharded, assign=True)` (which
    unties the weight): the embedding's gradient and the weights over three steps."""
    torch.manual_seed(0)
    full = TiedHead().to(device_type()).state_dict()
    with torch.device("meta"):
        model = TiedHead()
    fully_shard = _fully_shard(which)
    fully_shard(model.mid)
    fully_shard(model)
    layout = model.state_dict()
    model.load_state_dict({key: distribute_tensor(value, layout[key].device_mesh,
                                                  layout[key].placements)
                           for key, value in full.items()}, assign=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = []
    for step in range(STEPS):
        ids = torch.randint(0, 16, (GLOBAL_BATCH, 5), generator=torch.Generator().manual_seed(step))
        ids = ids[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
        model(ids.to(device_type())).logsumexp(-1).mean().backward()
        grads.append(model.embed.weight.grad.full_tensor().cpu())
        optim.step()
        optim.zero_grad()
    return {"grads": grads, "tied": model.head.weight is model.embed.weight,
            "full": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


# -- a module of a list call run on its own ------------------------------------------------------


class ChunkedHead(nn.Module):
    """The forward stops before the head: the loss calls `head` on chunks of the output (a
    chunked cross-entropy)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        return self.norm(self.trunk(x))


def list_call_member_alone(which):
    """`fully_shard([norm, head])`; each chunk's loss runs `head` by itself and backpropagates
    (retaining the trunk's graph), so `head` runs after a backward: losses, weights."""
    torch.manual_seed(0)
    model = ChunkedHead().to(device_type())
    fully_shard = _fully_shard(which)
    fully_shard(model.trunk)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        hidden = model(_inputs(step, rank, world))
        total = 0.0
        for chunk in hidden.split(1):
            loss = model.head(chunk).logsumexp(-1).mean()
            loss.backward(retain_graph=True)
            total += loss.item()
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return {"losses": losses,
            "full": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


# -- fully_shard inside torch's replicate() -------------------------------------------------------


def inside_replicate(which):
    """Two fully_shard-ed layers and a last layer of the root's own, the whole under torch's
    composable `replicate()` (DDP for what FSDP does not manage): losses, weights, and the
    parameter types after training."""
    from torch.distributed._composable.replicate import replicate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    model = model.to(device_type())
    fully_shard = _fully_shard(which)
    fully_shard(model[0])
    fully_shard(model[2])
    replicate(model)
    losses = _train_mse(model)
    return {"losses": losses,
            "types": [type(p).__name__ for p in model.parameters()],
            "weights": [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                        for p in model.parameters()]}


# -- fp16 gradient reduction -------------------------------------------------------------------------


def fp16_reduction(which, mesh_shape, dtype=torch.float16, hook=False):
    """fp16 (or `dtype`) parameters and reduction over 10 SGD steps on a 1-D or a 2-D (HSDP)
    mesh, with an all-reduce hook on model[0] that halves its reduced shards if `hook`: the
    fp32 weights after them."""
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh(device_type(), mesh_shape, mesh_dim_names=names)
    module = importlib.import_module("torch.distributed.fsdp" if which == "native"
                                     else "fsdp_bridge.fsdp")
    policy = module.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 8)).to(device_type())
    module.fully_shard(model[0], mesh=mesh, mp_policy=policy)
    module.fully_shard(model, mesh=mesh, mp_policy=policy)
    if hook:
        model[0].set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(10):
        model(_inputs(step, rank, world)).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return {"full": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


# -- parameters a gathered unit exposes ------------------------------------------------------------


class _ScaledMLP(nn.Module):
    """A root with a parameter of its own around three layers."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.layers(x) * self.scale


def _describe(tensor) -> str:
    """A tensor's class, whether it counts as a Parameter, and its shape as seen by the user."""
    from torch.distributed.tensor import DTensor

    kind = "DTensor" if isinstance(tensor, DTensor) else type(tensor).__name__
    marked = "+Parameter" if isinstance(tensor, nn.Parameter) else ""
    return f"{kind}{marked}{tuple(tensor.shape)}"


def _exposed(model) -> dict:
    """What attribute access and named_parameters() give for every parameter, right now."""
    seen = {name: _describe(p) for name, p in model.named_parameters()}
    seen["attr:layers.0.weight"] = _describe(model.layers[0].weight)
    seen["attr:layers.2.weight"] = _describe(model.layers[2].weight)
    seen["attr:scale"] = _describe(model.scale)
    return seen


def unsharded_parameters_exposed(which):
    """layers[0] stays gathered after its forward (reshard_after_forward=False), layers[2]
    reshards, the root stays gathered: the parameters seen inside the forward, between forward
    and backward (also after an explicit unshard and in a state_dict taken there), and after
    backward; a loss term reading a gathered weight between forward and backward trains it."""
    fully_shard = _fully_shard(which)
    model = _ScaledMLP().to(device_type())
    fully_shard(model.layers[0], reshard_after_forward=False)
    fully_shard(model.layers[2])
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inside = []
    model.layers[1].register_forward_hook(lambda *args: inside.append(_exposed(model)))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"losses": []}
    for step in range(STEPS):
        output = model(_inputs(step, rank, world))
        loss = output.pow(2).mean() + 1e-2 * model.layers[0].weight.pow(2).sum()
        if step == 0:
            out["after_forward"] = _exposed(model)
            model.layers[2].unshard()
            out["after_unshard"] = _exposed(model)
        loss.backward()
        if step == 0:
            out["after_backward"] = _exposed(model)
        optim.step()
        optim.zero_grad()
        out["losses"].append(loss.item())
    out["inside_forward"] = inside[0]
    out["full"] = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return out


def state_dict_after_eval_forward(which):
    """A forward without gradients leaves the root and layers[0] gathered; a state dict taken
    then is one of sharded DTensors, loads back, and training goes on as natively."""
    fully_shard = _fully_shard(which)
    model = _ScaledMLP().to(device_type())
    fully_shard(model.layers[0], reshard_after_forward=False)
    fully_shard(model.layers[2])
    fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        model(_inputs(0, rank, world))
    out = {"after_eval": _exposed(model)}
    state = model.state_dict()
    out["state_dict"] = {k: _describe(v) for k, v in state.items()}
    out["after_state_dict"] = _exposed(model)
    model.load_state_dict(state)
    out["losses"] = _train_mse(model)
    out["full"] = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return out


def after_forward_methods(which):
    """A registered forward method that runs the forward inside it (as `generate` does) ends
    with the root's sharded parameters registered, as natively (registered with torch's
    function, and with ours for ours); a plain forward without gradients leaves them gathered."""
    from torch.distributed.fsdp import register_fsdp_forward_method as torchs

    registers = {"torch": torchs}
    if which == "ours":
        from fsdp_bridge.fsdp import register_fsdp_forward_method as ours

        registers["ours"] = ours
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, register in registers.items():
        model = _ScaledMLP().to(device_type())
        fully_shard = _fully_shard(which)
        fully_shard(model.layers[0])
        fully_shard(model)
        model.twice = lambda x, model=model: model(x) + model(x)
        register(model, "twice")
        with torch.no_grad():
            model.twice(_inputs(0, rank, world))
            out[f"{label}: after method"] = _exposed(model)
            model(_inputs(0, rank, world))
            out[f"{label}: after forward"] = _exposed(model)
    return out


# -- a torchtitan-shaped training: TP x FSDP, float8 all-gather, per-block compile ----------------


class _Block(nn.Module):
    """A transformer block's feed-forward half: norm, up and down projections, residual."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Tower(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def torchtitan_shaped(which):
    """torchtitan's order on a (dp 2, tp 2) mesh: float8 training with float8 all-gather
    (torchao, emulated), tensor parallelism on each block's projections (torchao's float8
    plans), each block compiled in place (`fullgraph=True`, aot_eager), then fully_shard on
    each block and the root over dp; three AdamW steps with the float8 scales precomputed after
    each, as torchtitan does."""
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    torch._dynamo.reset()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _Tower().to(device_type())
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: fqn.startswith("layers"))
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"up": Float8ColwiseParallel(),
                                               "down": Float8RowwiseParallel()})
        block.compile(backend="aot_eager", fullgraph=True)
    fully_shard = _fully_shard(which)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    losses = _train_over_dp(model, mesh["dp"],
                            lambda: precompute_float8_dynamic_scale_for_fsdp(model))
    up = model.layers[0].up.weight
    return {"losses": losses, "up": (str(up.placements), type(up.to_local()).__name__),
            "full": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}}


# -- dp_mesh_dims on a (dp, tp) SPMD mesh ------------------------------------------------------------


def spmd_tensor_parallel(which):
    """torchtitan's SPMD backend on a (dp 2, tp 2) mesh: every parameter a DTensor on the whole
    mesh (Replicate on dp; column-wise then row-wise on tp), inputs Shard(0) on dp, fully_shard
    told the data-parallel dimension (torch >= 2.12): placements, three steps."""
    from torch.distributed.tensor import DTensor, Shard

    fsdp = importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).to(device_type())
    layouts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
    for name, param in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        placements = [Replicate(), layouts.get(name, Replicate())]
        setattr(model.get_submodule(module), attr,
                nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    dims = fsdp.DataParallelMeshDims(shard="dp")
    fsdp.fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp"]
    losses = []
    for step in range(STEPS):
        batch = DTensor.from_local(_inputs(step, dp.get_local_rank(), dp.size()), mesh,
                                   [Shard(0), Replicate()])
        loss = model(batch).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.full_tensor().item())
    state = model.state_dict()
    return {"losses": losses, "placements": {k: str(v.placements) for k, v in state.items()},
            "full": {k: v.full_tensor().cpu() for k, v in state.items()}}


def _both(fn, *args):
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            torch.manual_seed(0)
            out[which] = fn(which, *args)
            dist.barrier()
        return out
    return run


def cases() -> dict:
    return {
        "uneven_tensor_parallel": _both(uneven_tensor_parallel),
        "extension_1d": _both(all_gather_extension, (4,)),
        "extension_2d": _both(all_gather_extension, (2, 2)),
        "plain_output": lambda rank, world: plain_output(),
        "meta_never_loaded": _both(meta_never_loaded),
        "meta_initialised": _both(meta_initialised),
        "tied_after_assign_load": _both(tied_after_assign_load),
        "list_call_member_alone": _both(list_call_member_alone),
        "inside_replicate": _both(inside_replicate),
        "fp16_reduction_1d": _both(fp16_reduction, (4,)),
        "fp16_reduction_2d": _both(fp16_reduction, (2, 2)),
        "fp16_reduction_hook": _both(fp16_reduction, (4,), torch.float16, True),
        "fp32_reduction_hook": _both(fp16_reduction, (4,), torch.float32, True),
        "unsharded_parameters_exposed": _both(unsharded_parameters_exposed),
        "state_dict_after_eval_forward": _both(state_dict_after_eval_forward),
        "after_forward_methods": _both(after_forward_methods),
        "torchtitan_shaped": _both(torchtitan_shaped),
        "spmd_tensor_parallel": _both(spmd_tensor_parallel),
        **fsdp2_expert_cases.cases(_both),
        **fsdp2_mesh_cases.cases(_both),
    }


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
