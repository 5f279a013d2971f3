"""The unit-by-unit wrap from meta initialises as native FSDP1 does, checked side by side in one
CPU/gloo world of two ranks (init_native_cases.py), initial weights and buffers bit for bit:

- modules are materialised breadth-first from each unit's module (containers before their
  children's children), so `reset_parameters()` draws the same random numbers into the same
  tensors;
- `param_init_fn` is called on every module of a unit, containers included, in that order;
- a module with parameters or buffers on meta and no `reset_parameters` is refused with an
  AttributeError naming it (it trained on uninitialised memory);
- a tiny Hugging Face Llama initialised by its own `_init_weights` through `param_init_fn`.
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
@pytest.mark.parametrize("name", ["nested_reset", "nested_param_init_fn", "llama_param_init_fn"])
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
