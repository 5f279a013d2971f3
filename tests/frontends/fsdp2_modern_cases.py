"""What the modern FSDP2 training stacks (torchtitan, torchtune) turn on, checked against native
`fully_shard` in one CPU/gloo world (see test_fsdp2_modern.py): transformer blocks compiled in
place with `fullgraph=True` before `fully_shard`; a root resharded after forward; a frozen
parameter of another dtype; the errors of `fully_shard`'s checks."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from tests.frontends.fsdp2_round3_cases import _both
from tests.world import device_type, run_case_table

STEPS = 3
GLOBAL_BATCH = 4
WIDTH = 8


def _fsdp(which):
    return importlib.import_module("torch.distributed.fsdp" if which == "native"
                                   else "fsdp_bridge.fsdp")


def _inputs(step: int, rank: int, world: int, width: int = WIDTH) -> torch.Tensor:
    batch = torch.randn(GLOBAL_BATCH, width, generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // world
    return batch[rank * per_rank:(rank + 1) * per_rank].to(device_type())


def _full(param) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu()


def _train(model, steps: int = STEPS, width: int = WIDTH) -> dict:
    """AdamW steps on the mean square of the output, each rank on its slice: losses and the
    full parameters after them."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = model(_inputs(step, rank, world, width)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_loss_value(loss))
    return {"losses": losses, "full": {n: _full(p) for n, p in model.named_parameters()}}


def _loss_value(loss):
    """The loss's value; both of a TwoTensor's (it runs every op on both inner tensors)."""
    from torch.testing._internal.two_tensor import TwoTensor

    return (loss.a.item(), loss.b.item()) if isinstance(loss, TwoTensor) else loss.item()


# -- per-block compile -----------------------------------------------------------------------------


class Block(nn.Module):
    """A residual MLP block, the shape of a transformer block's feed-forward half."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def per_block_compile(which, backend: str = "aot_eager"):
    """torchtitan's order: each block compiled in place (`block.compile(fullgraph=True)`),
    then `fully_shard` on each block and on the root; three AdamW steps."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Stack().to(device_type())
    for block in model.layers:
        block.compile(backend=backend, fullgraph=True)
    fully_shard = _fsdp(which).fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    out = _train(model)
    # Graphs compiled over the three steps (a recompilation per step would show here).
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


# -- torchao's float8 weights, gathered in float8 ------------------------------------------------


def _float8_model():
    """Two float8 linears (torchao, emulated on the CPU) with float8 all-gather, beside a
    plain layer norm."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model.to(device_type()), config=config)
    return model


def float8_all_gather(which, precompute: bool = False):
    """Each float8 linear fully_shard-ed, then the root; three AdamW steps (with torchtitan's
    `precompute_float8_dynamic_scale_for_fsdp` after each optimizer step if `precompute`)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model = _float8_model()
    fully_shard = _fsdp(which).fully_shard
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        loss = model(_inputs(step, rank, world, 16)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    local = model[0].weight.to_local()
    out = {"losses": losses, "local_type": type(local).__name__,
           "full": {n: _full(p) for n, p in model.named_parameters()}}
    if which == "ours":  # the bytes one forward gathers, against the parameters' fp32 bytes
        from fsdp_bridge import engine

        stats = engine.get_sharded(model).collective_stats()
        stats.reset()
        with torch.no_grad():
            model(_inputs(0, rank, world, 16))
        out["gathered_bytes"] = stats.bytes["all_gather"]
        out["fp32_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    return out


# -- NF4 weights (QLoRA) ---------------------------------------------------------------------------


class QLoRALinear(nn.Module):
    """A frozen NF4 base weight (torchao) with a trainable low-rank adapter, as torchtune's
    QLoRA linears."""

    def __init__(self, width: int = 256, rank: int = 4):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(width, width, dtype=torch.bfloat16)
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Linear(width, rank, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(rank, width, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def nf4_qlora(which):
    torch.manual_seed(0)
    model = nn.Sequential(QLoRALinear(), QLoRALinear()).to(device_type())
    fully_shard = _fsdp(which).fully_shard
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        loss = model(_inputs(step, rank, world, 256).to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "local_type": type(model[0].weight.to_local()).__name__,
            "full": {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}}


# -- hooks attached to a parameter's local tensor after fully_shard ----------------------------------


def monkey_patched_hooks(which):
    """torch's own "monkey patch" recipe: after fully_shard and materialisation, each weight's
    local tensor gets pre/post-all-gather functions that gather it in bf16; three steps."""
    from torch.autograd import _unsafe_preserve_version_counter

    calls = []

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append("pre")
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        calls.append("post")
        (tensor,) = outputs
        if out is not None:
            with _unsafe_preserve_version_counter(out):
                out.copy_(tensor)
            return None
        upcast = tensor.to(param_dtype)
        return upcast, (tensor, upcast)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack()
    fully_shard = _fsdp(which).fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device_type())
    torch.manual_seed(0)
    for param in model.parameters():
        nn.init.trunc_normal_(param)
    for name, param in model.named_parameters():
        if "weight" in name and param.ndim == 2:
            local = param._local_tensor
            local.fsdp_pre_all_gather = fsdp_pre_all_gather.__get__(local)
            local.fsdp_post_all_gather = fsdp_post_all_gather.__get__(local)
    out = _train(model)
    out["calls"] = sorted(set(calls))
    return out


# -- a subclass holding its values twice (torch's TwoTensor) ---------------------------------------


def _two_tensor_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _two_tensor_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = outputs
    if out is not None:  # the outputs are the ones `out` was built around
        return None
    return TwoTensor(a, b), (a, b)


def _gather_self(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self,), None


@torch.no_grad()
def _compute_with_output(self, outputs, metadata, param_dtype, *, out=None):
    from torch.autograd import _unsafe_preserve_version_counter

    (tensor,) = outputs
    if out is not None:
        with _unsafe_preserve_version_counter(out):
            out.copy_(tensor)
        return None
    return tensor.clone(), (tensor,)


def two_tensor(which, on_objects=False):
    """Linear weights that are torch's TwoTensor (every op runs on both inner tensors); the
    two start apart, so each one's training shows in its own numbers. Its class gets hooks
    gathering both inner tensors; or (`on_objects`) each weight's local TwoTensor object gets
    hooks after fully_shard that gather the object itself and compute with a plain tensor
    (torch's own "monkey patch" recipe on a subclass). Three AdamW steps; the losses and the
    full inner tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH, bias=False), nn.ReLU(),
                          nn.Linear(2 * WIDTH, WIDTH, bias=False))
    for layer in (model[0], model[2]):
        weight = layer.weight.detach()
        layer.weight = nn.Parameter(TwoTensor(weight.clone(), 0.5 * weight - 0.1))
    if not on_objects:
        TwoTensor.fsdp_pre_all_gather = _two_tensor_pre_all_gather
        TwoTensor.fsdp_post_all_gather = _two_tensor_post_all_gather
    try:
        fully_shard = _fsdp(which).fully_shard
        fully_shard(model[0])
        fully_shard(model)
        if on_objects:
            for layer in (model[0], model[2]):
                local = layer.weight._local_tensor
                local.fsdp_pre_all_gather = _gather_self.__get__(local)
                local.fsdp_post_all_gather = _compute_with_output.__get__(local)
        out = _train(model)
        out["full"] = {f"{name}.{part}": getattr(value, part)
                       for name, value in out["full"].items() for part in "ab"}
        out["local_type"] = type(model[0].weight.to_local()).__name__
        return out
    finally:
        if not on_objects:
            del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


# -- a parameter split unevenly, its hooks padding their inputs ---------------------------------


class BF16Gathered(torch.Tensor):
    """A weight gathered in bf16 by its hooks; the pre-hook pads this rank's rows to the full
    chunk when the split is uneven (unless `pad` is False), as FSDP2 requires. Its
    `__tensor_unflatten__` has the signature torch's own test subclass has (not the protocol's),
    so it cannot be rebuilt from its inner tensor: only through its own ops, as FSDP2 builds it."""

    @staticmethod
    def __new__(cls, data, pad=True):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(),
                                                   data.storage_offset(), dtype=data.dtype,
                                                   device=data.device)

    def __init__(self, data, pad=True):
        self._data, self._pad = data, pad

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())
        if not self._pad or self._data.size(0) == rows:
            return (self._data.to(torch.bfloat16),), None
        padded = torch.zeros(rows, *outer_size[1:], dtype=torch.bfloat16, device=self.device)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        from torch.autograd import _unsafe_preserve_version_counter

        (tensor,) = outputs
        if out is not None:  # `out` is the parameter's first rows of the padded outputs
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(tensor[: out.size(0)])
            return None
        upcast = tensor.to(param_dtype)
        return upcast, (tensor, upcast)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        import torch.utils._pytree as pytree

        pad = all(x._pad for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, cls))
        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, lambda x: cls(x, pad), out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, outer_size, outer_stride):
        return inner_tensors["_data"]


def uneven_extension(which, pad=True):
    """Weights of 9 and 3 rows over 2 ranks (chunks of 5 and 4, 2 and 1 rows), gathered
    through BF16Gathered's hooks; three AdamW steps. Unpadded (`pad=False`) only ours runs:
    native waits in its all-gather on the ranks holding full chunks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 9, bias=False), nn.ReLU(), nn.Linear(9, 3, bias=False))
    for layer in (model[0], model[2]):
        layer.weight = nn.Parameter(BF16Gathered(layer.weight.detach().clone(), pad))
    _fsdp(which).fully_shard(model)
    if not pad:
        return _raised(lambda: model(_inputs(0, dist.get_rank(), dist.get_world_size(), 3)))
    out = _train(model, width=3)
    out["local_type"] = type(model[0].weight.to_local()).__name__
    out["full"] = {name: value._data.clone() for name, value in out["full"].items()}
    return out


# -- user collectives --------------------------------------------------------------------------------


def _counting_collectives(calls: list):
    """torch's AllGather / ReduceScatter objects that count their calls and run torch's own
    collectives (what a user's NCCL-symmetric-memory or compressed collective plugs into)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class Gather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls.append("all_gather")
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)

    class Scatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            calls.append("reduce_scatter")
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)

    return Gather(), Scatter()


def custom_collectives(which):
    """Every block gathers and reduces through user collectives: their calls, three steps."""
    torch.manual_seed(0)
    model = Stack().to(device_type())
    fully_shard = _fsdp(which).fully_shard
    calls: list = []
    gather, scatter = _counting_collectives(calls)
    for block in model.layers:
        fully_shard(block)
        block.set_custom_all_gather(gather)
        block.set_custom_reduce_scatter(scatter)
    fully_shard(model)
    out = _train(model)
    out["calls"] = {kind: calls.count(kind) for kind in sorted(set(calls))}
    return out


# -- an SPMD mesh named by dp_mesh_dims ------------------------------------------------------------


def spmd_mesh_dims(which):
    """torchtitan's SPMD recipe on a 1-D mesh named "dp": parameters distributed as Replicate
    DTensors, inputs as Shard(0) DTensors, fully_shard told which dimension is data-parallel
    (torch >= 2.12); three steps, the placements and the gradients' placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_module

    fsdp = _fsdp(which)
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Stack().to(device_type())
    distribute_module(model, mesh)
    dims = fsdp.DataParallelMeshDims(shard="dp")
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        batch = DTensor.from_local(_inputs(step, rank, world), mesh, [Shard(0)])
        loss = model(batch).pow(2).mean()
        loss.backward()
        if step == 0:
            grad_placements = str(model.out.weight.grad.placements)
        optim.step()
        optim.zero_grad()
        losses.append(loss.full_tensor().item())
    return {"losses": losses, "placements": str(model.out.weight.placements),
            "grad_placements": grad_placements,
            "full": {n: _full(p) for n, p in model.named_parameters()}}


# -- a root given reshard_after_forward explicitly -------------------------------------------------


class ScaledStack(Stack):
    """A root with a parameter of its own (used by its forward) around the blocks."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return super().forward(x) * self.scale


def root_reshard(which, value):
    """The root's own parameters right after a forward (sharded DTensors when it resharded),
    then three steps."""
    torch.manual_seed(0)
    model = ScaledStack().to(device_type())
    fully_shard = _fsdp(which).fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=value)
    rank, world = dist.get_rank(), dist.get_world_size()
    model(_inputs(0, rank, world)).sum().backward()
    model.zero_grad()
    output = model(_inputs(0, rank, world))
    after = {name: type(param).__name__ for name, param in
             (("scale", model.scale), ("out.weight", model.out.weight))}
    output.sum().backward()
    model.zero_grad()
    return {"after_forward": after, **_train(model)}


# -- a frozen parameter of another dtype --------------------------------------------------------------


class FrozenLowPrecision(nn.Module):
    """A trainable fp32 linear beside a frozen bf16 weight (a frozen quantised base weight)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Parameter(torch.randn(WIDTH, WIDTH).to(torch.bfloat16),
                                   requires_grad=False)

    def forward(self, x):
        return self.lin(x) + x @ self.frozen.float()


def frozen_other_dtype(which):
    torch.manual_seed(0)
    model = FrozenLowPrecision().to(device_type())
    _fsdp(which).fully_shard(model)
    return _train(model)


class WithUnusedHead(nn.Module):
    """Two blocks and a head, beside a head the forward never calls."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.blocks(x))


def optimizer_in_backward(which):
    """The optimizer-in-backward recipe: one SGD optimizer per parameter, stepped by the
    parameter's post-accumulate-grad hook (FSDP2 calls it once the reduced gradient is set).
    A block whose parameter no backward reaches shows which parameters' hooks run."""
    torch.manual_seed(0)
    model = WithUnusedHead().to(device_type())
    fsdp = _fsdp(which)
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    calls: dict = {}
    optimizers = {}
    for name, param in model.named_parameters():
        optimizers[name] = torch.optim.SGD([param], lr=0.1)

        def step(param, name=name):
            calls[name] = calls.get(name, 0) + 1
            optimizers[name].step()
            optimizers[name].zero_grad()

        param.register_post_accumulate_grad_hook(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step_index in range(STEPS):
        loss = model(_inputs(step_index, rank, world)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return {"losses": losses, "calls": calls,
            "full": {n: _full(p) for n, p in model.named_parameters()}}


# -- the errors of fully_shard's checks -----------------------------------------------------------------


def _raised(fn) -> dict:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"types": [cls.__name__ for cls in type(error).__mro__], "message": str(error)}
    return {"types": [], "message": None}


_MESH_INFOS: list = []  # one per process: torch wants the same object for one group


def _own_mesh_placement(param):
    """A `shard_placement_fn` giving the parameter a mesh of its own (torch's
    ShardPlacementResult, what expert parallelism returns), here the world's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    if not _MESH_INFOS:
        mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
        _MESH_INFOS.append(FSDPMeshInfo(mesh, shard_mesh_dim=0))
    return ShardPlacementResult(Shard(0), _MESH_INFOS[0])


def init_errors(which):
    """What each refused fully_shard raises (natively and ours), by check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    fsdp = _fsdp(which)
    world = dist.get_world_size()
    out = {}
    mesh_3d = init_device_mesh(device_type(), (world, 1, 1))
    out["mesh_ndim"] = _raised(lambda: fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh_3d))
    unnamed_2d = init_device_mesh(device_type(), (1, world))
    out["mesh_2d_unnamed"] = _raised(lambda: fsdp.fully_shard(nn.Linear(4, 4), mesh=unnamed_2d))
    scalar = nn.Sequential(nn.Linear(4, 4))
    scalar.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    out["scalar"] = _raised(lambda: fsdp.fully_shard(scalar))
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    out["non_contiguous"] = _raised(lambda: fsdp.fully_shard(conv))
    # Split on the last dim: the weight's 3 columns do not divide over the ranks.
    out["uneven_dim1"] = _raised(lambda: fsdp.fully_shard(
        nn.Sequential(nn.Linear(3, 16)), shard_placement_fn=lambda p: Shard(p.ndim - 1)))
    out["invalid_shard_dim"] = _raised(lambda: fsdp.fully_shard(
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)), shard_placement_fn=lambda p: Shard(1)))
    out["placement_result"] = _raised(lambda: fsdp.fully_shard(
        nn.Linear(4, 4), shard_placement_fn=_own_mesh_placement))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fsdp.fully_shard(meta[0])
    fsdp.fully_shard(meta[1])
    fsdp.fully_shard(meta)
    out["meta_forward"] = _raised(lambda: meta(torch.randn(2, 8, device=device_type())))
    return out


def cases() -> dict:
    return {
        "per_block_compile": _both(per_block_compile),
        "root_reshard_true": _both(root_reshard, True),
        "root_reshard_int": _both(root_reshard, 2),
        "root_reshard_default": _both(root_reshard, None),
        "frozen_other_dtype": _both(frozen_other_dtype),
        "optimizer_in_backward": _both(optimizer_in_backward),
        "init_errors": _both(init_errors),
        "float8_all_gather": _both(float8_all_gather),
        "float8_precomputed_scale": _both(float8_all_gather, True),
        "monkey_patched_hooks": _both(monkey_patched_hooks),
        "custom_collectives": _both(custom_collectives),
        "nf4_qlora": _both(nf4_qlora),
        "spmd_mesh_dims": _both(spmd_mesh_dims),
        "two_tensor": _both(two_tensor),
        "two_tensor_hooks_on_objects": _both(two_tensor, True),
        "uneven_extension": _both(uneven_extension),
        "uneven_extension_unpadded": lambda rank, world: uneven_extension("ours", pad=False),
    }


def slow_cases() -> dict:
    """Opt-in (see test_fsdp2_modern.py): inductor compiles C++ kernels, tens of seconds."""
    return {"per_block_compile_inductor": _both(per_block_compile, "inductor")}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)


def run_slow_cases(rank, world, names=None):
    return run_case_table(slow_cases(), names)
