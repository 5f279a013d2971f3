"""State dicts of activation-checkpointed models against native FSDP1, in one CPU/gloo world of
two ranks (see test_ac_state_dicts.py).

Every model is the same small net whose blocks torch's `checkpoint_wrapper` wraps, through
`apply_activation_checkpointing`, before or after the FSDP1-style wrap. Models are built from a
seed and stepped once by Adam with lr=0: the weights stay those of the seed (the reference is
the unwrapped net's own `state_dict()`), and the optimizer holds non-zero state to save. A case
returns what each side wrote (keys and values) and what each target holds after loading each
source's checkpoint, so the test compares both with native and with the reference exactly.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.world import run_case_table

ORDERS = ("before", "after")
SIDES = ("native", "ours")
SOURCE_SEED, TARGET_SEED = 1, 2
PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_module.")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def reference(seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def _checkpointed(model: nn.Module) -> nn.Module:
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, Block))
    return model


def fsdp_class(side: str):
    module = "torch.distributed.fsdp" if side == "native" else "fsdp_bridge.fsdp"
    return importlib.import_module(module).FullyShardedDataParallel


def _wrap(frontend: str, model: nn.Module) -> nn.Module:
    if frontend in SIDES:
        # use_orig_params: torch's set_state_dict cannot load optimizer state into native
        # FSDP1's flat parameters otherwise (it looks for state under `_flat_param`).
        return fsdp_class(frontend)(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    device_id=torch.device("cpu"), use_orig_params=True)
    if frontend == "yafsdp":
        from fsdp_bridge.ya_fsdp import YaFSDP

        blocks = [(m, n) for n, m in model.named_modules() if isinstance(m, Block)]
        return YaFSDP(model, zero_stage=3, modules_to_wrap_with_names=blocks)
    if frontend == "zeta":
        from fsdp_bridge.zeta import fsdp

        return fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    from fsdp_bridge import torchacc

    config = torchacc.Config()
    config.dist.fsdp.size = dist.get_world_size()
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    return torchacc.accelerate(model, config=config)


def build(frontend: str, order: str, seed: int):
    """The net checkpointed `order` the wrap, and its optimizer with state (lr=0: one step
    leaves the weights those of `seed`)."""
    torch.manual_seed(seed)
    model = Net()
    if order == "before":
        _checkpointed(model)
    model = _wrap(frontend, model)
    if order == "after":
        _checkpointed(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.0)
    model(torch.arange(16.0).reshape(2, 8) / 16).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def clean(name: str) -> str:
    for prefix in PREFIXES:
        name = name.replace(prefix, "")
    return name


def held(model: nn.Module) -> dict:
    """The whole parameters the model holds, under the unwrapped net's names (read through
    `summon_full_params`, no state-dict code involved)."""
    fsdp = fsdp_class("native") if isinstance(model, fsdp_class("native")) else fsdp_class("ours")
    with fsdp.summon_full_params(model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def tensors(value):
    """A state dict made comparable in the parent: DTensors / ShardedTensors as their local
    piece's shape only (keys and global shapes are what is compared), tensors cloned."""
    if isinstance(value, dict):
        return {k: tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tensors(v) for v in value]
    if type(value) is torch.Tensor:
        return value.detach().clone()
    if torch.is_tensor(value) or hasattr(value, "local_shards"):
        return ("sharded", tuple(value.size()))
    return value


def _optim_full(model, optim) -> dict:
    return tensors(get_optimizer_state_dict(model, optim,
                                            options=StateDictOptions(full_state_dict=True)))


def _fsdp_full_optim(model, optim) -> dict:
    fsdp = fsdp_class("native") if isinstance(model, fsdp_class("native")) else fsdp_class("ours")
    with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return tensors(fsdp.optim_state_dict(model, optim))


# -- FSDP1's own state-dict API ------------------------------------------------------------------


def full(order: str) -> dict:
    """FULL_STATE_DICT (every rank) with FSDP.optim_state_dict; each side's dicts loaded into a
    fresh model of each side."""
    out = {"reference": reference(SOURCE_SEED)}
    for side in SIDES:
        model, optim = build(side, order, SOURCE_SEED)
        fsdp = fsdp_class(side)
        with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            out[side] = {"model": tensors(model.state_dict()),
                         "optim": tensors(fsdp.optim_state_dict(model, optim))}
    for source in SIDES:
        for target in SIDES:
            model, optim = build(target, order, TARGET_SEED)
            fsdp = fsdp_class(target)
            with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                model.load_state_dict(out[source]["model"])
                optim.load_state_dict(fsdp.optim_state_dict_to_load(
                    model, optim, out[source]["optim"]))
            out[f"{source}->{target}"] = {"model": held(model),
                                          "optim": _fsdp_full_optim(model, optim)}
    return out


def _offload(side: str) -> bool:
    # Native FSDP1 cannot offload to the CPU what is on the CPU already (it fails in its
    # unflatten); ours can, and offloads wherever it is asked to.
    return side == "ours"


def full_rank0(order: str) -> dict:
    """FULL_STATE_DICT with rank0_only=True (and offload_to_cpu=True for ours)."""
    out = {"reference": reference(SOURCE_SEED)}
    for side in SIDES:
        model, _ = build(side, order, SOURCE_SEED)
        fsdp = fsdp_class(side)
        config = FullStateDictConfig(offload_to_cpu=_offload(side), rank0_only=True)
        with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            out[side] = tensors(model.state_dict())
    return out


def sharded(order: str, directory: str) -> dict:
    """SHARDED_STATE_DICT of model and optimizer through DCP, each side's checkpoint loaded into
    a fresh model of each side."""
    out = {"reference": reference(SOURCE_SEED)}
    for side in SIDES:
        model, optim = build(side, order, SOURCE_SEED)
        fsdp = fsdp_class(side)
        config = ShardedStateDictConfig(offload_to_cpu=_offload(side))
        with fsdp.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config):
            state = {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=os.path.join(directory, f"sharded_{order}_{side}"))
        out[side] = {"keys": tensors(state), "optim_full": _fsdp_full_optim(model, optim)}
    for source in SIDES:
        for target in SIDES:
            model, optim = build(target, order, TARGET_SEED)
            fsdp = fsdp_class(target)
            config = ShardedStateDictConfig(offload_to_cpu=_offload(target))
            with fsdp.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config):
                state = {"model": model.state_dict(),
                         "optim": fsdp.optim_state_dict(model, optim)}
                dcp.load(state, checkpoint_id=os.path.join(directory,
                                                           f"sharded_{order}_{source}"))
                model.load_state_dict(state["model"])
                optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim,
                                                                    state["optim"]))
            out[f"{source}->{target}"] = {"model": held(model),
                                          "optim": _fsdp_full_optim(model, optim)}
    return out


# -- torch's torch.distributed.checkpoint.state_dict helpers -------------------------------------


def native_cannot_load_optim(target: str, order: str) -> bool:
    """torch's set_state_dict refuses optimizer state for native FSDP1 checkpointed before the
    wrap, whatever wrote it (its own included: "Missing optimizer state for parameter
    'blocks.0._fsdp_wrapped_module.lin.weight'"): only the model is loaded into it then."""
    return target == "native" and order == "before"


def helpers(order: str, directory: str) -> dict:
    """get_state_dict (sharded) through DCP both ways, and the full forms of the get_ helpers."""
    out = {"reference": reference(SOURCE_SEED)}
    for side in SIDES:
        model, optim = build(side, order, SOURCE_SEED)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=os.path.join(directory, f"helpers_{order}_{side}"))
        out[side] = {
            "keys": tensors({"model": model_sd, "optim": optim_sd}),
            "model_full": tensors(get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True))),
            "optim_full": _optim_full(model, optim),
        }
    for source in SIDES:
        for target in SIDES:
            model, optim = build(target, order, TARGET_SEED)
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=os.path.join(directory, f"helpers_{order}_{source}"))
            if native_cannot_load_optim(target, order):
                set_model_state_dict(model, state["model"])
                out[f"{source}->{target}"] = {"model": held(model), "optim": None}
                continue
            set_state_dict(model, optim, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            out[f"{source}->{target}"] = {"model": held(model),
                                          "optim": _optim_full(model, optim)}
    return out


def helpers_rank0(order: str) -> dict:
    """get_state_dict(full_state_dict, cpu_offload: rank 0 only, ours), loaded into each side
    with set_state_dict(broadcast_from_rank0)."""
    out = {"reference": reference(SOURCE_SEED)}
    spread = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for side in SIDES:
        model, optim = build(side, order, SOURCE_SEED)
        gather = StateDictOptions(full_state_dict=True, cpu_offload=_offload(side))
        model_sd, optim_sd = get_state_dict(model, optim, options=gather)
        out[side] = {"model": tensors(model_sd), "optim": tensors(optim_sd),
                     "optim_everywhere": _optim_full(model, optim)}
    for source in SIDES:
        for target in SIDES:
            if native_cannot_load_optim(target, order):
                # Nor the model from a rank-0-only dict: on the other ranks torch looks for
                # the keys under native's wrapped names ("Missing key(s) ... blocks.0.lin").
                continue
            model, optim = build(target, order, TARGET_SEED)
            # Separately: set_state_dict takes a rank's empty model dict (rank 1's, after a
            # cpu_offload gather) as "load the optimizer only" and skips the broadcast.
            set_model_state_dict(model, out[source]["model"], options=spread)
            set_optimizer_state_dict(model, optim, out[source]["optim"], options=spread)
            out[f"{source}->{target}"] = {"model": held(model),
                                          "optim": _optim_full(model, optim)}
    return out


# -- the other flat-layout front-ends -------------------------------------------------------------


def other_frontend(frontend: str, order: str, directory: str) -> dict:
    """Native FSDP1's get_state_dict checkpoint (written by `helpers`) loaded into `frontend`;
    its full state dicts (own `state_dict()` and get_model_state_dict) against the reference."""
    out = {"reference": reference(SOURCE_SEED)}
    model, optim = build(frontend, order, SOURCE_SEED)
    out["own"] = tensors(model.state_dict())
    out["helpers_full"] = tensors(get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True)))
    model, optim = build(frontend, order, TARGET_SEED)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(directory, f"helpers_{order}_native"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["native->"] = {"model": _held_by_helpers(model), "optim": _optim_full(model, optim)}
    native_model, native_optim = build("native", order, SOURCE_SEED)
    out["native_optim"] = _optim_full(native_model, native_optim)
    return out


def _held_by_helpers(model) -> dict:
    # YaFSDP has no summon_full_params; full parameters through torch's gather instead.
    return tensors(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def torchacc_local(order: str) -> dict:
    """TorchAcc's per-rank state dict (this rank's flat pieces) saved and loaded back."""
    model, _ = build("torchacc", order, SOURCE_SEED)
    local = tensors(model.state_dict())
    target, _ = build("torchacc", order, TARGET_SEED)
    target.load_state_dict(local)
    return {"reference": reference(SOURCE_SEED), "keys": list(local),
            "loaded": held(target)}


def fsdp1_local(order: str) -> dict:
    """FSDP1's LOCAL_STATE_DICT: the keys of each side's flat parameters, and ours saved and
    loaded back into a model of another seed."""
    out = {"reference": reference(SOURCE_SEED)}
    for side in SIDES:
        model, _ = build(side, order, SOURCE_SEED)
        with fsdp_class(side).state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            local = model.state_dict()
        out[f"{side}_keys"] = list(local)
    target, _ = build("ours", order, TARGET_SEED)
    with fsdp_class("ours").state_dict_type(target, StateDictType.LOCAL_STATE_DICT):
        target.load_state_dict(local)
    out["loaded"] = held(target)
    return out


def cases(directory: str) -> dict:
    table = {}
    for order in ORDERS:
        table[f"full_{order}"] = functools.partial(full, order)
        table[f"full_rank0_{order}"] = functools.partial(full_rank0, order)
        table[f"sharded_{order}"] = functools.partial(sharded, order, directory)
        table[f"helpers_{order}"] = functools.partial(helpers, order, directory)
        table[f"helpers_rank0_{order}"] = functools.partial(helpers_rank0, order)
        for frontend in ("yafsdp", "zeta", "torchacc"):
            table[f"{frontend}_{order}"] = functools.partial(other_frontend, frontend, order,
                                                             directory)
        table[f"torchacc_local_{order}"] = functools.partial(torchacc_local, order)
        table[f"fsdp1_local_{order}"] = functools.partial(fsdp1_local, order)
    return {name: _ranked(fn) for name, fn in table.items()}


def _ranked(fn):
    def run(rank, world):
        return fn()
    return run


def run_cases(rank, world, directory, names=None):
    return run_case_table(cases(directory), names)
