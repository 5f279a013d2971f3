"""FSDP2 through `fsdp_bridge.fsdp` with DTensor parameters, against native `fully_shard` on the
same CPU/gloo run (world 2, one spawned world for every case, see dtensor_cases.py).

Where the math is the same (fp32: every optimizer, torch's clipping, loading, checkpoints) ours
must be bit-identical to native; bf16 compute is compared within bf16 tolerance (rtol 1.6e-2,
atol 1e-5); the single-process reference within fp32 tolerance (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import dtensor_cases as C
from tests.world import case_result as case
from tests.world import run_world

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-5)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dcp"))
    return run_world(C.run_cases, 2, directory)


def identical(actual: dict, expected: dict, what: str) -> None:
    assert list(actual) == list(expected), f"{what}: keys differ"
    for key in expected:
        assert torch.equal(actual[key], expected[key]), (
            f"{what} {key}: max diff {(actual[key] - expected[key]).abs().max().item()}")


def test_parameters_and_gradients_are_dtensors_laid_out_as_native(world):
    for rank in (0, 1):
        result = case(world, "surface", rank)
        ours, native = result["ours"], result["native"]
        assert ours["all_dtensor"] and ours["shard0"]
        assert ours["full_ok"] and ours["replicated_ok"], "full_tensor()/redistribute differ"
        assert ours["mesh_sizes"] == [2]
        for key in ("placements", "local_shapes", "numel", "grads"):
            assert ours[key] == native[key], key
        assert all(kind == "DTensor" for kind, _, _ in ours["grads"].values())


@pytest.mark.parametrize("optimizer", ["adamw_foreach", "adamw_single", "adam", "sgd_foreach",
                                       "sgd_single"])
def test_optimizers_and_clipping_are_bit_identical_to_native(world, optimizer):
    result = case(world, f"train_{optimizer}")
    ours, native = result["ours"], result["native"]
    assert ours["losses"] == native["losses"]
    assert ours["norms"] == native["norms"]  # torch's clip_grad_norm_, a DTensor, no patch
    assert ours["norms"][0][0] == "DTensor"
    identical(ours["state"], native["state"], "parameters")
    identical(ours["optim"], native["optim"], "optimizer state")
    assert ours["optim_types"] == ["DTensor"]  # optimizer state in the parameters' layout


def test_bf16_mixed_precision_matches_native(world):
    result = case(world, "train_bf16")
    ours, native = result["ours"], result["native"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                               **BF16)
    for key, value in native["state"].items():
        torch.testing.assert_close(ours["state"][key], value, **BF16)


def test_total_norm_functions_give_the_global_norm(world):
    result = case(world, "total_norm")
    reference = case(world, "reference_norms")
    for which in ("ours", "native"):
        torch.testing.assert_close(result[which]["total"], reference["total"], **FP32)
        torch.testing.assert_close(result[which]["inf"], reference["inf"], **FP32)
        torch.testing.assert_close(result[which]["after"], 0.5, **FP32)
    assert result["ours"] == result["native"]


def test_state_dict_is_sharded_and_communication_free(world):
    for rank in (0, 1):
        result = case(world, "state_dict_cost", rank)
        ours, native = result["ours"], result["native"]
        assert ours["collectives"] == 0
        assert ours["keys"] == native["keys"]
        assert ours["local_numel"] == native["local_numel"] < ours["full_numel"]


def test_load_state_dict_takes_full_replicated_and_sharded_values(world):
    result = case(world, "loading")
    ours, native = result["ours"], result["native"]
    assert "refused" in native["full"]  # native FSDP2 takes DTensors only; ours takes both
    for kind in ("full", "replicated", "sharded", "assign"):
        assert ours[kind]["equal"], kind
    for kind in ("replicated", "sharded", "assign"):
        assert ours[kind]["loss"] == native[kind]["loss"], kind
        identical(ours[kind]["state"], native[kind]["state"], kind)
    identical(ours["full"]["state"], ours["sharded"]["state"], "full vs sharded load")


def test_meta_device_recipe_gives_native_weights_and_losses(world):
    result = case(world, "meta_recipe")
    ours, native = result["ours"], result["native"]
    assert ours["inspected"] and native["inspected"]
    identical(ours["initial"], native["initial"], "initial weights")
    assert ours["losses"] == native["losses"]
    identical(ours["state"], native["state"], "trained weights")


def test_sharding_only_the_layers_trains_like_native(world):
    result = case(world, "layers_only")
    ours, native = result["ours"], result["native"]
    assert ours["layer_params_changed"] == ours["layer_params"] > 0
    assert ours["losses"] == native["losses"]
    identical(ours["layers"], native["layers"], "layer parameters")


def test_dcp_checkpoints_interoperate_with_native(world):
    result = case(world, "dcp")
    written, read = result["written"], result["read"]
    identical(written["ours"]["state"], written["native"]["state"], "trained before saving")
    for reader in ("ours", "native"):
        for writer in ("ours", "native"):
            identical(read[reader][f"plain_from_{writer}"], written[writer]["state"],
                      f"{reader} loading {writer}'s model.state_dict() checkpoint")
            dsd = read[reader][f"dsd_from_{writer}"]
            identical(dsd["loaded"], written[writer]["state"],
                      f"{reader} loading {writer}'s get_state_dict checkpoint")
    reference = read["native"]["dsd_from_native"]
    for writer in ("ours", "native"):
        assert read["ours"][f"dsd_from_{writer}"]["loss"] == reference["loss"]
        identical(read["ours"][f"dsd_from_{writer}"]["stepped"], reference["stepped"],
                  f"one step after resuming from {writer}'s optimizer state")


def test_bad_inputs_are_refused_by_name(world):
    result = case(world, "bad_inputs")
    assert "state_dict['model.layers.0.mlp.up_proj.weight']" in result["wrong_shape"]
    assert "(3, 3)" in result["wrong_shape"] and "(128, 64)" in result["wrong_shape"]
    assert "DeviceMesh((1, 2)" in result["other_mesh"]
    assert ".full_tensor()" in result["other_mesh"]
    assert "shard_placement_fn" in result["shard_dim2"] and "Shard(dim=2)" in result["shard_dim2"]
    assert "'weight'" in result["tensor_parallel"]
    # Tensor parallelism on the same mesh as the data-parallel one: no 2-D mesh to build.
    assert "tensor-parallel mesh" in result["tensor_parallel"] and "mesh['dp']" in result[
        "tensor_parallel"]
    assert "'scale'" in result["scalar"] and "scalar" in result["scalar"]
    assert "torch.float64" in result["cast_after"] and "before its first forward" in result["cast_after"]
    assert result["post_optim_event"].startswith("TypeError") and "event" in result[
        "post_optim_event"]
    assert "ranks disagree" in result["rank_dependent_buffer"]
    assert "buffer table (2,)" in result["rank_dependent_buffer"]
    assert "fully_shard once per module" in result["twice"]
    # FSDP2's exception types and words, so code and torch's own tests matching them work.
    assert result["twice_is_assertion"] and "Each distinct composable distributed API can only " \
        "be applied to a module once" in result["twice"]
    assert result["deepcopy_is_assertion"] and "FSDP does not support deepcopy" in result[
        "deepcopy"]
    assert result["distinct_states"] == 3  # fully_shard.state: one hashable state per call
    assert "torch.bfloat16 ('1.weight')" in result["mixed_dtypes"]
    assert "param_dtype" in result["mixed_dtypes"]
    # Ignoring a parameter outside the call's modules changes nothing, as in native FSDP2.
    assert result["ignored_not_in_module"] is None


@pytest.mark.parametrize("mode", ["default", "explicit_prefetching", "mixed_precision",
                                  "dcp_api"])
def test_tutorial_program_runs_and_resumes_like_native(world, mode):
    """The FSDP2 tutorial's program (meta init, inspection, prefetch hints, unshard/reshard,
    clipping, full checkpoints through DTensors or through DCP's helpers, resume)."""
    result = case(world, f"tutorial_{mode}")
    for run in ("first", "resumed"):
        ours, native = result["ours"][run], result["native"][run]
        assert ours["losses"] == native["losses"], run
        identical(ours["state"], native["state"], f"{mode} {run}")
    assert result["ours"]["resumed"]["losses"][0] != result["ours"]["first"]["losses"][0]


def test_torchtune_full_state_dict_round_trip(world):
    result = case(world, "torchtune")
    ours, native = result["ours"], result["native"]
    assert ours["round_trip"] and native["round_trip"]
    assert ours["loss"] == native["loss"]
    identical(ours["after_step"], native["after_step"], "after one step")


def test_torchtitan_style_parallelize(world):
    result = case(world, "torchtitan")
    assert result["ours"]["losses"] == result["native"]["losses"]
    identical(result["ours"]["state"], result["native"]["state"], "trained")


def test_backward_out_of_forward_order_trains_like_native(world):
    """An encoder-decoder: decoder layers reach the encoder's output, so encoder layers start
    their backward while decoder layers are still in theirs."""
    result = case(world, "encoder_decoder")
    assert result["ours"]["losses"] == result["native"]["losses"]
    identical(result["ours"]["state"], result["native"]["state"], "trained")


def test_optimizer_over_a_sub_container_trains_like_native(world):
    result = case(world, "sub_container_optimizer")
    identical(result["ours"], result["native"], "layers after training")
    untouched = C._model("llama").model.layers.state_dict()
    assert all(not torch.equal(result["ours"][k], untouched[k]) for k in untouched
               if k.endswith("proj.weight"))
