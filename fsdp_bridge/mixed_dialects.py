"""One sharding dialect per model: wrappers of different dialects are refused, not mixed.

[Note: one dialect per model]
Each wrapper keeps its own sharded state: fsdp_bridge's (FullyShardedDataParallel, fully_shard,
YaFSDP, Zeta's fsdp, TorchAcc's accelerate, all over one engine with their own layouts) and
torch's (FSDP1's FullyShardedDataParallel, FSDP2's fully_shard). A wrapper of one dialect
around a module another one already wraps takes the inner shards for whole parameters: it
flattens, re-shards or gathers pieces that are not the model's tensors, and fails deep inside
(torch's "got mixed torch.Tensor and DTensor", a wrong "ranks disagree"), hangs, or trains on
wrong values. So:

- Every front-end of ours, before it changes the model or communicates, walks the module it is
  given and refuses a wrapper of another dialect inside it (`refuse_other_dialects`). The walk
  is local and the same on every rank, so every rank raises the same error and none is left
  waiting in a collective. Nesting inside one dialect is kept where the dialect has it
  (FullyShardedDataParallel inside FullyShardedDataParallel, fully_shard inside fully_shard).
- torch's wrappers run no code of ours when they wrap around ours, so our flat-layout wrappers
  (FullyShardedDataParallel, YaFSDP, Zeta, TorchAcc) refuse them at each forward, before their
  first gather (`refuse_taken_over`). torch's FSDP1 leaves our parameters alone, since they
  carry its own mark of parameters another FSDP unit already flattened (see [Note: flattened,
  as torch's FSDP1 reads it] in engine/flat_group.py), so its gathers complete on every rank;
  our forward then finds torch's FSDP1 forward on the call stack, around the module we shard
  (our fully_shard looks the same way when its first forward builds the sharding). torch's
  fully_shard replaces our flat-layout parameters by its own, which the forward finds too.
- Around our fully_shard, torch's fully_shard fails in its own wrap on every rank with torch's
  message (it takes our DTensor parameters for tensor-parallel ones); that message cannot be
  ours without patching torch.

[Note: checks outside the compiled graph]
The checks that run at a forward run under torch.compile too: each is a
`torch.compiler.disable`d function, which Dynamo never traces. A compiled forward (the whole
model, or each block compiled in place) breaks its graph there and calls the check eagerly,
every time, as an eager forward does, so a compiled model is refused at its first forward on
every rank, before any optimizer step. Traced instead, a check would run once, at compile
time, or not at all (a skipped check let torch's wrappers around ours train on wrong values).
The stack walk of `refuse_torch_fsdp1_around` finds torch's FSDP1 forward there: Dynamo does
not trace torch's FSDP1, which runs as ordinary Python frames. An eager forward pays the
decorator's few microseconds per call. Under `fullgraph=True` a graph break is an error, so
such a compile of a module whose forward runs a check stops with Dynamo's own error.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1

from fsdp_bridge import engine
from fsdp_bridge.translation import Shown, bad_argument

# The `_frontend` of each wrapper of ours -> the call users write.
OURS = {
    "FullyShardedDataParallel": "fsdp_bridge.fsdp.FullyShardedDataParallel",
    "fully_shard": "fsdp_bridge.fsdp.fully_shard",
    "YaFSDP": "fsdp_bridge.ya_fsdp.YaFSDP",
    "zeta.fsdp": "fsdp_bridge.zeta.fsdp",
    "torchacc.Config": "fsdp_bridge.torchacc.accelerate",
}
# The front-ends that adopt wrappers of their own dialect nested inside (as natively).
NESTING = {"FullyShardedDataParallel", "fully_shard"}
TORCH_FSDP1 = "torch.distributed.fsdp.FullyShardedDataParallel"
TORCH_FULLY_SHARD = "torch.distributed.fsdp.fully_shard"


def dialect_of(module: nn.Module) -> Optional[str]:
    """The wrapper that manages `module` itself (as users call it), or None."""
    # Read on the class: our wrappers hand unknown attributes on to the module they wrap.
    frontend = getattr(type(module), "_frontend", None)
    if frontend in OURS:
        return OURS[frontend]
    if isinstance(module, TorchFSDP1):
        return TORCH_FSDP1
    if isinstance(module, TorchFSDPModule):
        return TORCH_FULLY_SHARD
    return None


@torch.compiler.disable  # see [Note: checks outside the compiled graph]
def refuse_other_dialects(frontend: str, module: nn.Module) -> None:
    """Before `frontend` (a key of OURS) wraps `module`: refuse any wrapper of another dialect
    in it, and, for a front-end without nesting, a second wrapper of its own; also a module
    inside a model another of our dialects already shards (the outer one wrapped first)."""
    outer = OURS.get(frontend, frontend)
    _refuse_wrappers_inside(frontend, outer, module)
    for name, param in _sharded_tensors(module):
        owner = engine.owner_of(param)
        inner = OURS.get(owner.plan.frontend, owner.plan.frontend) if owner else outer
        if inner != outer:
            found = Shown(f"a module inside the {type(owner.module).__name__} that {inner} "
                          f"already shards (its parameter {name!r})")
            raise _mixed(outer, inner, found)


def _sharded_tensors(module: nn.Module):
    """(name, tensor) for the parameters of `module`, and for the tensors its modules hold in
    place of parameters flattened into a unit's flat parameter (FSDP1's `use_orig_params=False`
    de-registers them: see engine/flat_params.py)."""
    yield from module.named_parameters()
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and engine.owner_of(value) is not None:
                yield (f"{path}.{attr}" if path else attr), value


def _mixed(outer: str, inner: str, found: Shown) -> ValueError:
    return bad_argument(
        outer, "module", found, f"a model sharded by one dialect: {outer} cannot shard "
        f"together with {inner} (each keeps its own shards, and one would flatten or gather "
        "the other's)", f"Use {outer} for every layer and the root, or {inner} for every layer "
        "and the root.")


def _refuse_wrappers_inside(frontend: str, outer: str, module: nn.Module) -> None:
    for path, sub in module.named_modules():
        inner = dialect_of(sub)
        if inner is None or (inner == outer and (not path or frontend in NESTING)):
            continue  # the module itself wrapped twice: each front-end's own check says so
        where = f"submodule {path!r}" if path else "the module itself"
        found = Shown(f"a model whose {where} ({type(sub).__name__}) is wrapped by {inner}")
        if inner == outer:
            raise bad_argument(outer, "module", found, f"a model {outer} has not wrapped yet "
                               "(it wraps a whole model once)", f"Call {outer} once, on the "
                               "whole model; its own options choose the units inside it.")
        raise _mixed(outer, inner, found)


@torch.compiler.disable  # see [Note: checks outside the compiled graph]
def refuse_taken_over(frontend: str, sharded) -> None:
    """At a forward of a flat-layout wrapper of ours: refuse, on every rank, a model whose
    parameters a torch wrapper applied around it has taken over (see [Note: one dialect per
    model])."""
    refuse_torch_fsdp1_around(frontend, sharded.module)
    found = engine.displaced_parameter(sharded)
    if found is None:
        return
    fqn, now = found
    outer = TORCH_FULLY_SHARD if isinstance(now, nn.Parameter) else TORCH_FSDP1
    state = ("gone from its module" if now is None
             else f"replaced by a {type(now).__name__} of shape {tuple(now.shape)}")
    ours = OURS.get(frontend, frontend)
    raise RuntimeError(
        f"{ours}: parameter {fqn!r} of the {type(sharded.module).__name__} it shards is "
        f"{state}, no longer the one {ours} shards. {outer} applied around this model does "
        f"that (it takes over the parameters {ours} already shards, and the two would gather "
        "and reduce each other's shards); so does assigning a new parameter after wrapping. "
        f"A model is sharded by one dialect: use {ours} for every layer and the root, or "
        f"{outer} for every layer and the root; assign parameters before wrapping.")


# The code object of torch FSDP1's forward, to find it on the call stack.
_TORCH_FSDP1_FORWARD = inspect.unwrap(TorchFSDP1.forward).__code__


@torch.compiler.disable  # see [Note: checks outside the compiled graph]
def refuse_torch_fsdp1_around(frontend: str, module: nn.Module) -> None:
    """Refuse a forward of ours that torch's FSDP1 forward calls around `module`. torch's FSDP1
    leaves our parameters alone when it wraps (they are marked flattened), so nothing of ours
    runs until this forward, and nothing in the model says torch's wrapper is around it: its
    forward, on this thread's call stack, is what does. The walk compares code objects only;
    a frame of torch's forward is looked into only when one is found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _TORCH_FSDP1_FORWARD:
            outer = frame.f_locals.get("self")
            if isinstance(outer, TorchFSDP1) and any(sub is module for sub in outer.modules()):
                ours = OURS.get(frontend, frontend)
                raise RuntimeError(
                    f"{ours}: the {type(module).__name__} it shards runs inside {TORCH_FSDP1} "
                    f"(its forward called this one). The two would each gather and reduce "
                    f"their own shards of one model, and torch's state dicts and "
                    f"clip_grad_norm_ would take {ours}'s shards for whole parameters. A model "
                    f"is sharded by one dialect: use {ours} for every layer and the root, or "
                    f"{TORCH_FSDP1} for every layer and the root.")
        frame = frame.f_back
