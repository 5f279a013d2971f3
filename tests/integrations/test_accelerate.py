"""`fsdp_bridge.integrations.accelerate.Accelerator` against stock accelerate on native FSDP2:
the same script, world 2 on CPU/gloo (through the test-only FSDP switch), tiny Llama: per-step
losses and clipped grad norms, final full state dicts, `save_state`/`load_state` resume (ours from
ours and from native's checkpoint), fp32 with sharded checkpoints and bf16 with full ones,
activation checkpointing, reshard_after_forward=False with an ignored module; optimizer
mapping with empty local shards; refused settings."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

from tests.integrations import accelerate_cases as C  # noqa: E402
from tests.integrations.common import FP32_TOL, same  # noqa: E402
from tests.world import case_result, run_world  # noqa: E402

TOL = {"no": FP32_TOL, "bf16": dict(rtol=0, atol=0)}  # bf16: the very same numbers


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("accelerate"))
    return run_world(C.run_cases, 2, list(C.CASES), folder)


@pytest.mark.parametrize("case,precision", [("fp32_sharded_checkpoint", "no"),
                                            ("bf16_full_checkpoint", "bf16")])
def test_training_and_resume_equal_native(world, case, precision):
    out = case_result(world, case)
    tol = TOL[precision]
    assert (out["native"]["engine"], out["ours"]["engine"]) == ("torch", "fsdp_bridge")
    for key in ("losses", "norms", "state"):
        same(out["ours"][key], out["native"][key], f"{case} {key}", tol)
    # resuming at step RESUME_AT continues as the uninterrupted run did
    tail = out["native"]["losses"][C.RESUME_AT:]
    same(out["native"]["resumed"], tail, "native resumed", tol)
    same(out["ours"]["resumed"], tail, "ours resumed from ours", tol)
    same(out["ours_from_native"]["resumed"], tail, "ours resumed from native's checkpoint", tol)


def test_activation_checkpointing_equal_native(world):
    out = case_result(world, "activation_checkpointing")
    assert out["ours"]["layer"] == out["native"]["layer"] == "FSDPCheckpointWrapper"
    for key in ("losses", "norms", "state"):
        same(out["ours"][key], out["native"][key], key, TOL["no"])


def test_reshard_after_forward_false_and_ignored_modules_equal_native(world):
    for rank in (0, 1):
        out = case_result(world, "reshard_false_ignored_module", rank)
        assert out["native"]["norm_is_plain"] and out["ours"]["norm_is_plain"]
        for key in ("losses", "norms", "norm_weight"):
            same(out["ours"][key], out["native"][key], f"rank {rank} {key}", TOL["no"])


def test_empty_local_shards_map_the_optimizer_by_name(world):
    for rank in (0, 1):
        out = case_result(world, "empty_shards", rank)
        assert out["ours"]["held_once_each"], f"rank {rank}: optimizer holds other tensors"
        same(out["ours"]["losses"], out["native"]["losses"], "losses", TOL["no"])
        same(out["ours"]["state"], out["native"]["state"], "state", TOL["no"])


def test_settings_it_cannot_honour_are_refused_by_name(world):
    messages = case_result(world, "refusals")
    assert "fsdp_plugin.cpu_ram_efficient_loading=True" in messages["cpu_ram_efficient_loading"]
    assert "fsdp_plugin.fsdp_version=1" in messages["fsdp_version"]
