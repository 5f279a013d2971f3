"""Initialisation from meta against native FSDP1, side by side in one CPU/gloo world of two
ranks (init_native_more_cases.py), initial weights and buffers bit for bit:

- an ignored module inside a unit made by the auto-wrap policy is materialised and
  initialised with that unit, in its breadth-first place, as natively (FSDP1 hands such units
  the ignored parameters, not the modules); one among the root's own modules stays on meta;
- ignored parameters on meta that the wrap materialises are then sharded, as natively (FSDP1
  knows ignored parameters by identity, and materialising makes new ones), with a warning;
- a meta parameter that is ignored does not by itself make a unit materialise;
- a `param_init_fn` that materialises an ignored module it was not called on (natively it is
  then sharded) is named in a warning;
- the low-CPU recipe (`sync_module_states`, rank 0 real, meta elsewhere) with an ignored
  module inside a unit is refused on every rank (the ranks' units differ);
- units inside units, a size-based policy, hand-nested wrappers, `use_orig_params=False`, a
  module with buffers only, and the Zeta and YaFSDP front-ends on a meta model;
- a `param_init_fn` that is not callable is refused with a ValueError, as natively.
"""

from __future__ import annotations

import pytest

from tests.frontends import init_native_more_cases as C
from tests.frontends.test_init_native import same_state
from tests.world import case_result as case
from tests.world import run_world


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["ignored_module_inside_unit",
                                  "ignored_states_module_inside_unit",
                                  "ignored_module_in_root_and_unit",
                                  "ignored_parameters_on_meta",
                                  "only_an_ignored_parameter_on_meta",
                                  "nested_units_param_init_fn", "size_based_policy",
                                  "original_params_false", "hand_nested", "buffers_only_module",
                                  "zeta_on_meta", "yafsdp_on_meta"])
def test_initial_weights_and_buffers_equal_native_bit_for_bit(world, name, rank):
    result = case(world, name, rank)
    same_state(result["ours"], result["native"])


@pytest.mark.parametrize("name, meta", [
    ("ignored_module_inside_unit", []),
    ("ignored_states_module_inside_unit", []),
    ("ignored_module_in_root_and_unit", ["head.weight", "head.bias"]),
    ("only_an_ignored_parameter_on_meta", ["head.weight"]),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_what_stays_on_meta_is_what_native_leaves_there(world, name, meta, rank):
    result = case(world, name, rank)
    assert result["native"]["meta_after_wrap"] == meta, "native changed"
    assert result["ours"]["meta_after_wrap"] == meta


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name, sharded", [
    ("ignored_module_inside_unit", True),
    ("ignored_states_module_inside_unit", True),
    ("ignored_parameters_on_meta", True),
    ("only_an_ignored_parameter_on_meta", False),
])
def test_ignored_parameters_materialised_by_the_wrap_are_sharded_as_natively(world, name,
                                                                             sharded, rank):
    """FSDP1 knows ignored parameters by identity, and materialising makes new ones."""
    result = case(world, name, rank)
    assert result["ours"]["shapes"] == result["native"]["shapes"]
    assert all((len(shape) == 1) == sharded for shape in result["native"]["shapes"].values())


def test_ignored_parameters_sharded_after_materialising_are_named_in_a_warning(world):
    warned = [text for text in case(world, "ignored_parameters_on_meta")["ours"]["warnings"]
              if "ignored parameters on the meta device" in text]
    assert len(warned) == 1 and "blocks.1.out.weight, head.weight" in warned[0]


def test_a_param_init_fn_that_materialises_an_ignored_module_is_named_in_a_warning(world):
    """Natively the reached parameters are then sharded; ours keeps them ignored and says so."""
    result = case(world, "param_init_fn_reaching_an_ignored_module", 1)
    assert len(result["native"]["shapes"]["head.weight"]) == 1, "native changed"
    assert result["ours"]["shapes"]["head.weight"] == (4, 4)
    warned = [text for text in result["ours"]["warnings"]
              if "gave storage to ignored parameters" in text]
    assert len(warned) == 1 and "head.weight" in warned[0] and "recurse=False" in warned[0]


def test_the_low_cpu_recipe_with_an_ignored_module_inside_a_unit_is_refused_on_every_rank(
        world):
    """Rank 0 (real) leaves it alone, the meta ranks shard it: the units differ."""
    for rank in (0, 1):
        message = case(world, "low_cpu_sync_ignored_inside_unit", rank)["ours"]["raised"]
        assert message and "ranks disagree" in message and "blocks.0.out.weight" in message


@pytest.mark.parametrize("name", ["ignored_states_module_inside_unit",
                                  "nested_units_param_init_fn"])
def test_param_init_fn_is_called_on_the_same_modules_in_the_same_order(world, name):
    result = case(world, name)
    assert result["ours"]["calls"] == result["native"]["calls"]


def test_a_param_init_fn_that_is_not_callable_is_refused_as_natively(world):
    result = case(world, "param_init_fn_not_callable")
    assert result["native"]["raised"] == "ValueError"
    assert result["ours"]["raised"] == "ValueError"
    assert "param_init_fn=3" in result["ours"]["message"]
