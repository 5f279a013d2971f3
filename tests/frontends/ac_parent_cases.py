"""State dicts of a wrapped model that is not the root, against native FSDP1, in one CPU/gloo
world of two ranks (see test_ac_parent.py): torch's `checkpoint_wrapper` around the whole
wrapped model (its blocks checkpointed too), and a plain module holding the wrapped model
beside a module of its own.

The parent's own `state_dict()` / `load_state_dict()` (FULL, SHARDED through DCP, LOCAL) and
torch's get_/set_state_dict through DCP are saved from each side and loaded into each side;
a case returns the keys written and what each target then holds.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.frontends import ac_state_dict_cases as C
from tests.world import run_case_table

SHAPES = ("checkpointed_root", "held")
PAIRS = [(source, target) for source in C.SIDES for target in C.SIDES]


class Holder(nn.Module):
    """A plain root holding the wrapped net (`body`) beside a module of its own."""

    def __init__(self, body: nn.Module, extra: nn.Module):
        super().__init__()
        self.body = body
        self.extra = extra

    def forward(self, x):
        return self.extra(self.body(x))


def reference(shape: str, seed: int) -> dict:
    model = _unwrapped(shape, seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unwrapped(shape: str, seed: int, wrap=lambda net: net) -> nn.Module:
    torch.manual_seed(seed)
    net = C.Net()
    extra = nn.Linear(8, 8)
    if shape == "held":
        return Holder(wrap(net), extra)
    return checkpoint_wrapper(wrap(C._checkpointed(net)))


def build(side: str, shape: str, seed: int):
    """The shape's model around a `side` wrap of the net ("native", "ours" or "yafsdp"),
    stepped once (lr=0)."""
    def wrap(net):
        if side == "yafsdp":
            return C._wrap("yafsdp", net)
        return C.fsdp_class(side)(net, auto_wrap_policy=ModuleWrapPolicy({C.Block}),
                                  device_id=torch.device("cpu"), use_orig_params=True)

    model = _unwrapped(shape, seed, wrap)
    optim = torch.optim.Adam(model.parameters(), lr=0.0)
    model(torch.arange(16.0).reshape(2, 8) / 16 * seed).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def fsdp_of(model):
    native = C.fsdp_class("native")
    return native if any(isinstance(m, native) for m in model.modules()) else C.fsdp_class("ours")


def held(model) -> dict:
    """The whole parameters the model holds, under the unwrapped model's names."""
    with fsdp_of(model).summon_full_params(model, writeback=False):
        return {C.clean(n): p.detach().clone() for n, p in model.named_parameters()}


def _optim_full(model, optim) -> dict:
    return C.tensors(get_optimizer_state_dict(model, optim,
                                              options=StateDictOptions(full_state_dict=True)))


def own_api(shape: str, kind: str, directory: str) -> dict:
    """The parent's state_dict() under FSDP.state_dict_type(parent, kind), each side's loaded
    into each side's fresh model by the parent's load_state_dict (SHARDED through DCP)."""
    state_type = StateDictType[f"{kind}_STATE_DICT"]
    out = {"reference": reference(shape, 1)}
    saved = {}
    for side in C.SIDES:
        model, _ = build(side, shape, 1)
        with fsdp_of(model).state_dict_type(model, state_type):
            saved[side] = model.state_dict()
        out[side] = C.tensors(saved[side])
        if kind == "SHARDED":
            dcp.save(saved[side], checkpoint_id=_path(directory, shape, kind, side))
    for source, target in PAIRS:
        if kind == "LOCAL" and (source, target) != ("ours", "ours"):
            # LOCAL loads only into a model wrapped the same way (ours' keys are our own), and
            # native FSDP1 does not load its own through a parent ("Unexpected key(s) in
            # state_dict: "_flat_param", ...").
            continue
        model, _ = build(target, shape, 2)
        with fsdp_of(model).state_dict_type(model, state_type):
            state = saved[source]
            if kind == "SHARDED":
                state = model.state_dict()
                dcp.load(state, checkpoint_id=_path(directory, shape, kind, source))
            result = model.load_state_dict(state)
        out[f"{source}->{target}"] = {"model": held(model), "result": tuple(map(list, result))}
    return out


def native_cannot_load_optim(shape: str, target: str) -> bool:
    """torch's set_state_dict refuses optimizer state for native FSDP1 under
    `checkpoint_wrapper`, its own included ("Missing optimizer state for parameter
    '_fsdp_wrapped_module.embed.weight'"): only the model is loaded into it then."""
    return shape == "checkpointed_root" and target == "native"


def helpers(shape: str, directory: str) -> dict:
    """torch's get_state_dict (sharded) through DCP, each side's loaded into each side."""
    out = {"reference": reference(shape, 1)}
    for side in C.SIDES:
        model, optim = build(side, shape, 1)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=_path(directory, shape, "helpers", side))
        out[side] = {"keys": C.tensors({"model": model_sd, "optim": optim_sd}),
                     "optim_full": _optim_full(model, optim)}
    for source, target in PAIRS:
        model, optim = build(target, shape, 2)
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=_path(directory, shape, "helpers", source))
        if native_cannot_load_optim(shape, target):
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optim, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        out[f"{source}->{target}"] = {"model": held(model), "optim": _optim_full(model, optim)}
    return out


def fsdp_optim(shape: str, kind: str, directory: str) -> dict:
    """FSDP.optim_state_dict(root, optim) under `kind` (SHARDED through DCP), each side's
    loaded into ours by FSDP.optim_state_dict_to_load; and the legacy full_optim_state_dict,
    loaded by shard_full_optim_state_dict(optim=...), and the legacy sharded form (ours into
    ours: native's ShardedTensors are read through DCP only)."""
    state_type = StateDictType[f"{kind}_STATE_DICT"]
    out = {}
    for side in C.SIDES:
        model, optim = build(side, shape, 1)
        fsdp = fsdp_of(model)
        with fsdp.state_dict_type(model, state_type):
            saved = fsdp.optim_state_dict(model, optim)
        if kind == "SHARDED":
            dcp.save(saved, checkpoint_id=_path(directory, shape, "optim", side))
        out[side] = {"keys": C.tensors(saved), "optim_full": _fsdp_full_optim(model, optim),
                     "legacy": C.tensors(fsdp.full_optim_state_dict(model, optim,
                                                                    rank0_only=False)),
                     "legacy_sharded": C.tensors(fsdp.sharded_optim_state_dict(model, optim))}
        out[side]["saved"] = saved
    for source in C.SIDES:
        model, optim = build("ours", shape, 2)
        fsdp = fsdp_of(model)
        with fsdp.state_dict_type(model, state_type):
            state = out[source]["saved"]
            if kind == "SHARDED":
                state = fsdp.optim_state_dict(model, optim)
                dcp.load(state, checkpoint_id=_path(directory, shape, "optim", source))
            optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, state))
        out[f"{source}->ours"] = _fsdp_full_optim(model, optim)
        if kind == "FULL":  # the legacy full form, through shard_full_optim_state_dict
            model, optim = build("ours", shape, 2)
            optim.load_state_dict(fsdp.shard_full_optim_state_dict(
                out[source]["legacy"], model, optim=optim))
            out[f"{source}->ours legacy"] = _fsdp_full_optim(model, optim)
        if kind == "SHARDED" and source == "ours":  # the legacy sharded form, in memory
            model, optim = build("ours", shape, 2)
            optim.load_state_dict(fsdp.flatten_sharded_optim_state_dict(
                fsdp.sharded_optim_state_dict(*build("ours", shape, 1)), model, optim))
            out["ours->ours legacy"] = _fsdp_full_optim(model, optim)
    for side in C.SIDES:
        del out[side]["saved"]
    return out


def yafsdp(shape: str, directory: str) -> dict:
    """YaFSDP below the root: the root's state_dict() loaded back by its load_state_dict, and
    native FSDP1's get_state_dict checkpoint (written by `helpers`) loaded into it."""
    model, _ = build("yafsdp", shape, 1)
    saved = model.state_dict()
    target, _ = build("yafsdp", shape, 2)
    result = target.load_state_dict(saved)
    out = {"reference": reference(shape, 1), "own": C.tensors(saved),
           "own->": {"model": _full_model(target), "result": tuple(map(list, result))}}
    model, optim = build("yafsdp", shape, 2)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=_path(directory, shape, "helpers", "native"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["native->"] = {"model": _full_model(model), "optim": _optim_full(model, optim)}
    return out


def _full_model(model) -> dict:
    # YaFSDP has no summon_full_params: whole parameters through torch's gather instead.
    return C.tensors(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def _fsdp_full_optim(model, optim) -> dict:
    fsdp = fsdp_of(model)
    with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return C.tensors(fsdp.optim_state_dict(model, optim))


def _path(directory: str, *parts: str) -> str:
    return os.path.join(directory, "_".join(parts))


def cases(directory: str) -> dict:
    table = {}
    for shape in SHAPES:
        for kind in ("FULL", "SHARDED", "LOCAL"):
            table[f"{kind.lower()}_{shape}"] = functools.partial(own_api, shape, kind, directory)
        table[f"helpers_{shape}"] = functools.partial(helpers, shape, directory)
        table[f"yafsdp_{shape}"] = functools.partial(yafsdp, shape, directory)  # after helpers
        for kind in ("FULL", "SHARDED"):
            table[f"optim_{kind.lower()}_{shape}"] = functools.partial(fsdp_optim, shape, kind,
                                                                       directory)
    return {name: C._ranked(fn) for name, fn in table.items()}


def run_cases(rank, world, directory, names=None):
    return run_case_table(cases(directory), names)
