"""Every accelerate setting the Accelerator cannot honour is named in the one error, not only the
first (read from a stand-in with the attributes `check_settings` reads; no process group)."""

from types import SimpleNamespace

import pytest

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
