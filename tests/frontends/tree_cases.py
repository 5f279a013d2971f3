"""FSDP1's module tree against native FSDP1's, in one CPU/gloo world (see test_tree_native.py).

Each case wraps the same model with ours and with torch's FSDP1, `use_orig_params` False and
True, FULL_SHARD and SHARD_GRAD_OP, and records what training code reads from the tree:
module names, parameter names, shapes and `requires_grad`, `FSDP.fsdp_modules`, the units an
`isinstance(m, FSDP)` `check_fn` checkpoints (and how many forwards each block then runs),
every unit's FULL state dict taken as LoRA recipes take adapter weights, what a unit's
`summon_full_params` shows, and three AdamW steps whose param groups split the parameters by
name (no weight decay for norms and biases).
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

from tests.world import run_case_table

STEPS = 3
WIDTH = 16  # every parameter's size a multiple of 4 (16 bytes): no alignment padding natively


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.forwards = 0  # forwards run, recomputations included

    def forward(self, x):
        self.forwards += 1
        return x + self.norm(torch.relu(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def fsdp_class(which: str):
    module = "torch.distributed.fsdp" if which == "native" else "fsdp_bridge.fsdp"
    return importlib.import_module(module).FullyShardedDataParallel


def _no_decay(name: str) -> bool:
    return "norm" in name or "bias" in name


def _blocks(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Block)]


def _tree(fsdp, model: nn.Module) -> dict:
    return {
        "modules": [name for name, _ in model.named_modules()],
        "params": [(name, tuple(p.shape), p.requires_grad)
                   for name, p in model.named_parameters()],
        "count": len(list(model.parameters())),
        "fsdp_modules": len(fsdp.fsdp_modules(model)),
        "roots": len(fsdp.fsdp_modules(model, root_only=True)),
        "units": [name for name, m in model.named_modules() if isinstance(m, fsdp)],
    }


def _unit_state_dicts(fsdp, model: nn.Module) -> dict:
    """Each nested unit's FULL state dict, found by name as LoRA recipes find adapters."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, fsdp) and "layers" in name:
            with fsdp.state_dict_type(module, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(rank0_only=True)):
                out[name] = {k: v.clone() for k, v in module.state_dict().items()}
    return out


def _train(fsdp, model: nn.Module, rank: int) -> dict:
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
              {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for block in _blocks(model):
        block.forwards = 0
    for _ in range(STEPS):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": _full(fsdp, model),
            "no_decay": len(groups[1]["params"]), "decay": len(groups[0]["params"]),
            "forwards": [block.forwards for block in _blocks(model)]}


def _wrap(which: str, use_orig_params: bool, strategy: ShardingStrategy):
    fsdp = fsdp_class(which)
    torch.manual_seed(0)
    model = fsdp(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                 device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    return fsdp, model


def _full(fsdp, module: nn.Module) -> dict:
    with fsdp.state_dict_type(module, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in module.state_dict().items()}


def _side(which: str, rank: int, use_orig_params: bool, strategy: ShardingStrategy) -> dict:
    fsdp, model = _wrap(which, use_orig_params, strategy)
    out = {"tree": _tree(fsdp, model)}
    unit = model.layers[1]
    out["unit_tree"] = _tree(fsdp, unit)
    with fsdp.summon_full_params(unit):
        out["summoned"] = [(n, tuple(p.shape)) for n, p in unit.named_parameters()]
    initial = _full(fsdp, unit)
    calls = out["unit_hook_calls"] = []
    unit.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    unit.register_forward_hook(lambda module, args, output: calls.append("post"))
    try:
        unit.clip_grad_norm_(1.0)
        out["unit_clip"] = "no error"
    except RuntimeError:
        out["unit_clip"] = "RuntimeError"
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, fsdp))
    out["checkpointed"] = [name for name, m in model.named_modules()
                           if isinstance(m, CheckpointWrapper)]
    out["tree_after_ac"] = _tree(fsdp, model)
    out.update(_train(fsdp, model, rank))
    out["unit_state_dicts"] = _unit_state_dicts(fsdp, model)
    with fsdp.state_dict_type(unit, StateDictType.FULL_STATE_DICT):  # an adapter loaded back
        unit.load_state_dict(initial)
    out["after_unit_load"] = _full(fsdp, model)
    return out


def _config(use_orig_params: bool, strategy: ShardingStrategy):
    def run(rank, world):
        return {which: _side(which, rank, use_orig_params, strategy)
                for which in ("native", "ours")}
    return run


def _hand_nested(which: str, rank: int) -> dict:
    """Wrappers nested by hand (each block first, then the model), flat parameters."""
    fsdp = fsdp_class(which)
    torch.manual_seed(0)
    model = Net()
    for index, block in enumerate(list(model.layers)):
        model.layers[index] = fsdp(block, device_id=torch.device("cpu"))
    model = fsdp(model, device_id=torch.device("cpu"))
    out = {"tree": _tree(fsdp, model)}
    out.update(_train(fsdp, model, rank))
    out["unit_state_dicts"] = _unit_state_dicts(fsdp, model)
    return out


def _zeta(which: str, rank: int) -> dict:
    """Zeta's fsdp(auto_wrap=True) calls torch's FSDP1 with this policy and
    use_orig_params=True: our Zeta front-end builds the same tree."""
    torch.manual_seed(0)
    if which == "native":
        model = fsdp_class("native")(
            Net(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                      transformer_layer_cls={Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
            use_orig_params=True)
    else:
        from fsdp_bridge.zeta import fsdp

        model = fsdp(Net(), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    return {"modules": [n for n, _ in model.named_modules()],
            "params": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
            "wrappers": [n for n, m in model.named_modules() if type(m) is type(model)]}


CASES = {
    f"{'orig' if orig else 'flat'}_{strategy.name}": _config(orig, strategy)
    for orig in (False, True)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
}
CASES["hand_nested"] = lambda rank, world: {w: _hand_nested(w, rank) for w in ("native", "ours")}
CASES["zeta"] = lambda rank, world: {w: _zeta(w, rank) for w in ("native", "ours")}


def run_cases(rank, world, names=None):
    assert dist.get_world_size() == world
    return run_case_table(CASES, names)
