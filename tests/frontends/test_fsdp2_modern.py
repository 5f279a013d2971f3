"""What the modern FSDP2 stacks (torchtitan, torchtune) turn on, against native `fully_shard` in
one CPU/gloo world of two ranks (fsdp2_modern_cases.py):

- transformer blocks compiled in place with `block.compile(fullgraph=True)` before `fully_shard`
  (torchtitan's order): the compiler traces the block's forward, not our gather hooks, and three
  AdamW steps end on native's losses and weights bit for bit (aot_eager; inductor in the opt-in
  `FSDP_BRIDGE_SLOW_TESTS=1` run);
- torchao's float8 weights with float8 all-gather (emulated on the CPU): the local tensors stay
  torchao's `WeightWithDynamicFloat8CastTensor`, and three AdamW steps (also with torchtitan's
  `precompute_float8_dynamic_scale_for_fsdp` after each step) end on native's losses and
  weights bit for bit;
- torchao's NF4 weights (QLoRA: a frozen NF4 base weight beside a trainable low-rank adapter,
  torchtune's layout) gather their quantised blocks through their hooks and train as natively,
  bit for bit;
- all-gather hooks attached to a weight's local tensor after `fully_shard` (torch's own "monkey
  patch" recipe) are called, and train as natively;
- weights that are torch's TwoTensor (values held twice, every op run on both), their two inner
  tensors started apart, with hooks on the class gathering both or hooks on each local object
  gathering the object itself: both inner tensors train as natively, bit for bit;
- a weight split unevenly on dim 0 (9 rows over 2 ranks) whose pre-all-gather hook pads its
  rows to the full chunk trains as natively; unpadded, every rank raises an AssertionError
  naming the parameter and the ranks (natively the ranks with full chunks wait in the
  all-gather);
- user collectives (`set_custom_all_gather` / `set_custom_reduce_scatter`, torch's AllGather /
  ReduceScatter objects running torch's collectives) are called as often as natively and train
  bit for bit;
- `dp_mesh_dims` (torch >= 2.12: parameters are Replicate DTensors on the SPMD mesh, inputs
  Shard(0) DTensors): parameters and gradients are placed as natively, and training matches
  bit for bit;
- a root given `reshard_after_forward=True` (or an int) holds sharded DTensors after forward, as
  natively; left at the default it keeps its gathered parameters;
- a frozen parameter of another dtype beside trainable ones in one call trains as natively;
- each refused `fully_shard` raises native's exception type and carries native's words (the
  patterns torch's own tests match): a 3-D mesh, a 2-D mesh without dimension names, a scalar
  parameter, a non-contiguous one, an uneven split on dim 1, a placement on a dim the parameter
  lacks, and a forward on meta parameters (naming the parameters native names);
- a `shard_placement_fn` returning a `ShardPlacementResult` over the call's own groups is
  accepted, as natively (one over another mesh: test_fsdp2_round3.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.fsdp

from tests.frontends import fsdp2_modern_cases as C
from tests.world import case_result as case
from tests.world import run_world

SLOW = os.environ.get("FSDP_BRIDGE_SLOW_TESTS") == "1"


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


def _bit_identical(result):
    native, ours = result["native"], result["ours"]
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@pytest.mark.parametrize("rank", [0, 1])
def test_per_block_fullgraph_compile_trains_as_native(world, rank):
    result = case(world, "per_block_compile", rank)
    _bit_identical(result)
    # Compiled as often as natively: the gathered parameters do not recompile the blocks.
    assert 0 < result["ours"]["graphs"] == result["native"]["graphs"], result["ours"]["graphs"]


@pytest.mark.skipif(not SLOW, reason="inductor compiles C++ kernels (tens of seconds): set "
                    "FSDP_BRIDGE_SLOW_TESTS=1")
def test_per_block_fullgraph_inductor_compile_trains_as_native():
    results = run_world(C.run_slow_cases, 2)
    for rank in (0, 1):
        _bit_identical(case(results, "per_block_compile_inductor", rank))


@pytest.mark.parametrize("name", ["float8_all_gather", "float8_precomputed_scale"])
def test_float8_all_gather_trains_as_native(world, name):
    result = case(world, name, 0)
    assert result["native"]["local_type"] == "WeightWithDynamicFloat8CastTensor"
    assert result["ours"]["local_type"] == result["native"]["local_type"]
    _bit_identical(result)
    # The linear weights (1024 of the 1104 elements) were gathered as float8 bytes.
    ours = result["ours"]
    assert ours["gathered_bytes"] == 1024 + (1104 - 1024) * 4 < ours["fp32_bytes"] / 2, ours


@pytest.mark.parametrize("rank", [0, 1])
def test_nf4_qlora_trains_as_native(world, rank):
    result = case(world, "nf4_qlora", rank)
    assert result["native"]["local_type"] == "NF4Tensor"
    assert result["ours"]["local_type"] == result["native"]["local_type"]
    _bit_identical(result)


def test_hooks_attached_after_fully_shard_are_called_as_native(world):
    result = case(world, "monkey_patched_hooks", 0)
    assert result["native"]["calls"] == ["post", "pre"]
    assert result["ours"]["calls"] == result["native"]["calls"]
    _bit_identical(result)


@pytest.mark.parametrize("name", ["two_tensor", "two_tensor_hooks_on_objects"])
def test_a_subclass_holding_its_values_twice_trains_both_as_native(world, name):
    for rank in (0, 1):
        result = case(world, name, rank)
        assert result["ours"]["local_type"] == result["native"]["local_type"] == "TwoTensor"
        _bit_identical(result)
        # The two inner tensors started apart and were trained apart.
        full = result["ours"]["full"]
        assert not torch.equal(full["0.weight.a"], full["0.weight.b"])


def test_an_uneven_split_gathered_through_padding_hooks_trains_as_native(world):
    for rank in (0, 1):
        result = case(world, "uneven_extension", rank)
        assert result["ours"]["local_type"] == result["native"]["local_type"] == "BF16Gathered"
        _bit_identical(result)


@pytest.mark.parametrize("rank", [0, 1])
def test_unpadded_hook_inputs_of_an_uneven_split_raise_on_every_rank(world, rank):
    result = case(world, "uneven_extension_unpadded", rank)
    assert result["types"][0] == "AssertionError", result
    message = result["message"]
    assert "parameter '0.weight' is unevenly sharded" in message, message
    assert "padded sharded size torch.Size([5, 3])" in message, message
    assert "rank(s) [1]" in message, message


def test_user_collectives_are_called_and_train_as_native(world):
    result = case(world, "custom_collectives", 0)
    # One gather per block in forward and one in backward, per step; one reduction per block.
    assert result["native"]["calls"] == {"all_gather": 12, "reduce_scatter": 6}
    assert result["ours"]["calls"] == result["native"]["calls"]
    _bit_identical(result)


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"),
                    reason=f"torch {torch.__version__} has no DataParallelMeshDims (dp_mesh_dims "
                    "needs torch >= 2.12)")
@pytest.mark.parametrize("rank", [0, 1])
def test_dp_mesh_dims_trains_as_native(world, rank):
    result = case(world, "spmd_mesh_dims", rank)
    native, ours = result["native"], result["ours"]
    assert (ours["placements"], ours["grad_placements"]) == (native["placements"],
                                                           native["grad_placements"])
    _bit_identical(result)


@pytest.mark.parametrize("value", ["true", "int"])
def test_a_root_given_reshard_after_forward_reshards_as_native(world, value):
    result = case(world, f"root_reshard_{value}", 0)
    native, ours = result["native"], result["ours"]
    assert native["after_forward"] == {"scale": "DTensor", "out.weight": "DTensor"}
    assert ours["after_forward"] == native["after_forward"]
    _bit_identical(result)


def test_a_root_left_at_the_default_stays_gathered_as_native(world):
    result = case(world, "root_reshard_default", 0)
    assert result["native"]["after_forward"]["scale"] == "Parameter"
    assert result["ours"]["after_forward"] == result["native"]["after_forward"]
    _bit_identical(result)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_frozen_parameter_of_another_dtype_trains_as_native(world, rank):
    _bit_identical(case(world, "frozen_other_dtype", rank))


@pytest.mark.parametrize("rank", [0, 1])
def test_post_accumulate_grad_hooks_run_once_per_reduction_as_native(world, rank):
    result = case(world, "optimizer_in_backward", rank)
    _bit_identical(result)  # the hooks' optimizers stepped the same parameters the same way
    native, ours = result["native"], result["ours"]
    assert ours["calls"] == native["calls"] and set(native["calls"].values()) == {C.STEPS}
    assert not any(name.startswith("unused") for name in native["calls"])


# check -> FSDP2's own words (the pattern torch's own tests match).
NATIVE_WORDS = {
    "mesh_ndim": r"fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
    "mesh_2d_unnamed": r"Please init the 2D mesh for HSDP with mesh_dim_names specified",
    "scalar": r"Change scalar_p to a 1D tensor with numel equal to 1\.",
    "non_contiguous": r"FSDP does not support non-contiguous parameters",
    "uneven_dim1": r"FSDP does not support uneven sharding on dim 1",
    "invalid_shard_dim": r"Shard dim 1 is invalid for 1D tensor",
    "meta_forward": (r"FSDP parameters should be materialized from meta device before training, "
                     r"but the following were still on meta device: \['0.weight', '0.bias'\]"),
}


@pytest.mark.parametrize("check", sorted(NATIVE_WORDS))
def test_fully_shard_checks_raise_natives_exception_type_and_words(world, check):
    import re

    result = case(world, "init_errors", 0)
    native, ours = result["native"][check], result["ours"][check]
    assert native["types"], f"native must raise for {check}"
    assert re.search(NATIVE_WORDS[check], native["message"]), native["message"]
    # Ours is of native's type (it may also be a ValueError) and carries native's words.
    assert native["types"][0] in ours["types"], (native["types"], ours["types"])
    assert ours["message"] and re.search(NATIVE_WORDS[check], ours["message"]), ours["message"]


def test_a_placement_result_naming_the_calls_own_groups_is_accepted_as_native(world):
    result = case(world, "init_errors", 0)
    assert result["native"]["placement_result"]["types"] == [], "native accepts it"
    assert result["ours"]["placement_result"]["types"] == []
