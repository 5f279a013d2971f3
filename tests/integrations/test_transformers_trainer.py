"""`fsdp_bridge.integrations.transformers.Trainer` against `transformers.Trainer` on native FSDP2
(through accelerate): the same Trainer script, world 2 on CPU/gloo (test-only FSDP switch), tiny
Llama, fp32 and bf16: logged losses and grad norms, final full state dicts, `generate` after
training (Trainer registers it with torch's `register_fsdp_forward_method`), and
`resume_from_checkpoint` at step 2 (ours from ours, ours from native's checkpoint)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

from tests.integrations import trainer_cases as C  # noqa: E402
from tests.integrations.common import same  # noqa: E402
from tests.world import case_result, run_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(C.run_cases, 2, list(C.CASES), str(tmp_path_factory.mktemp("trainer")))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_equal_native(world, precision):
    out = case_result(world, precision)
    native, ours = out["native"], out["ours"]
    assert ours["root"] == native["root"] == "FSDPLlamaForCausalLM"
    assert ours["processes"] == native["processes"] == 2
    assert (native["engine"], ours["engine"]) == ("torch", "fsdp_bridge")
    assert len(ours["losses"]) == C.STEPS
    for key in ("losses", "norms", "state"):
        same(ours[key], native[key], f"{precision} {key}")
    assert torch.equal(ours["tokens"], native["tokens"])
    tail = native["losses"][2:]
    same(native["resumed"], tail, "native resumed")
    same(ours["resumed"], tail, "ours resumed from ours")
    same(out["ours_from_native"]["resumed"], tail, "ours resumed from native's checkpoint")


def test_an_accelerator_of_another_subclass_is_refused_by_name():
    import accelerate

    from fsdp_bridge.integrations.accelerate import Accelerator
    from fsdp_bridge.integrations.transformers import use_bridge_accelerator

    class Custom(accelerate.Accelerator):
        pass

    custom = object.__new__(Custom)  # (the class is all that is checked)
    with pytest.raises(TypeError, match="Make Custom inherit from fsdp_bridge.integrations"):
        use_bridge_accelerator(custom)
    ours = object.__new__(Accelerator)
    use_bridge_accelerator(ours)  # already ours: left alone
    assert type(ours) is Accelerator
