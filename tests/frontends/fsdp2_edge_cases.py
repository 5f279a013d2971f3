"""FSDP2 at its edges: rank functions run once with `torch.distributed.fsdp` and once with
`fsdp_bridge.fsdp` in one spawned world (see test_fsdp2_edges.py), each returning what a user
can see (losses, which parameters hold a gradient after each backward, final full parameters).

The model is a small MLP with an optional branch, so that a step can leave parameters without a
gradient: a branch not taken, a module skipped, two partial forwards.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from tests.frontends.dtensor_cases import _both
from tests.frontends.parity_cases import dialect
from tests.world import device, run_case_table

STEPS = 4
GLOBAL_BATCH = 8
DIM = 16


class Branchy(nn.Module):
    """trunk -> (aux on the steps that ask for it) -> head; `side` is a second head that only
    `side_loss` reaches."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.aux = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)
        self.side = nn.Linear(DIM, 1)

    def forward(self, x, use_aux: bool = True):
        h = self.trunk(x)
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)

    def side_loss(self, x):
        return self.side(self.trunk(x)).pow(2).mean()


def _model() -> Branchy:
    torch.manual_seed(0)
    return Branchy().to(device())


def _batch(step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    data = torch.randn(GLOBAL_BATCH, DIM, generator=torch.Generator().manual_seed(100 + step))
    per_rank = GLOBAL_BATCH // world
    return data[rank * per_rank:(rank + 1) * per_rank].to(device())


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _shard(which, model, aux_unit: bool):
    fsdp = dialect(which)
    fsdp.fully_shard(model.trunk)
    if aux_unit:
        fsdp.fully_shard(model.aux)
    fsdp.fully_shard(model)
    return model


def _global_mean(value: float, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.item() / world


def _train(model, rank, world, use_aux_on, micro_steps=1, loss_of=None, optimizer=None):
    """AdamW with weight decay by default (it moves a parameter with a zero gradient, not one
    without); the loss of step s uses the branch when `use_aux_on(s, micro)` is true, or is
    `loss_of(model, x)`. Returns losses, the names holding a gradient after each step's
    backward, and the final full parameters."""
    optim = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)))(
        model.parameters())
    losses, with_grad = [], []
    for step in range(STEPS):
        x = _batch(step, rank, world)
        chunks = x.chunk(micro_steps)
        for micro, chunk in enumerate(chunks):
            last = micro == micro_steps - 1
            if micro_steps > 1 and hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(last)
            loss = (loss_of(model, chunk) if loss_of is not None else
                    model(chunk, use_aux=use_aux_on(step, micro)).pow(2).mean()) / micro_steps
            loss.backward()
            losses.append(_global_mean(loss.item(), world))
        with_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "with_grad": with_grad,
            "state": {n: _full(p).detach().cpu().clone() for n, p in model.named_parameters()}}


def _reference(use_aux_on):
    """The single-process run on the global batch."""
    return _train(_model(), 0, 1, use_aux_on)


def some_steps(which, rank, world, aux_unit):
    """A module used on some steps only (`aux` on steps 0 and 2)."""
    return _train(_shard(which, _model(), aux_unit), rank, world, lambda s, m: s % 2 == 0)


def accumulation(which, rank, world):
    """Two micro-steps per step without gradient sync on the first: `aux` is used on one of
    them (step 0: the first, step 1: the second), or on neither (steps 2 and 3)."""
    return _train(_shard(which, _model(), aux_unit=False), rank, world,
                  lambda s, m: s < 2 and m == s, micro_steps=2)


def partial_forwards(which, rank, world):
    """Two forwards per step, each through part of the model, one backward of their sum:
    `aux` never runs, `side` does."""
    return _train(_shard(which, _model(), aux_unit=True), rank, world, None,
                  loss_of=lambda model, x: model(x, use_aux=False).pow(2).mean()
                  + model.side_loss(x))


def rank_dependent(rank, world):
    """Ours only (native FSDP2 reduce-scatters only the gradients a rank holds, so ranks that
    disagree break it): `aux` used on rank 0 alone. Every rank must end with its gradient."""
    model = _shard("ours", _model(), aux_unit=False)
    loss = model(_batch(0, rank, world), use_aux=rank == 0).pow(2).mean()
    loss.backward()
    return {"aux_has_grad": all(p.grad is not None for p in model.aux.parameters())}


def tied_across_calls(which, rank, world, siblings=False):
    """A weight tied between two modules of two fully_shard calls (the root's and an inner
    one's, or two siblings' under the root): FSDP2 shards it in each call and refuses it at
    the first forward. Returns where it raised and what the modules held before."""
    fsdp = dialect(which)
    model = _model()
    model.side.weight = model.head.weight
    calls = [model.head, model.side, model] if siblings else [model.head, model]
    try:
        for module in calls:
            fsdp.fully_shard(module)
    except ValueError as error:
        return {"raised": "ValueError", "at": "fully_shard", "message": str(error)}
    held = {"kinds": [type(m.weight).__name__ for m in (model.head, model.side)],
            "same": model.head.weight is model.side.weight}
    try:
        model(_batch(0, rank, world)).sum().backward()
    except ValueError as error:
        return {"raised": "ValueError", "at": "forward", "message": str(error), **held}
    return {"raised": None, **held}


def unused_as_zero(which, rank, world):
    """`set_reduce_scatter_unused_params(True)`: a skipped module gets a zero gradient."""
    model = _shard(which, _model(), aux_unit=False)
    model.set_reduce_scatter_unused_params(True)
    return _train(model, rank, world, lambda s, m: s % 2 == 0)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


@dataclasses.dataclass
class Inputs:
    hidden: torch.Tensor
    scale: float = 1.0


class Stack(nn.Module):
    """Three blocks; the middle one takes its input inside a dataclass."""

    def __init__(self):
        super().__init__()
        self.first = FeedForward()
        self.middle = DataclassBlock()
        self.last = FeedForward()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = x + self.first(x)
        h = h + self.middle(Inputs(h, 0.5))
        h = h + self.last(h)
        return self.head(h.to(self.head.weight.dtype))  # blocks may return another dtype


class DataclassBlock(FeedForward):
    def forward(self, inputs: Inputs):
        return super().forward(inputs.hidden) * inputs.scale


def _stack() -> Stack:
    torch.manual_seed(0)
    return Stack().to(device())


def _policy(param, reduce=None, output=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)


def per_call_precision(which, rank, world, layout):
    """`fully_shard` calls with different MixedPrecisionPolicy: `layout` names the policies."""
    fsdp = dialect(which)
    model = _stack()
    bf16, fp32 = torch.bfloat16, torch.float32
    policies = {
        # one block in fp32, the rest in bf16 (a numerically sensitive block kept high)
        "fp32_block": dict(first=_policy(bf16, fp32), middle=_policy(fp32),
                           last=_policy(bf16, fp32), root=_policy(bf16, fp32)),
        # every block's outputs cast back to fp32 (output_dtype per call)
        "output_fp32": dict(first=_policy(bf16, fp32, fp32), middle=_policy(bf16, fp32, fp32),
                            last=_policy(bf16, fp32, fp32), root=_policy(bf16, fp32, fp32)),
    }[layout]
    for name in ("first", "middle", "last"):
        fsdp.fully_shard(getattr(model, name), mp_policy=policies[name])
    fsdp.fully_shard(model, mp_policy=policies["root"])
    dtypes = {}
    for name in ("first", "middle", "last"):
        getattr(model, name).register_forward_hook(_recorder(dtypes, name, lambda out: out))
    out = _train_stack(model, rank, world)
    out["output_dtypes"] = dtypes
    return out


def _recorder(into: dict, name: str, tensor_of):
    """A forward (pre-)hook recording the dtype of `tensor_of(args or output)` under `name`."""
    def hook(module, value, *rest):
        into.setdefault(name, str(tensor_of(rest[0] if rest else value).dtype))
    return hook


def _train_stack(model, rank, world):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step, rank, world)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_global_mean(loss.item(), world))
    return {"losses": losses,
            "state": {n: _full(p).detach().cpu().clone() for n, p in model.named_parameters()}}


def list_call(which, rank, world):
    """`fully_shard([first, last])` with bf16: both modules' inputs are cast (the dtype each
    receives is recorded), and `unshard()` on the grouped module works before any forward."""
    fsdp = dialect(which)
    model = _stack()
    policy = _policy(torch.bfloat16, torch.float32)
    fsdp.fully_shard([model.first, model.last], mp_policy=policy)
    fsdp.fully_shard(model.middle, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    seen = {}
    for name in ("first", "last"):
        getattr(model, name).register_forward_pre_hook(_recorder(seen, name, lambda args: args[0]))
    model.last.unshard()
    model.last.reshard()
    out = _train_stack(model, rank, world)
    out["input_dtypes"] = seen
    return out


# The FSDPModule methods `surface` calls (not all in every torch's).
SURFACE_METHODS = ("set_post_optim_event", "set_reduce_scatter_max_input_buffers",
                   "set_separate_reduce_scatter_group",
                   "set_allocate_memory_from_process_group_for_comm")


def surface(which, rank, world):
    """What third-party code checks and calls on a fully_shard-ed module."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    fsdp = dialect(which)
    model = _model()
    outside = nn.Linear(2, 2)
    fsdp.fully_shard(model.trunk, ignored_params={outside.weight})  # outside the module
    fsdp.fully_shard(model)
    facts = {"isinstance_torch": isinstance(model, TorchFSDPModule),
             "trunk_isinstance_torch": isinstance(model.trunk, TorchFSDPModule),
             "state_of_sharded": fsdp.fully_shard.state(model.trunk) is not None,
             "state_of_plain": fsdp.fully_shard.state(model.head) is None}
    model.set_post_optim_event(torch.cpu.current_stream().record_event())  # None on the CPU
    model.set_reduce_scatter_max_input_buffers(1)
    model.set_separate_reduce_scatter_group(False)
    model.set_allocate_memory_from_process_group_for_comm(False)
    out = _train(model, rank, world, lambda s, m: True)
    # Indexing a container builds the original class (torch's FSDPModule.__new__).
    facts["sequential_slice"] = type(model.trunk[0:2]).__name__
    out["facts"] = facts
    return out


class Experts(nn.Module):
    """Expert weights of shape (experts, in, out), as MoE layers hold them, split across ranks
    on dim 1 or 2 (FSDP2's `shard_placement_fn` returning Shard(d))."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, 3)
        self.w_in = nn.Parameter(torch.randn(3, DIM, 8) * 0.2)
        self.w_out = nn.Parameter(torch.randn(3, 8, DIM) * 0.2)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        gate = torch.softmax(self.router(x), dim=-1)  # (batch, experts)
        hidden = torch.tanh(torch.einsum("bd,edh->beh", x, self.w_in))
        mixed = torch.einsum("beh,ehd,be->bd", hidden, self.w_out, gate)
        return self.head(mixed)


def shard_dims(which, rank, world):
    """Expert weights split on dims 2 and 1, a Linear's weight on dim 1, the rest on dim 0
    (uneven: 3 rows over 2 ranks): layouts, training and the sharded state dict as natively;
    a split on a dim>0 of odd size is refused, as natively."""
    from torch.distributed.tensor import Shard

    fsdp = dialect(which)
    torch.manual_seed(0)
    model = Experts().to(device())
    dims = {"w_in": 2, "w_out": 1, "router.weight": 1}
    names = {id(p): n for n, p in model.named_parameters()}

    def placement(param):
        dim = dims.get(names[id(param)])
        return None if dim is None else Shard(dim)

    fsdp.fully_shard(model, shard_placement_fn=placement)
    layouts = {n: (str(p.placements), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    out = _train_stack(model, rank, world)
    out["layouts"] = layouts
    model(_batch(0, rank, world)).pow(2).mean().backward()
    out["grads_local"] = {n: tuple(p.grad.to_local().shape) for n, p in model.named_parameters()}
    out["grads"] = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
    out["state_dict_local"] = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    try:
        odd = nn.Linear(7, DIM).to(device())  # weight (16, 7): dim 1 of odd size
        fsdp.fully_shard(odd, shard_placement_fn=lambda p: Shard(p.dim() - 1))
        out["uneven"] = None
    except NotImplementedError:
        out["uneven"] = "NotImplementedError"
    return out


def all_reduce_hook(which, rank, world):
    """A hook on the trunk's reduced shards: it records them and scales them in place (an
    in-place transform, as a hook that all-reduces over another group is). SGD, so the
    scale shows in the parameters."""
    model = _shard(which, _model(), aux_unit=False)
    seen = []

    def hook(reduced):
        seen.append(reduced.detach().clone().cpu())
        reduced.mul_(0.5)

    model.trunk.set_all_reduce_hook(hook)
    out = _train(model, rank, world, lambda s, m: True,
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    out["seen"] = seen
    return out


def _with_reference(fn, use_aux_on, **kwargs):
    def run(rank, world):
        out = _both(fn, **kwargs)(rank, world)
        out["reference"] = _reference(use_aux_on)
        return out
    return run


def cases() -> dict:
    return {
        "some_steps_in_root": _with_reference(some_steps, lambda s, m: s % 2 == 0,
                                              aux_unit=False),
        "some_steps_own_unit": _with_reference(some_steps, lambda s, m: s % 2 == 0,
                                               aux_unit=True),
        "accumulation": _both(accumulation),
        "partial_forwards": _both(partial_forwards),
        "rank_dependent": rank_dependent,
        "tied_across_calls": _both(tied_across_calls),
        "tied_across_sibling_calls": _both(tied_across_calls, siblings=True),
        "unused_as_zero": _both(unused_as_zero),
        "precision_fp32_block": _both(per_call_precision, "fp32_block"),
        "precision_output_fp32": _both(per_call_precision, "output_fp32"),
        "list_call": _both(list_call),
        "surface": _both(surface),
        "shard_dims": _both(shard_dims),
        "all_reduce_hook": _both(all_reduce_hook),
    }


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
