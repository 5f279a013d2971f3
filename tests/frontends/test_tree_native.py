"""FSDP1's module tree is native FSDP1's: a wrapper per unit, flat parameters with
`use_orig_params=False` (tree_cases.py), compared with torch's FSDP1 in one world of 2 ranks
and one of 3, `use_orig_params` False and True, FULL_SHARD and SHARD_GRAD_OP: module and
parameter names, shapes, `requires_grad`, `fsdp_modules`, the units an `isinstance` `check_fn`
checkpoints (each block then runs its forward twice a step), every unit's FULL state dict,
`summon_full_params` on a unit, `clip_grad_norm_` refused on a unit, hooks on a unit, a unit's
FULL state dict loaded back, and three AdamW steps with by-name param groups, bit for bit; also
hand-nested wrappers and Zeta's auto-wrapped tree."""

from __future__ import annotations

import pytest
import torch

from tests.frontends import tree_cases as C
from tests.world import case_result as case
from tests.world import run_world

CONFIGS = [name for name in C.CASES if name not in ("hand_nested", "zeta")]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    return request.param, run_world(C.run_cases, request.param)


def _same_tensors(ours: dict, native: dict, what: str) -> None:
    assert list(ours) == list(native), what
    for key, value in native.items():
        assert torch.equal(ours[key], value), (
            f"{what} {key} differs from native by {(ours[key] - value).abs().max().item()}")


def _same_training(ours: dict, native: dict) -> None:
    assert ours["losses"] == native["losses"]
    assert (ours["decay"], ours["no_decay"]) == (native["decay"], native["no_decay"])
    _same_tensors(ours["state"], native["state"], "final state")
    assert list(ours["unit_state_dicts"]) == list(native["unit_state_dicts"])
    for unit, state in native["unit_state_dicts"].items():
        _same_tensors(ours["unit_state_dicts"][unit], state, f"unit {unit}")


@pytest.mark.parametrize("name", CONFIGS)
def test_tree_and_training_equal_native(world, name):
    size, results = world
    for rank in range(size):
        result = case(results, name, rank)
        ours, native = result["ours"], result["native"]
        assert ours["tree"] == native["tree"]
        assert ours["unit_tree"] == native["unit_tree"]
        assert ours["tree_after_ac"] == native["tree_after_ac"]
        # Each step runs the unit's forward and, checkpointed, again in backward (its hooks
        # too; torch's recomputation stops once it has what backward needs).
        assert ours["unit_hook_calls"] == native["unit_hook_calls"]
        assert native["unit_hook_calls"].count("pre") == 2 * C.STEPS
        assert ours["checkpointed"] == native["checkpointed"] == [
            f"_fsdp_wrapped_module.layers.{i}" for i in range(3)]
        assert ours["forwards"] == native["forwards"] == [2 * C.STEPS] * 3  # recomputed
        assert ours["summoned"] == native["summoned"]
        assert ours["unit_clip"] == native["unit_clip"] == "RuntimeError"
        _same_training(ours, native)
        _same_tensors(ours["after_unit_load"], native["after_unit_load"], "unit loaded")
        if name.startswith("flat"):  # one flat parameter per unit: nothing matches by name
            assert native["no_decay"] == 0 and ours["tree"]["count"] == 4


def test_hand_nested_wrappers_equal_native(world):
    size, results = world
    for rank in range(size):
        result = case(results, "hand_nested", rank)
        ours, native = result["ours"], result["native"]
        assert ours["tree"] == native["tree"]
        _same_training(ours, native)


def test_zeta_builds_torch_fsdp1s_tree(world):
    size, results = world
    result = case(results, "zeta", 0)
    ours, native = result["ours"], result["native"]
    assert ours["modules"] == native["modules"]
    assert ours["params"] == native["params"]
    assert ours["wrappers"] == native["wrappers"] and len(ours["wrappers"]) == 4
