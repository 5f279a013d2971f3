"""Lightning's `ModelParallelStrategy` with fsdp_bridge's `fully_shard` in `configure_model`,
against the same LightningModule with torch's: world 2 on CPU/gloo, tiny Llama, fp32: per-step
losses, final full state dicts, and a distributed checkpoint written by `save_checkpoint`."""

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
