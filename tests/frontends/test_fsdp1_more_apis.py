"""FSDP1 APIs real programs use beyond the everyday ones, against native torch FSDP1 in one
spawned CPU/gloo world of two ranks (fsdp1_more_apis_cases.py):

- LOCAL_STATE_DICT: `state_dict_type` / `set_state_dict_type` with it, one ShardedTensor per
  flat group (under our own keys: see [Note: LOCAL_STATE_DICT keys are ours, not native
  FSDP1's] in fsdp_bridge/engine/local_state.py), a torch.save / torch.load round trip of the
  model and its optimizer that resumes bit for bit (an ignored module kept whole, as native);
  a native LOCAL dict, or a plain tensor for a flat piece, is refused by name;
- `sharded_optim_state_dict` / `flatten_sharded_optim_state_dict` (deprecated in torch, with
  its FutureWarning): resume bit for bit, from our dict and from native's, and native resumes
  from ours;
- `scatter_full_optim_state_dict` and `shard_full_optim_state_dict` without `optim` (keyed by
  position in `model.parameters()`), other ranks passing None or {};
- `optim_state_dict_to_load` under `FullOptimStateDictConfig(rank0_only=True)`, where rank 0
  alone holds the dict;
- the wrapper's `process_group`, `rank` and `world_size` (default, given, NO_SHARD, hybrid).

"Bit for bit": a resumed run's losses and final full state equal the uninterrupted run's of the
same dialect exactly; ours and native's uninterrupted runs agree to fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import fsdp1_more_apis_cases as C
from tests.world import case_result as case
from tests.world import run_world

TOL = dict(rtol=1e-5, atol=1e-6)
RANKS = [0, 1]


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


def same_run(actual: dict, expected: dict, what: str) -> None:
    """Exactly the same losses and final full state."""
    assert actual["losses_rest"] == expected["losses_rest"], what
    assert list(actual["state"]) == list(expected["state"]), what
    for key, value in expected["state"].items():
        assert torch.equal(actual["state"][key], value), f"{what}: {key} differs"


def close_runs(ours: dict, native: dict) -> None:
    torch.testing.assert_close(torch.tensor(ours["losses_rest"]),
                               torch.tensor(native["losses_rest"]), **TOL)
    for key, value in native["state"].items():
        torch.testing.assert_close(ours["state"][key], value, **TOL)


def resumes_exactly(out: dict, cross: bool = True) -> None:
    close_runs(out["ours"], out["native"])
    sources = ("native", "ours")
    for target in sources:
        for source in sources:
            if cross or source == target:
                name = f"{target}_from_{source}"
                same_run(out[name], out[target], name)
                if f"{name}_1" in out:
                    same_run(out[f"{name}_1"], out[target], f"{name} (others pass {{}})")


# -- LOCAL_STATE_DICT ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", RANKS)
def test_local_state_dict_round_trip_resumes_bit_for_bit(world, rank):
    out = case(world, "local_state_dict", rank)
    resumes_exactly(out, cross=False)


@pytest.mark.parametrize("rank", RANKS)
def test_local_state_dict_holds_one_sharded_flat_piece_per_group_like_native(world, rank):
    out = case(world, "local_state_dict", rank)
    ours, native = out["describe_ours"], out["describe_native"]
    assert ours["config"] == native["config"] == (
        "LOCAL_STATE_DICT", "LocalStateDictConfig", "LocalOptimStateDictConfig")
    assert len(ours["flat_keys"]) == len(native["flat_keys"]) == 4  # root + 3 layers
    assert ours["flat_numel"] == native["flat_numel"]  # every parameter element, no padding
    assert ours["local_numel"] == native["local_numel"] == native["flat_numel"] // 2
    # Our own key names, in native's order (root first, then the layers).
    assert all(key.split(".")[-2] == "_bridge_flat_param" for key in ours["flat_keys"])
    ours_units = [k[: k.index("_bridge_flat_param")].rstrip(".") for k in ours["flat_keys"]]
    native_units = [k[: -len("_flat_param")].rstrip(".") for k in native["flat_keys"]]
    assert ours_units == native_units
    assert list(ours["whole"]) == list(native["whole"])


@pytest.mark.parametrize("rank", RANKS)
def test_local_state_dict_keeps_an_ignored_module_whole_and_resumes_bit_for_bit(world, rank):
    out = case(world, "local_state_dict_ignored_head", rank)
    resumes_exactly(out, cross=False)
    ours, native = out["describe_ours"], out["describe_native"]
    assert list(ours["whole"]) == list(native["whole"]) == ["lm_head.weight"]
    assert torch.equal(ours["whole"]["lm_head.weight"], native["whole"]["lm_head.weight"])
    assert ours["flat_numel"] == native["flat_numel"]


@pytest.mark.parametrize("rank", RANKS)
def test_local_state_dict_under_no_shard_is_the_full_one_as_native(world, rank):
    out = case(world, "local_state_dict_no_shard", rank)
    resumes_exactly(out)
    ours, native = out["values_ours"], out["values_native"]
    assert list(ours) == list(native)
    for key, value in native.items():
        assert type(ours[key]) is torch.Tensor and torch.equal(ours[key], value), key
    assert out["warned_ours"] and out["warned_native"]


@pytest.mark.parametrize("rank", RANKS)
def test_a_native_local_state_dict_is_refused_by_name_and_nothing_loads(world, rank):
    out = case(world, "local_state_dict", rank)
    message = out["native_into_ours"]
    assert message is not None, "a native LOCAL dict must not load into ours"
    assert "'_flat_param'" in message and "native torch FSDP1" in message
    assert "FULL_STATE_DICT or SHARDED_STATE_DICT" in message
    assert out["unchanged_after_refusal"]


@pytest.mark.parametrize("rank", RANKS)
def test_a_local_state_dict_with_a_plain_tensor_is_refused_naming_the_key(world, rank):
    key, message = case(world, "local_state_dict", rank)["plain_tensor_refused"]
    assert repr(key) in message and "ShardedTensor" in message


# -- sharded_optim_state_dict / flatten_sharded_optim_state_dict ---------------------------------


@pytest.mark.parametrize("rank", RANKS)
def test_sharded_optim_state_dict_resumes_bit_for_bit_across_dialects(world, rank):
    resumes_exactly(case(world, "sharded_optim", rank))


@pytest.mark.parametrize("rank", RANKS)
def test_sharded_optim_state_dict_has_native_keys_and_warns_as_deprecated(world, rank):
    out = case(world, "sharded_optim", rank)
    ours, native = out["ours"]["described"], out["native"]["described"]
    assert ours["warned"] and native["warned"]
    assert sorted(ours["keys"]) == sorted(native["keys"])
    assert ours["per_param"] == native["per_param"]
    assert ours["groups"] == native["groups"]


@pytest.mark.parametrize("rank", RANKS)
def test_flatten_sharded_optim_state_dict_leaves_the_optimizer_alone_as_native(world, rank):
    out = case(world, "sharded_optim", rank)
    assert out["native_from_native"]["flatten_left_optimizer_alone"]
    assert out["ours_from_ours"]["flatten_left_optimizer_alone"]
    assert out["ours_from_native"]["flatten_left_optimizer_alone"]


# -- full optimizer state dicts without an optimizer; rank-0-only loads --------------------------


@pytest.mark.parametrize("rank", RANKS)
def test_scatter_full_optim_state_dict_without_optim_resumes_bit_for_bit(world, rank):
    out = case(world, "scatter_without_optim", rank)
    resumes_exactly(out)
    assert out["ours"]["described"] == out["native"]["described"]  # rank 0 only holds it
    assert bool(out["ours"]["described"]) == (rank == 0)


@pytest.mark.parametrize("rank", RANKS)
def test_shard_full_optim_state_dict_without_optim_resumes_bit_for_bit(world, rank):
    resumes_exactly(case(world, "scatter_without_optim", rank)["shard"])


@pytest.mark.parametrize("rank", RANKS)
def test_rank0_only_optimizer_load_resumes_bit_for_bit(world, rank):
    out = case(world, "rank0_only_load", rank)
    resumes_exactly(out)
    assert out["ours"]["described"] == out["native"]["described"]
    assert bool(out["ours"]["described"]) == (rank == 0)


# -- the wrapper's process group --------------------------------------------------------------


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("setting", ["default", "given", "no_shard", "hybrid"])
def test_process_group_rank_and_world_size_match_native(world, rank, setting):
    """The group parameters are sharded over: the world's, the one given, the world's under
    NO_SHARD, and a hybrid strategy's shard group (here one rank each)."""
    out = case(world, "process_group", rank)
    ours, native = out[f"ours_{setting}"], out[f"native_{setting}"]
    assert native["is_expected_group"] and ours["is_expected_group"]
    assert ours == native
    expected = (0, 1) if setting == "hybrid" else (rank, 2)
    assert (ours["rank"], ours["world_size"]) == expected
