"""The unit-by-unit wrap from meta initialises as native FSDP1 does, checked side by side in one
CPU/gloo world of two ranks (init_native_cases.py), initial weights and buffers bit for bit:

- modules are materialised breadth-first from each unit's module (containers before their
  children's children), so `reset_parameters()` draws the same random numbers into the same
  tensors;
- `param_init_fn` is called on every module of a unit, containers included, in that order;
- a module with parameters or buffers on meta and no `reset_parameters` is refused with an
  AttributeError naming it (it trained on uninitialised memory);
- a tiny Hugging Face Llama and GPT-2 (tied embeddings) initialised by their own
  `_init_weights` through `param_init_fn`;
- a weight tied across two units;
- `ignored_modules` are left as they are (still on meta), and the user's own initialisation of
  them after the wrap draws the same random numbers as natively;
- the low-CPU recipe (`sync_module_states=True`, rank 0 real, the other ranks on meta with a
  `param_init_fn` that only gives storage), with and without an ignored module: every rank
  holds rank 0's weights. Native FSDP1 refuses `sync_module_states` on the CPU, so its side is
  what the broadcast must give: rank 0's model wrapped natively on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import init_native_cases as C
from tests.world import case_result as case
from tests.world import run_world


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


def same_state(ours: dict, native: dict) -> None:
    for kind in ("params", "buffers"):
        assert list(ours[kind]) == list(native[kind]), kind
        for name, value in native[kind].items():
            assert torch.equal(ours[kind][name], value), f"{kind} {name} differs from native"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["nested_reset", "nested_param_init_fn", "llama_param_init_fn",
                                  "gpt2_param_init_fn", "tied_across_units",
                                  "ignored_module_on_meta", "low_cpu_sync",
                                  "low_cpu_sync_ignored"])
def test_initial_weights_and_buffers_equal_native_bit_for_bit(world, name, rank):
    result = case(world, name, rank)
    same_state(result["ours"], result["native"])


def test_param_init_fn_is_called_on_every_module_in_native_order(world):
    result = case(world, "nested_param_init_fn")
    assert "Sequential" in result["native"]["calls"], "containers are called natively too"
    assert result["ours"]["calls"] == result["native"]["calls"]


def test_a_meta_module_without_reset_parameters_is_refused_as_native(world):
    result = case(world, "no_reset_parameters")
    assert result["native"]["raised"] == "AttributeError"
    assert result["ours"]["raised"] == "AttributeError"
    assert "'1'" in result["ours"]["message"] and "param_init_fn" in result["ours"]["message"]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_ignored_module_on_meta_stays_on_meta_as_native(world, rank):
    result = case(world, "ignored_module_on_meta", rank)
    assert result["native"]["head_meta_after_wrap"] == ["weight", "bias"], "native changed"
    assert result["ours"]["head_meta_after_wrap"] == ["weight", "bias"]


def test_low_cpu_recipe_leaves_an_ignored_module_as_each_rank_built_it(world):
    """Not materialised on the meta ranks, not broadcast from rank 0 (native FSDP1 broadcasts
    only the parameters it manages)."""
    assert case(world, "low_cpu_sync_ignored", 0)["ours"]["head_meta_after_wrap"] == []
    assert case(world, "low_cpu_sync_ignored", 1)["ours"]["head_meta_after_wrap"] == [
        "weight", "bias"]


@pytest.mark.parametrize("name", ["low_cpu_sync", "low_cpu_sync_ignored"])
def test_low_cpu_recipe_gives_every_rank_rank_0s_weights(world, name):
    first, second = case(world, name, 0)["ours"], case(world, name, 1)["ours"]
    same_state(second, first)


def test_sync_module_states_broadcasts_ignored_buffers_not_ignored_parameters(world):
    first, second = case(world, "sync_ignored_buffer", 0)["ours"], case(
        world, "sync_ignored_buffer", 1)["ours"]
    assert torch.equal(first["stat"], torch.zeros(2)) and torch.equal(second["stat"], first["stat"])
    assert not torch.equal(second["weight"], first["weight"]), "ignored parameters stay each rank's"
