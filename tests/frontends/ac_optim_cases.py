"""FSDP1's optimizer state-dict APIs on activation-checkpointed models, against native FSDP1 in
one CPU/gloo world of two ranks (see test_ac_optim.py).

The model is ac_state_dict_cases' net, checkpointed before or after the wrap, built with
`use_orig_params=False`: native FSDP1's full optimizer state on the CPU then holds the values
ours holds after the same step (with `use_orig_params=True` it does not, see
test_ac_state_dicts.loads_optim_exactly), so native is a reference for values as well as keys.
Each case saves one side's optimizer state and loads it into a fresh model of each side (of the
same or the other checkpointing order), and returns what the target's optimizer then holds.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import OptimStateKeyType, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.frontends import ac_state_dict_cases as C
from tests.world import run_case_table

SOURCE_SEED, TARGET_SEED = 1, 2
PAIRS = [(source, target) for source in C.SIDES for target in C.SIDES]
ORDER_PAIRS = [(a, b) for a in C.ORDERS for b in C.ORDERS]

# checkpoint_wrapper's other forms, and a checkpointed module inside a checkpointed one.
WRAPPERS = {
    "reentrant": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
    "offload": offload_wrapper,
    "nested": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
}


def build(side: str, order: str, seed: int, wrapper: str = "blocks"):
    """The net checkpointed `order` the wrap (its blocks, by `WRAPPERS[wrapper]` or, by
    default, as ac_state_dict_cases does; "nested" also checkpoints each block's linear inside
    the checkpointed block), wrapped with use_orig_params=False, stepped once
    (lr=0) so that its optimizer holds state."""
    torch.manual_seed(seed)
    model = C.Net()
    if order == "before":
        _checkpoint(model, wrapper)
    model = C.fsdp_class(side)(model, auto_wrap_policy=ModuleWrapPolicy({C.Block}),
                               device_id=torch.device("cpu"), use_orig_params=False)
    if order == "after":
        _checkpoint(model, wrapper)
    optim = torch.optim.Adam(model.parameters(), lr=0.0)
    # Inputs differ by seed, so that source and target optimizers hold different state.
    x = torch.arange(16.0).reshape(2, 8) / 16 * seed
    model(x.requires_grad_(wrapper == "reentrant")).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _checkpoint(model, wrapper: str) -> None:
    if wrapper not in WRAPPERS:
        C._checkpointed(model)
        return
    inner = {id(m.lin) for m in model.modules() if isinstance(m, C.Block)}
    if wrapper != "nested":
        inner = set()
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=WRAPPERS[wrapper],
        check_fn=lambda module: isinstance(module, C.Block) or id(module) in inner)


def fsdp_of(model):
    native = C.fsdp_class("native")
    if any(isinstance(module, native) for module in model.modules()):
        return native
    return C.fsdp_class("ours")


def held(model, optim) -> dict:
    """The optimizer's state as a full, name-keyed dict (each side read by its own class)."""
    return C.tensors(fsdp_of(model).full_optim_state_dict(model, optim, rank0_only=False))


def _plain():
    """The unwrapped net (checkpointed) and its optimizer, holding state of its own."""
    torch.manual_seed(3)
    model = C._checkpointed(C.Net())
    optim = torch.optim.Adam(model.parameters(), lr=0.0)
    model(torch.ones(2, 8)).sum().backward()
    optim.step()
    return model, optim


# -- how one side hands its state to the other (source model and optim -> target) ----------------


def scatter_without_optim(source, target) -> None:
    """full_optim_state_dict (rank 0 only) -> scatter_full_optim_state_dict(optim omitted)."""
    full = fsdp_of(source[0]).full_optim_state_dict(*source, rank0_only=True)
    local = fsdp_of(target[0]).scatter_full_optim_state_dict(
        full if dist.get_rank() == 0 else None, target[0])
    target[1].load_state_dict(local)


def shard_without_optim(source, target) -> None:
    """full_optim_state_dict (every rank) -> shard_full_optim_state_dict(optim omitted)."""
    full = fsdp_of(source[0]).full_optim_state_dict(*source, rank0_only=False)
    target[1].load_state_dict(fsdp_of(target[0]).shard_full_optim_state_dict(full, target[0]))


def through_unwrapped(source, target) -> dict:
    """rekey_optim_state_dict as torch documents it: the wrapped model's full state into the
    unwrapped model's optimizer (PARAM_ID), and that optimizer's state back (PARAM_NAME) into
    the target. Returns what the unwrapped optimizer held, by name."""
    fsdp = fsdp_of(target[0])
    full = fsdp_of(source[0]).full_optim_state_dict(*source, rank0_only=False)
    plain, plain_optim = _plain()
    plain_optim.load_state_dict(fsdp.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID,
                                                            plain, optim=plain_optim))
    by_name = fsdp.rekey_optim_state_dict(plain_optim.state_dict(),
                                          OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
    target[1].load_state_dict(fsdp.shard_full_optim_state_dict(by_name, target[0]))
    return C.tensors(by_name)


LOADS = {"scatter": scatter_without_optim, "shard": shard_without_optim,
         "rekey": through_unwrapped}


def load_case(how: str, source_order: str, target_order: str) -> dict:
    """Each side's state loaded `how` into each side's fresh model: the source's own full
    state, and what each target then holds."""
    out = {}
    for source_side, target_side in PAIRS:
        source = build(source_side, source_order, SOURCE_SEED)
        target = build(target_side, target_order, TARGET_SEED)
        pair = f"{source_side}->{target_side}"
        out[pair] = {"saved": held(*source)}
        out[pair]["between"] = LOADS[how](source, target)
        out[pair]["loaded"] = held(*target)
    return out


# -- the other forms of checkpoint_wrapper, in the state dicts --------------------------------


def wrapper_case(wrapper: str, order: str) -> dict:
    """Each side's FULL and SHARDED model state dicts (SHARDED: keys and global shapes),
    torch's full get_model_state_dict, the FULL optimizer state dict, and names inside
    summon_full_params, for the net checkpointed by `wrapper`."""
    out = {"reference": C.reference(SOURCE_SEED)}
    for side in C.SIDES:
        model, optim = build(side, order, SOURCE_SEED, wrapper)
        fsdp = fsdp_of(model)
        with fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full = C.tensors(model.state_dict())
            optim_full = C.tensors(fsdp.optim_state_dict(model, optim))
        with fsdp.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = C.tensors(model.state_dict())
        with fsdp.summon_full_params(model, writeback=False):
            summoned = sorted(C.clean(name) for name, _ in model.named_parameters())
        out[side] = {"full": full, "sharded": sharded, "optim": optim_full,
                     "summoned": summoned,
                     "helpers": C.tensors(get_model_state_dict(
                         model, options=StateDictOptions(full_state_dict=True)))}
    return out


def cases() -> dict:
    table = {}
    for how in LOADS:
        for source_order, target_order in ORDER_PAIRS:
            table[f"{how}_{source_order}_{target_order}"] = functools.partial(
                load_case, how, source_order, target_order)
    for wrapper in WRAPPERS:
        for order in C.ORDERS:
            table[f"{wrapper}_{order}"] = functools.partial(wrapper_case, wrapper, order)
    return {name: C._ranked(fn) for name, fn in table.items()}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
