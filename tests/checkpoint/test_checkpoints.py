"""Checkpoints across front-ends, world sizes (2 -> 4 -> 1 -> 2), native FSDP1/FSDP2 and
Hugging Face, bit-identical resume and bad input. Four spawned worlds in all (module fixture);
each test asserts on one part of their results."""

from __future__ import annotations

import pytest

from tests.checkpoint import cases as C
from tests.native_torch import skip_native
from tests.world import run_world

TIGHT = 1e-6  # fp32 one-step agreement asked for (rtol 1e-5 / atol 1e-6); we get ~1e-7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    first = run_world(C.world2_first, 2, directory)
    four = run_world(C.world4, 4, directory)
    one = run_world(C.world1, 1, directory)
    last = run_world(C.world2_last, 2, directory)
    return {"first": first, "four": four, "one": one, "last": last}


def test_reshard_2_4_1_2_identical_params_and_optimizer_state(runs):
    for stage in ("four", "one", "last"):
        for rank_result in runs[stage]:
            assert rank_result["reshard"]["after_load"] == {"params": 0.0, "optim": 0.0}, stage


def test_reshard_continues_training_identically(runs):
    # The step after each load: same loss wherever the state went (world 4 sums differently).
    losses = [runs[s][0]["reshard"]["losses"][0] for s in ("first", "four", "one", "last")]
    assert max(losses) - min(losses) < 1e-6, losses


def test_resume_bit_identical(runs):
    for rank_result in runs["first"]:
        assert rank_result["resume"] == {"bit_identical": True, "max_diff": 0.0}


@pytest.mark.parametrize("case", ["other_model", "extra_keys", "wrong_shapes", "set_wrong_shape",
                                  "truncated", "no_metadata"])
def test_bad_input_clear_error(runs, case):
    for rank_result in runs["first"]:
        result = rank_result["bad_inputs"][case]
        assert result["ok"], result


def test_bad_input_changes_nothing(runs):
    assert runs["first"][0]["bad_inputs"]["files_untouched"]
    assert all(r["bad_inputs"]["model_untouched"] for r in runs["first"])


def test_per_rank_layout_at_another_world_size_is_refused(runs):
    for rank_result in runs["four"]:
        assert rank_result["legacy"]["model"]["ok"], rank_result["legacy"]["model"]
        assert rank_result["legacy"]["optim"]["ok"], rank_result["legacy"]["optim"]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hugging_face_both_ways(runs, model):
    result = runs["first"][0][f"hf_{model}"]
    assert result["in_after_load"] == 0.0
    assert result["in_step"] < TIGHT
    assert result["out_after_load"] == 0.0
    assert "model.safetensors" in result["out_files"]


@pytest.mark.parametrize("key", ["native_fsdp2", "native_fsdp2_gpt2"])
def test_native_fsdp2_both_ways(runs, key):
    skip_native(runs["first"][0][key])
    for rank_result in runs["first"]:
        result = rank_result[key]
        assert result["in_after_load"] == 0.0 and result["out_after_load"] == 0.0, result
        assert result["in_step"] < TIGHT and result["out_step"] < TIGHT, result


def test_llama_recipes_sharded_checkpoint_on_our_fsdp1(runs):
    # FSDP.state_dict_type(SHARDED_STATE_DICT) + dcp.save / dcp.load + model.load_state_dict,
    # written as llama-recipes writes it, the optimizer through FSDP.optim_state_dict /
    # optim_state_dict_to_load: ours -> ours, native FSDP1 -> ours, ours -> native FSDP1.
    for rank_result in runs["first"]:
        result = rank_result["llama_recipes"]
        assert result["ours_to_ours"] == {"params": 0.0, "optim": 0.0}, result
        assert result["ours_to_ours_step"] == 0.0, result
        assert result["native_to_ours"] == 0.0, result
        assert result["ours_to_native"] == {"params": 0.0, "optim": 0.0}, result


def test_llama_recipes_sharded_checkpoint_loads_at_other_world_sizes(runs):
    for stage in ("four", "one"):  # saved at world 2
        for rank_result in runs[stage]:
            assert rank_result["llama_recipes"] == {"params": 0.0, "optim": 0.0}, stage


def test_native_fsdp1_full_and_sharded_both_ways(runs):
    for rank_result in runs["first"]:
        result = rank_result["native_fsdp1"]
        for key in ("full_after_load", "sharded_after_load", "out_after_load"):
            assert result[key] == 0.0, (key, result)
        for key in ("full_step", "sharded_step", "out_step"):
            assert result[key] < TIGHT, (key, result)


@pytest.mark.parametrize("frontend", ["fsdp1", "yafsdp"])
def test_torch_state_dict_helpers_unpatched_on_flat_models(runs, frontend):
    # torch's get_/set_ state-dict functions, as torch ships them, on a model whose parameters
    # are flat 1-D pieces: full values equal the engine's own gather, sharded ones are row
    # DTensors, round trips are exact; plain calls keep FSDP1's local meanings.
    for rank_result in runs["first"]:
        result = rank_result[f"torch_helpers_{frontend}"]
        assert result["untouched"], result
        assert result["model_full"] == 0.0 and result["optim_full"] == 0.0, result
        assert result["model_rows"] and result["optim_rows"], result
        assert result["sharded_equals_full"] == 0.0, result
        assert result["local_optim_pieces"], result
        for name in ("full", "sharded", "flattened", "broadcast"):
            assert result[f"round_trip_{name}"] == 0.0, (name, result)
        assert result["unconverted_refused"]["ok"], result["unconverted_refused"]
    first_name = runs["first"][0]["torch_helpers_fsdp1"]["plain_names_kept"]
    assert first_name.startswith("_fsdp_wrapped_module."), first_name
