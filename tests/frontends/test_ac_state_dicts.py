"""Activation checkpointing (`apply_activation_checkpointing` before or after the wrap) in every
state dict of the flat-layout front-ends, against native FSDP1 in one CPU/gloo world of two
ranks (ac_state_dict_cases.py):

- keys are native FSDP1's (no `_checkpoint_wrapped_module.`), so checkpoints load both ways;
- full state dicts hold whole tensors (rank0_only / offload_to_cpu included);
- a loaded checkpoint is really loaded: the model then holds the saved values exactly;
- FSDP1's own API (FULL / SHARDED, `FSDP.optim_state_dict`), torch's `get_/set_state_dict`
  (sharded through DCP, and full with cpu_offload / broadcast_from_rank0), and YaFSDP, Zeta
  and TorchAcc (their own state dicts, and native FSDP1's checkpoint loaded into them).
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import ac_state_dict_cases as C
from tests.world import case_result as case
from tests.world import run_world

ORDERS = C.ORDERS
CROSS = [f"{s}->{t}" for s in C.SIDES for t in C.SIDES]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(C.run_cases, 2, str(tmp_path_factory.mktemp("ac_state_dicts")))


def same_values(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected), f"{what}: keys {list(got)} != {list(expected)}"
    for key, value in expected.items():
        assert isinstance(got[key], torch.Tensor), f"{what}: {key} is {got[key]!r}"
        assert got[key].shape == value.shape, f"{what}: {key} has shape {tuple(got[key].shape)}"
        assert torch.equal(got[key], value), f"{what}: {key} differs"


def same_optim(got: dict, expected: dict, what: str) -> None:
    # Orders may differ: our wrap orders parameters by unit (as native's flat parameters do),
    # native's use_orig_params keeps the model's order; names and values must not.
    assert _unordered(got["param_groups"]) == _unordered(expected["param_groups"]), (
        f"{what}: param_groups {got['param_groups']} != {expected['param_groups']}")
    assert sorted(got["state"]) == sorted(expected["state"]), f"{what}: state keys differ"
    for name, state in expected["state"].items():
        same_values(got["state"][name], state, f"{what} state {name}")


def cross_loads(result: dict, source_optim, skipped=()) -> None:
    """Each target loaded each source: the model holds the reference exactly, and where ours
    is the target (see loads_optim_exactly) the optimizer holds `source_optim(pair)`."""
    for pair in CROSS:
        if pair in skipped:
            continue
        same_values(result[pair]["model"], result["reference"], pair)
        if loads_optim_exactly(pair):
            same_optim(result[pair]["optim"], source_optim(pair), pair)


def not_loaded_natively(order: str) -> list:
    """Pairs whose native target cannot load (see C.native_cannot_load_optim)."""
    return [pair for pair in CROSS if C.native_cannot_load_optim(pair.split("->")[1], order)]


def source_of(pair: str) -> str:
    return pair.split("->")[0]


def loads_optim_exactly(pair: str) -> bool:
    """Optimizer values are compared where ours is the target. Native FSDP1's optimizer state
    on the CPU is no reference: after the same step its exp_avg is not 0.1 * the gradient
    (head.bias: 0.004 where the gradient is 2.0; ours 0.2), with or without checkpointing;
    its keys still are."""
    return pair.endswith("->ours")


def same_optim_keys(ours: dict, native: dict, what: str) -> None:
    assert sorted(ours["state"]) == sorted(native["state"]), f"{what}: state keys differ"
    for name, state in native["state"].items():
        assert sorted(ours["state"][name]) == sorted(state), f"{what}: {name}'s keys differ"
    assert _unordered(ours["param_groups"]) == _unordered(native["param_groups"]), what


def _unordered(groups: list) -> list:
    # DCP stores tuples (Adam's betas) as lists.
    return [{k: sorted(v) if k == "params" else list(v) if isinstance(v, tuple) else v
             for k, v in group.items()} for group in groups]


def same_structure(ours, native, what: str) -> None:
    """Keys (and, for sharded values, global shapes) as native FSDP1 writes them."""
    if isinstance(native, dict):
        assert sorted(ours) == sorted(native), f"{what}: keys {list(ours)} != native {list(native)}"
        for key in native:
            same_structure(ours[key], native[key], f"{what}[{key!r}]")
    elif isinstance(native, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.shape == native.shape, what
    else:
        assert ours == native, f"{what}: {ours!r} != native {native!r}"


@pytest.mark.parametrize("order", ORDERS)
def test_full_state_dict_keys_values_and_cross_loads(world, order):
    result = case(world, f"full_{order}")
    same_values(result["ours"]["model"], result["reference"], "ours")
    same_values(result["native"]["model"], result["reference"], "native")
    same_optim_keys(result["ours"]["optim"], result["native"]["optim"], "FSDP.optim_state_dict")
    cross_loads(result, lambda pair: result[source_of(pair)]["optim"])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("rank", [0, 1])
def test_full_rank0_only_holds_whole_tensors(world, order, rank):
    result = case(world, f"full_rank0_{order}", rank)
    expected = result["reference"] if rank == 0 else {}
    same_values(result["native"], expected, "native")
    same_values(result["ours"], expected, "ours")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_dcp_keys_and_loads_both_ways(world, order, rank):
    result = case(world, f"sharded_{order}", rank)
    same_structure(result["ours"]["keys"]["model"], result["native"]["keys"]["model"], "model")
    assert sorted(result["ours"]["keys"]["optim"]["state"]) == sorted(
        result["native"]["keys"]["optim"]["state"])
    # Native's SHARDED optimizer state (unlike its FULL one, see loads_optim_exactly) holds
    # what ours holds after the same step: both sources load as ours' values.
    cross_loads(result, lambda pair: result["ours"]["optim_full"])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("rank", [0, 1])
def test_torch_get_set_state_dict_through_dcp_both_ways(world, order, rank):
    result = case(world, f"helpers_{order}", rank)
    same_structure(result["ours"]["keys"], result["native"]["keys"], "get_state_dict")
    same_values(result["ours"]["model_full"], result["reference"], "get_model_state_dict full")
    same_optim_keys(result["ours"]["optim_full"], result["native"]["optim_full"],
                    "get_optimizer_state_dict full")
    cross_loads(result, lambda pair: result[source_of(pair)]["optim_full"])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("rank", [0, 1])
def test_torch_full_cpu_offload_and_broadcast_from_rank0(world, order, rank):
    result = case(world, f"helpers_rank0_{order}", rank)
    same_values(result["native"]["model"], result["reference"], "native")
    if rank == 0:
        same_values(result["ours"]["model"], result["reference"], "ours")
        same_optim_keys(result["ours"]["optim"], result["native"]["optim"], "optimizer")
    else:  # cpu_offload: rank 0 only
        assert result["ours"]["model"] == {} and result["ours"]["optim"] == {}
    cross_loads(result, lambda pair: result[source_of(pair)]["optim_everywhere"],
                skipped=not_loaded_natively(order))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("frontend", ["yafsdp", "zeta", "torchacc"])
def test_other_frontends_load_native_checkpoints(world, frontend, order):
    result = case(world, f"{frontend}_{order}")
    same_values(result["helpers_full"], result["reference"], "get_model_state_dict full")
    if frontend != "torchacc":  # TorchAcc's own state_dict() is this rank's pieces
        same_values(result["own"], result["reference"], "state_dict()")
    same_values(result["native->"]["model"], result["reference"], "native checkpoint loaded")
    same_optim(result["native->"]["optim"], result["native_optim"], "native optimizer loaded")


@pytest.mark.parametrize("order", ORDERS)
def test_torchacc_local_state_dict_round_trip(world, order):
    result = case(world, f"torchacc_local_{order}")
    assert list(result["keys"]) == list(result["reference"])
    same_values(result["loaded"], result["reference"], "loaded")


@pytest.mark.parametrize("order", ORDERS)
def test_fsdp1_local_state_dict_names_units_as_native_and_round_trips(world, order):
    """LOCAL_STATE_DICT: each unit's flat parameters under the unit's path as native FSDP1
    writes it (without `_checkpoint_wrapped_module.`; the last part is ours, `_bridge_flat_param.<i>`
    for native's `_flat_param`, see [Note: LOCAL_STATE_DICT keys are ours]), loaded back exactly."""
    result = case(world, f"fsdp1_local_{order}")
    native_units = {key.rsplit("_flat_param", 1)[0] for key in result["native_keys"]
                    if key.endswith("_flat_param")}
    our_units = {key.split("_bridge_flat_param.")[0] for key in result["ours_keys"]}
    assert our_units == native_units, result["ours_keys"]
    same_values(result["loaded"], result["reference"], "loaded")
