"""FSDP1's optimizer state-dict APIs, and the other forms of `checkpoint_wrapper`, on
activation-checkpointed models, against native FSDP1 in one CPU/gloo world of two ranks
(ac_optim_cases.py):

- `scatter_full_optim_state_dict` / `shard_full_optim_state_dict` with `optim` omitted
  (keyed by position in `model.parameters()`), and `rekey_optim_state_dict` through the
  unwrapped model as torch documents it, both ways between native and ours, and between
  checkpointing before and after the wrap: the target's optimizer then holds the source's
  state exactly;
- REENTRANT `checkpoint_wrapper`, `offload_wrapper`, and a checkpointed module inside a
  checkpointed block: FULL / SHARDED model state dicts, the FULL optimizer state dict, torch's
  full `get_model_state_dict` and names inside `summon_full_params` are native FSDP1's.
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import ac_optim_cases as C
from tests.frontends.test_ac_state_dicts import _unordered, same_structure, same_values
from tests.world import case_result as case
from tests.world import run_world

PAIRS = [f"{source}->{target}" for source, target in C.PAIRS]


def same_optim(got: dict, expected: dict, what: str) -> None:
    """Names, param groups and values equal. The order of a parameter's entries is not
    compared: native FSDP1 gives its tensors first, then `step`; ours keeps the optimizer's
    order (`step` first), and a load takes either."""
    assert _unordered(got["param_groups"]) == _unordered(expected["param_groups"]), what
    assert sorted(got["state"]) == sorted(expected["state"]), f"{what}: state keys differ"
    for name, state in expected["state"].items():
        mine = got["state"][name]
        assert sorted(mine) == sorted(state), f"{what} {name}: {sorted(mine)}"
        for key, value in state.items():
            assert torch.equal(mine[key], value), f"{what}: {name}.{key} differs"


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


@pytest.mark.parametrize("orders", [f"{a}_{b}" for a, b in C.ORDER_PAIRS])
@pytest.mark.parametrize("how", list(C.LOADS))
@pytest.mark.parametrize("rank", [0, 1])
def test_full_optimizer_state_loads_without_optim_and_through_rekey(world, how, orders, rank):
    result = case(world, f"{how}_{orders}", rank)
    for pair in PAIRS:
        saved = result[pair]["saved"]
        same_optim(result[pair]["loaded"], saved, pair)
        if how == "rekey":  # what the unwrapped model's optimizer held, by name
            same_optim(result[pair]["between"], saved, f"{pair} unwrapped")


@pytest.mark.parametrize("order", C.C.ORDERS)
@pytest.mark.parametrize("wrapper", list(C.WRAPPERS))
@pytest.mark.parametrize("rank", [0, 1])
def test_other_checkpoint_wrappers_state_dicts_as_native(world, wrapper, order, rank):
    result = case(world, f"{wrapper}_{order}", rank)
    ours, native = result["ours"], result["native"]
    for side in (native, ours):
        same_values(side["full"], result["reference"], "FULL state dict")
        same_values(side["helpers"], result["reference"], "get_model_state_dict full")
    same_structure(ours["sharded"], native["sharded"], "SHARDED state dict")
    same_optim(ours["optim"], native["optim"], "FULL optim_state_dict")
    assert ours["summoned"] == native["summoned"]
