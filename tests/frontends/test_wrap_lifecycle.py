"""Around the wrap (wrap_cases.py, one spawned gloo world of 2): an optimizer built before
wrapping, casting a wrapped model, nested FSDP1 wrappers with their own process group, a wrap
that fails halfway, and fully_shard after the first forward.

Tolerances: fp32 runs are compared with native FSDP1 (same run) or the single-process reference
at rtol 1e-5 / atol 1e-6 (they agree to ~1e-7). float64 runs (loss computed in float64) at
rtol 1e-12 / atol 1e-12, tight enough that an fp32 computation would fail it: they agree with
native to the last bit and with the reference to ~1e-16. YaFSDP reduces gradients in fp32
(its rule, kept after a cast), so its float64 run is compared with the float64 reference at
rtol 1e-8 / atol 1e-10 (measured: ~4e-10; an fp32 computation is ~5e-8 off). bf16 and fp16
runs (Hugging Face's fp32 loss over low-precision logits) with native at rtol 1e-5 / atol 1e-6:
bf16 is identical; fp16 differs by ~1e-6 (native FSDP1 divides fp16 gradients by the world
size before summing them, we divide the sum once, so the rounding differs).
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import wrap_cases as C
from tests.world import case_result as case
from tests.world import run_world

FP32 = dict(rtol=1e-5, atol=1e-6)
FP64 = dict(rtol=1e-12, atol=1e-12)
FP64_REDUCED_IN_FP32 = dict(rtol=1e-8, atol=1e-10)


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


def close(actual, expected, **tolerance):
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected),
                               **(tolerance or FP32))


# -- an optimizer built before wrapping ---------------------------------------------------------


def test_fsdp1_optimizer_built_before_wrapping_trains_like_native(world):
    result = case(world, "fsdp1_optimizer_before_wrap")
    for which in ("native", "ours"):
        assert result[which]["same_objects"], which
        assert result[which]["changed"] == result[which]["params"], result
    close(result["ours"]["losses"], result["native"]["losses"])
    close(result["ours"]["losses"], case(world, "reference"))


def test_yafsdp_optimizer_built_before_wrapping_trains_like_the_reference(world):
    close(case(world, "yafsdp_optimizer_before_wrap"), case(world, "reference"))


def test_fsdp2_optimizer_built_before_fully_shard_is_refused_by_name(world):
    result = case(world, "fsdp2_optimizer_before_fully_shard")
    assert result["native"]["error"] is None and result["native"]["changed"] == 0, result
    message = result["ours"]["error"]
    assert message is not None, result
    for part in ("AdamW", "'model.embed_tokens.weight'", "built before fully_shard",
                 "Build the optimizer after"):
        assert part in message, message
    assert result["ours"]["changed"] == 0, result  # refused before any update


# -- casting the wrapped model ------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tolerance", [("float64", FP64), ("bfloat16", FP32),
                                              ("half", FP32)])
def test_fsdp1_cast_after_wrapping_trains_like_native(world, dtype, tolerance):
    result = case(world, f"fsdp1_{dtype}_after_wrap")
    expected = [str(torch.float16 if dtype == "half" else getattr(torch, dtype))]
    for which in ("native", "ours"):
        assert result[which]["dtypes"] == [result[which]["logits_dtype"]] == expected, result
    close(result["ours"]["losses"], result["native"]["losses"], **tolerance)
    if dtype == "float64":
        close(result["ours"]["losses"], case(world, "reference_float64"), **FP64)


def test_yafsdp_float64_after_wrapping_trains_like_the_float64_reference(world):
    close(case(world, "yafsdp_float64_after_wrap"), case(world, "reference_float64"),
          **FP64_REDUCED_IN_FP32)


def test_casting_part_of_a_unit_is_refused_by_name(world):
    message = case(world, "fsdp1_cast_of_part_of_a_unit")
    assert message is not None
    for part in ("'model.layers.0.mlp.gate_proj.weight'", "torch.float16",
                 "Cast the whole wrapped model"):
        assert part in message, message


# -- nested wrappers with a process group of their own ------------------------------------------


def test_nested_wrapper_with_its_own_group_is_refused_and_the_fix_trains_like_native(world):
    for rank in (0, 1):
        result = case(world, "fsdp1_nested_process_group", rank)
        message = result["error"]
        assert message is not None, result
        for part in ("process_group (of the nested wrapper at 'expert')", f"[{rank}]",
                     "[0, 1]", "ignored_modules"):
            assert part in message, message
        assert result["inner_kept"], result
    result = case(world, "fsdp1_nested_process_group")
    close(result["ignored_modules"], result["native"])


def test_nested_wrapper_with_another_group_over_the_same_ranks_trains_like_native(world):
    result = case(world, "fsdp1_nested_same_ranks")
    close(result["ours"], result["native"])


# -- a wrap that fails halfway ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["failed_wrap_fsdp1", "failed_wrap_yafsdp",
                                  "failed_wrap_sync_module_states",
                                  "failed_wrap_over_a_nested_wrapper"])
def test_a_late_failure_leaves_the_model_exactly_as_it_was(world, name):
    for rank in (0, 1):
        result = case(world, name, rank)
        assert result["error"] == "injected late failure", result
        assert result["same_state"] and result["same_objects"], result
        assert result["same_hooks"] and result["no_engine_state"], result


def test_buffers_overwritten_by_sync_module_states_get_their_values_back(world):
    sums = [case(world, "failed_wrap_sync_module_states", rank)["inv_freq_sum"] for rank in (0, 1)]
    assert sums[1] != sums[0], sums  # rank 1 keeps its own values, not rank 0's


def test_a_model_left_by_a_failed_wrap_still_trains(world):
    result = case(world, "failed_wrap_fsdp1")
    assert result["loss_after"] == result["loss_fresh"], result
    nested = case(world, "failed_wrap_over_a_nested_wrapper")
    assert nested["inner_kept"], nested
    assert nested["losses"][0] == nested["losses"][1], nested


def test_a_failing_param_init_fn_leaves_the_model_on_meta(world):
    result = case(world, "failed_wrap_meta_init")
    assert result == {"error": "init failed", "all_meta": True, "same_objects": True}, result


def test_fully_shard_refusing_a_scalar_converts_nothing(world):
    result = case(world, "failed_fully_shard_with_a_scalar")
    assert result["error"] is not None and "'1.scale'" in result["error"], result
    assert result["same_state"] and result["same_objects"] and result["no_dtensor"], result
    assert result["class"] == "Sequential", result


# -- fully_shard after the first forward --------------------------------------------------------


def test_fully_shard_after_the_first_forward_says_what_happened(world):
    message = case(world, "fully_shard_after_first_forward")
    assert message is not None
    for part in ("module=LlamaDecoderLayer", "fixed at the model's first forward",
                 "has already run", "Call fully_shard on every module before the first forward"):
        assert part in message, message
