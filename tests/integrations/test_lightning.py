"""Lightning on our engine, world 2 on CPU/gloo, tiny Llama (cases in lightning_cases.py):
`ModelParallelStrategy` with fsdp_bridge's `fully_shard` in `configure_model` against the same
module with torch's (losses, full state dicts, `save_checkpoint`), and the registered
"fsdp_bridge" strategy against Lightning's FSDPStrategy on torch's FSDP1 (losses, full state
dicts; fp32 and bf16-mixed), resumed from its own full checkpoint; a Fabric loop with the
"fsdp_bridge" Fabric strategy against Fabric's FSDPStrategy (losses, clipped grad norms, state
dicts; `no_backward_sync`), whose `fabric.save` writes its checkpoint."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from tests.integrations import lightning_cases as C  # noqa: E402
from tests.integrations.common import same  # noqa: E402
from tests.world import case_result, run_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(C.run_cases, 2, list(C.CASES), str(tmp_path_factory.mktemp("lightning")))


def test_model_parallel_strategy_with_our_fully_shard_equal_native(world):
    out = case_result(world, "model_parallel_strategy")
    assert (out["native"]["engine"], out["ours"]["engine"]) == ("torch", "fsdp_bridge")
    assert len(out["ours"]["losses"]) == C.STEPS
    same(out["ours"]["losses"], out["native"]["losses"], "losses")
    same(out["ours"]["state"], out["native"]["state"], "state")
    assert out["ours"]["saved"] and out["native"]["saved"]


@pytest.mark.parametrize("case", ["lightning_fsdp_strategy", "lightning_fsdp_strategy_bf16"])
def test_fsdp_bridge_strategy_equal_native_fsdp_strategy_and_resumes(world, case):
    out = case_result(world, case)
    assert out["ours"]["engine"] == "fsdp_bridge"
    assert len(out["ours"]["losses"]) == C.STEPS + 2
    same(out["ours"]["losses"], out["native"]["losses"], "losses")
    same(out["ours"]["state"], out["native"]["state"], "state")
    same(out["ours"]["resumed"], out["native"]["losses"][C.STEPS:], "resumed from a checkpoint")


def test_strategy_is_registered_by_name_and_refuses_sharded_checkpoints():
    from lightning.pytorch.strategies import FSDPStrategy as Lightning
    from lightning.pytorch.strategies import StrategyRegistry

    from fsdp_bridge.integrations.lightning import FSDPStrategy

    assert StrategyRegistry["fsdp_bridge"]["strategy"] is FSDPStrategy
    # not among Lightning's own FSDP names, which it refuses on the CPU
    assert "fsdp_bridge" not in Lightning.get_registered_strategies()
    with pytest.raises(ValueError, match="state_dict_type='sharded' is not accepted"):
        FSDPStrategy(state_dict_type="sharded")


def test_fabric_strategy_equal_native_fabric_fsdp(world):
    out = case_result(world, "fabric_training")
    assert (out["native"]["engine"], out["ours"]["engine"]) == ("torch", "fsdp_bridge")
    for key in ("losses", "norms", "state"):
        same(out["ours"][key], out["native"][key], key)
    assert out["ours"]["saved"]


def test_fsdp_bridge_strategy_clips_gradients_by_norm(world):
    # Lightning's FSDP refuses gradient_clip_algorithm="norm"; ours clips as FSDP1's own
    # clip_grad_norm_ does (the reference: native FSDP1 clipping through its root).
    out = case_result(world, "lightning_norm_clipping")
    same(out["ours"]["losses"], out["native"]["losses"], "clipped losses")
    assert out["ours"]["losses"][-1] != out["ours"]["unclipped"][-1]  # the clipping acted
