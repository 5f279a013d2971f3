"""What the frameworks' FSDP2 paths do to a `fully_shard`-ed model, ours against native torch on
CPU/gloo (world 2, tiny Llama; cases in bug_cases.py): torch's `register_fsdp_forward_method`
then `generate` (HF Trainer), `fully_shard` on a CheckpointWrapper around an already sharded
layer (accelerate's activation checkpointing), and where shards of a CPU-built model end up."""

from __future__ import annotations

import pytest
import torch

from tests.integrations import bug_cases as C
from tests.integrations.common import same
from tests.world import case_result, run_world


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2, list(C.CASES))


def test_generate_after_torchs_register_fsdp_forward_method(world):
    for rank in (0, 1):
        out = case_result(world, "generate_after_torch_registration", rank)
        assert out["ours"]["tokens"].shape == (2, 9)
        assert torch.equal(out["ours"]["tokens"], out["native"]["tokens"])
        same(out["ours"]["losses"], out["native"]["losses"], "losses after generate")


def test_other_private_fsdp_state_is_refused_by_name(world):
    message = case_result(world, "other_private_state_is_named")
    assert "'_fsdp_param_group'" in message and "fsdp_bridge" in message


def test_fully_shard_on_checkpoint_wrapper_of_sharded_layer(world):
    out = case_result(world, "checkpoint_wrapper_after_shard")
    assert out["ours"]["classes"] == out["native"]["classes"] == ["FSDPCheckpointWrapper"] * 3
    same(out["ours"]["losses"], out["native"]["losses"], "losses")
    same(out["ours"]["state"], out["native"]["state"], "state")


def test_empty_local_shards_share_data_ptr_zero(world):
    # rank 1 holds no row of the head's weight (1, 8) nor of its bias (1,)
    assert case_result(world, "empty_shards_share_data_ptr", 1) == [0, 0]


def test_cpu_mesh_keeps_shards_where_they_are():
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp_bridge.fsdp._fully_shard import _shard_device

    assert _shard_device(SimpleNamespace(device_type="cpu"), None) is None
    assert _shard_device(SimpleNamespace(device_type="cuda"), CPUOffloadPolicy()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: shards of a "
                    "CPU-built model move to the CUDA mesh's current device")
def test_cpu_built_model_shards_land_on_the_cuda_mesh_device():
    from types import SimpleNamespace

    from fsdp_bridge.fsdp._fully_shard import _shard_device

    device = _shard_device(SimpleNamespace(device_type="cuda"), None)
    assert device == torch.device("cuda", torch.cuda.current_device())
    out = run_world(C.run_cases, 1, ["cpu_built_on_cuda_mesh"], backend_name="nccl")
    assert case_result(out, "cpu_built_on_cuda_mesh") == {"devices": ["cuda"], "trained": True}
