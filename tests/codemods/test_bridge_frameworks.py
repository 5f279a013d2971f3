"""`--to bridge` flags FSDP1 static calls (FB005) only in files whose model a framework wraps:
not where the file builds the wrapper itself; where the framework's entry point is rewritten to
fsdp_bridge's route (FB006), on the FSDP1 calls its FSDP2 model cannot answer; elsewhere the
file keeps torch's imports under one TODO."""

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


@pytest.mark.parametrize("imports, rules", [
    ("from transformers import Trainer, TrainingArguments", ["FB006", "FB001", "FB001", "FB005"]),
    ("from accelerate import Accelerator", ["FB006", "FB001", "FB001", "FB005"]),
    ("import transformers\ntrainer = transformers.Trainer(model=model)", ["FB005"]),
    ("import lightning as L", ["FB005"]),
    ("import lightning as L\ntrainer = L.Trainer(strategy='fsdp')", ["FB006", "FB001", "FB001"]),
    ("import pytorch_lightning as pl\ntrainer = pl.Trainer(strategy='fsdp')", ["FB005"]),
    ("from transformers import *", ["FB005"]),
])
def test_framework_files_that_do_not_build_the_wrapper(imports, rules):
    source = STATIC_CALL.replace("model = FSDP(model)\n", "").format(imports=imports)
    output, sites = transform_source(source, "bridge")
    assert sorted(site["rule"] for site in sites) == sorted(rules)
    kept = rules == ["FB005"]  # torch's imports stay, under one TODO
    assert ("from torch.distributed.fsdp import" in output) == kept


@pytest.mark.parametrize("imports", [
    "from transformers import Trainer, TrainingArguments",
    "from accelerate import Accelerator",
    "import lightning as L",
])
def test_framework_files_that_build_the_wrapper_are_swapped_without_fb005(imports):
    assert sorted(_rules(imports)) == ["FB001", "FB001"]


def test_the_shipped_fsdp1_example_migrates_to_bridge_without_a_todo():
    source = (ROOT / "fsdp_bridge" / "examples" / "fsdp1_train_llama.py").read_text()
    new_source, sites = transform_source(source, "bridge")
    assert "TODO" not in new_source
    assert all(site["status"] != "todo" for site in sites), sites


@pytest.mark.parametrize("plugin, kept", [
    ("FullyShardedDataParallelPlugin()", True),  # accelerate's default: FSDP1
    ("FullyShardedDataParallelPlugin(fsdp_version=1)", True),
    ("FullyShardedDataParallelPlugin(fsdp_version=2)", False),
    ("FullyShardedDataParallelPlugin(**settings)", False),  # not readable from the file
])
def test_accelerate_fsdp_version_decides_the_route(plugin, kept):
    source = STATIC_CALL.replace("model = FSDP(model)\n", "").format(
        imports=f"from accelerate import Accelerator, FullyShardedDataParallelPlugin\n"
                f"accelerator = Accelerator(fsdp_plugin={plugin})")
    output, _ = transform_source(source, "bridge")
    assert ("from torch.distributed.fsdp import" in output) == kept
    assert ("from fsdp_bridge.integrations.accelerate import Accelerator" in output) == (not kept)
