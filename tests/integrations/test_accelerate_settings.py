"""Every accelerate setting the Accelerator cannot honour is named in the one error, not only the
first (read from a stand-in with the attributes `check_settings` reads; no process group)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import DynamoBackend  # noqa: E402

from fsdp_bridge.integrations.accelerate import check_settings  # noqa: E402


def _accelerator(**refused):
    state = SimpleNamespace(
        fsdp_plugin=SimpleNamespace(cpu_ram_efficient_loading=refused.get("ram", False)),
        dynamo_plugin=SimpleNamespace(backend=refused.get("dynamo", DynamoBackend.NO)),
        mixed_precision=refused.get("precision", "bf16"))
    return SimpleNamespace(state=state, parallelism_config=None)


def test_accepted_settings_pass():
    check_settings(_accelerator())


def test_every_refused_setting_is_named():
    with pytest.raises(ValueError) as error:
        check_settings(_accelerator(ram=True, precision="fp8"))
    message = str(error.value)
    assert "fsdp_plugin.cpu_ram_efficient_loading=True" in message
    assert "mixed_precision='fp8'" in message
    assert "cpu_ram_efficient_loading=False" in message and "mixed_precision='bf16'" in message


def _state(distributed_type):
    return SimpleNamespace(state=SimpleNamespace(distributed_type=distributed_type),
                           mixed_precision="bf16")


def test_fsdp_asked_on_the_cpu_shards_or_says_it_is_off(monkeypatch):
    """Stock accelerate drops the FSDP plugin on a CPU-only machine (data parallelism); ours sets
    its state to FSDP with the plugin and shards. One process without a launcher cannot shard:
    a warning says FSDP is off and why. Without a plugin, nothing changes."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from fsdp_bridge.integrations import accelerate as ours

    monkeypatch.setitem(PartialState._shared_state, "distributed_type", DistributedType.MULTI_CPU)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    data_parallel = _state(DistributedType.MULTI_CPU)
    ours.shard_on_cpu(data_parallel, plugin)
    assert data_parallel.state.distributed_type == DistributedType.FSDP
    assert data_parallel.state.fsdp_plugin is plugin
    assert PartialState._shared_state["distributed_type"] == DistributedType.FSDP
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    alone = _state(DistributedType.NO)
    with pytest.warns(UserWarning, match="FSDP is off and the model is not sharded"):
        ours.shard_on_cpu(alone, plugin)
    assert alone.state.distributed_type == DistributedType.NO
    untouched = _state(DistributedType.MULTI_CPU)
    ours.shard_on_cpu(untouched, None)
    assert untouched.state.distributed_type == DistributedType.MULTI_CPU
    # Under a launcher without an accelerator, ours asks accelerate for its CPU distributed
    # state (cpu=True), which a user's script on a GPU machine would not pass.
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ours._launched_without_accelerator() == (not torch.accelerator.is_available())
    if not torch.accelerator.is_available():  # a state made without cpu=True: say the fix
        with pytest.warns(UserWarning, match=r"FSDP is off.*Pass cpu=True \(for the HF Trainer"):
            ours.shard_on_cpu(alone, plugin)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not ours._launched_without_accelerator()
