"""The gpu-check's frameworks phase (tests/gpu_check/frameworks.py) on the CPU: it needs no
libcst or pathspec (a GPU machine may lack them), and a `--smoke` run of one example pair
records agreeing losses, both runs' FSDP, generated tokens and the parameters' device, and
says honestly that they are not on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

IMPORTS_WITHOUT_CODEMOD_DEPENDENCIES = """
import sys
sys.modules["libcst"] = None  # `import libcst` now raises ImportError
sys.modules["pathspec"] = None
import tests.gpu_check.frameworks, fsdp_bridge.harness.scripts, fsdp_bridge.harness.step_hook
import fsdp_bridge.examples.frameworks, fsdp_bridge.integrations.accelerate
import fsdp_bridge.integrations.transformers, fsdp_bridge.integrations.lightning
"""


def test_the_phase_and_the_examples_need_no_libcst_or_pathspec():
    pytest.importorskip("lightning")
    done = subprocess.run([sys.executable, "-c", IMPORTS_WITHOUT_CODEMOD_DEPENDENCIES],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_smoke_run_records_losses_fsdp_generation_and_the_cpu(tmp_path):
    pytest.importorskip("accelerate")
    found = tmp_path / "frameworks.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_check.frameworks", "--smoke", "--json", str(found),
         "--examples", "accelerate_llama"], cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (pair,) = json.loads(found.read_text())["pairs"]
    assert pair["passed"] and pair["agree_within_bf16_tolerance"], pair["problems"]
    assert len(pair["ours"]["losses"]) == len(pair["native"]["losses"]) == 3
    assert pair["max_loss_diff"] == max(abs(a - b) for a, b in zip(pair["ours"]["losses"],
                                                                    pair["native"]["losses"]))
    assert "fsdp-bridge fully_shard" in pair["ours"]["wrapped"]
    assert "torch FSDP2" in pair["native"]["wrapped"]
    assert pair["ours"]["generated"] and pair["same_generated_tokens"]
    assert pair["ours"]["parameters_on"] == pair["native"]["parameters_on"] == ["cpu"]
    assert pair["parameters_on_cuda"] is False
