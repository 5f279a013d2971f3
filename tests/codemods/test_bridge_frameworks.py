"""`--to bridge` flags FSDP1 static calls (FB005) only in files whose model a framework wraps."""

import pathlib

import pytest

from fsdp_bridge.migrate.driver import transform_source

ROOT = pathlib.Path(__file__).resolve().parents[2]
STATIC_CALL = ("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
               "from torch.distributed.fsdp import StateDictType\n"
               "{imports}\n"
               "model = FSDP(model)\n"
               "with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n"
               "    state = model.state_dict()\n")


def _rules(imports: str) -> list[str]:
    _, sites = transform_source(STATIC_CALL.format(imports=imports), "bridge")
    return [site["rule"] for site in sites]


@pytest.mark.parametrize("imports", [
    "from transformers import LlamaConfig, LlamaForCausalLM",
    "from transformers.models.llama.modeling_llama import LlamaDecoderLayer",
    "import transformers\nconfig = transformers.AutoConfig.from_pretrained('x')",
])
def test_model_classes_of_transformers_are_no_framework_wrapping(imports):
    assert "FB005" not in _rules(imports)


@pytest.mark.parametrize("imports", [
    "from transformers import Trainer, TrainingArguments",
    "import transformers\ntrainer = transformers.Trainer(model=model)",
    "from accelerate import Accelerator",
    "import lightning as L",
    "from transformers import *",
])
def test_framework_wrappers_still_get_fb005(imports):
    assert "FB005" in _rules(imports)


def test_the_shipped_fsdp1_example_migrates_to_bridge_without_a_todo():
    source = (ROOT / "fsdp_bridge" / "examples" / "fsdp1_train_llama.py").read_text()
    new_source, sites = transform_source(source, "bridge")
    assert "TODO" not in new_source
    assert all(site["status"] != "todo" for site in sites), sites
