"""A wrapped model below the root (torch's `checkpoint_wrapper` around it, or a plain module
holding it) against native FSDP1 in one CPU/gloo world of two ranks (ac_parent_cases.py):

- the root's `state_dict()` has native FSDP1's keys and the reference values (FULL), or its
  keys and global shapes (SHARDED);
- the root's `load_state_dict` really loads each side's checkpoint into ours (FULL; SHARDED
  through DCP; LOCAL, ours only): nn.Module loads each submodule itself, so this goes through
  our wrapper's load hooks;
- torch's get_/set_state_dict through DCP: optimizer state named as native's (without
  `_fsdp_wrapped_module.`), and loaded into ours from either side.
"""

from __future__ import annotations

import pytest

from tests.frontends import ac_parent_cases as C
from tests.frontends.test_ac_optim import same_optim as same_optim_unordered
from tests.frontends.test_ac_state_dicts import (
    same_optim,
    same_optim_keys,
    same_structure,
    same_values,
)
from tests.world import case_result as case
from tests.world import run_world

PAIRS = [f"{source}->{target}" for source, target in C.PAIRS]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(C.run_cases, 2, str(tmp_path_factory.mktemp("ac_parent")))


@pytest.mark.parametrize("shape", C.SHAPES)
@pytest.mark.parametrize("kind", ["full", "sharded", "local"])
@pytest.mark.parametrize("rank", [0, 1])
def test_root_state_dict_and_load_state_dict(world, kind, shape, rank):
    result = case(world, f"{kind}_{shape}", rank)
    if kind == "full":
        same_values(result["ours"], result["reference"], "ours")
        same_values(result["native"], result["reference"], "native")
    elif kind == "sharded":
        same_structure(result["ours"], result["native"], "SHARDED")
    for pair in PAIRS:
        if pair not in result:  # LOCAL: ours into ours only (native's LOCAL form is its own)
            assert kind == "local" and pair != "ours->ours"
            continue
        assert result[pair]["result"] == ([], []), (pair, result[pair]["result"])
        same_values(result[pair]["model"], result["reference"], pair)


@pytest.mark.parametrize("shape", C.SHAPES)
@pytest.mark.parametrize("rank", [0, 1])
def test_torch_get_set_state_dict_through_dcp(world, shape, rank):
    result = case(world, f"helpers_{shape}", rank)
    same_structure(result["ours"]["keys"], result["native"]["keys"], "get_state_dict")
    for pair in PAIRS:
        same_values(result[pair]["model"], result["reference"], pair)
    # Native's sharded optimizer state holds what ours holds after the same step (see
    # test_ac_state_dicts.test_sharded_dcp_keys_and_loads_both_ways): both load as ours'.
    for pair in ("ours->ours", "native->ours"):
        same_optim(result[pair]["optim"], result["ours"]["optim_full"], pair)


@pytest.mark.parametrize("shape", C.SHAPES)
@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp_optim_state_dict_of_the_root(world, kind, shape, rank):
    """Named from the root as native names them (the holder's own module's state included),
    and loaded into ours from either side. FULL: each source as it reads itself (native's
    FULL values on the CPU are its own, see test_ac_state_dicts.loads_optim_exactly);
    SHARDED: as ours holds it (native's sharded state holds the same)."""
    result = case(world, f"optim_{kind}_{shape}", rank)
    ours, native = result["ours"], result["native"]
    same_structure(ours["keys"]["state"], native["keys"]["state"], "optim_state_dict")
    same_optim_keys(ours["legacy"], native["legacy"], "full_optim_state_dict")
    same_structure(ours["legacy_sharded"]["state"], native["legacy_sharded"]["state"],
                   "sharded_optim_state_dict")
    if kind == "sharded":
        same_optim_unordered(result["ours->ours legacy"], ours["optim_full"],
                             "through flatten_sharded_optim_state_dict")
    for source in ("ours", "native"):
        expected = result[source]["optim_full"] if kind == "full" else ours["optim_full"]
        same_optim_unordered(result[f"{source}->ours"], expected, f"{source}->ours")
        if kind == "full":
            same_optim_unordered(result[f"{source}->ours legacy"], result[source]["legacy"],
                                 f"{source}->ours through shard_full_optim_state_dict")


@pytest.mark.parametrize("shape", C.SHAPES)
@pytest.mark.parametrize("rank", [0, 1])
def test_yafsdp_below_the_root(world, shape, rank):
    """YaFSDP held by another module or under `checkpoint_wrapper`: the root's state dict is
    the reference, loads back through the root's load_state_dict, and native FSDP1's
    get_state_dict checkpoint loads into it (model and optimizer)."""
    result = case(world, f"yafsdp_{shape}", rank)
    same_values(result["own"], result["reference"], "state_dict()")
    assert result["own->"]["result"] == ([], [])
    same_values(result["own->"]["model"], result["reference"], "loaded back")
    same_values(result["native->"]["model"], result["reference"], "native checkpoint loaded")
    native = case(world, f"helpers_{shape}", rank)["native"]["optim_full"]
    same_optim(result["native->"]["optim"], native, "native optimizer loaded")
