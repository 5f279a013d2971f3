"""`fsdp-bridge explain MODEL`: the user's own model, named as MODULE:FUNCTION or FILE.py:FUNCTION,
and the shipped examples started without torchrun."""

import json
import os
import subprocess
import sys

import pytest

from fsdp_bridge.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = """import torch
from fsdp_bridge.fsdp import FullyShardedDataParallel

def wrapped():
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return FullyShardedDataParallel(inner, auto_wrap_policy=lambda module, recurse, **_: recurse
                                    or isinstance(module, torch.nn.Linear))

def unwrapped():
    return torch.nn.Linear(8, 4)
"""


def _explain(*argv, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, cwd or ""]))
    return subprocess.run([sys.executable, "-m", "fsdp_bridge", "explain", *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_explain_takes_a_script_path_and_a_module_path(tmp_path):
    (tmp_path / "mymodels.py").write_text(BUILD)
    by_file = _explain(f"{tmp_path / 'mymodels.py'}:wrapped", "--json", "-")
    assert by_file.returncode == 0, by_file.stderr
    # --json -: the plan as data on stdout, its text on stderr
    assert "front-end FullyShardedDataParallel" in by_file.stderr
    assert by_file.stderr.count("torch.float32 -> torch.float32") == 2  # one unit per Linear
    plan = json.loads(by_file.stdout)
    assert plan["frontend"] == "FullyShardedDataParallel" and len(plan["units"]) == 3
    assert [unit["compute_dtype"] for unit in plan["units"][:2]] == ["torch.float32"] * 2
    by_module = _explain("mymodels:unwrapped", cwd=str(tmp_path))
    assert by_module.returncode == 0, by_module.stderr
    assert "returned an unwrapped Linear; it was wrapped whole" in by_module.stdout


@pytest.mark.parametrize("model, words", [
    ("build_model", "expected MODULE:FUNCTION"),
    ("missing.py:build", "the file 'missing.py' does not exist"),
    ("pkg.mod:not-a-name", "expected MODULE:FUNCTION"),
])
def test_a_malformed_model_argument_is_refused_before_any_import(model, words, capsys):
    assert main(["explain", model]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("example", ["fsdp1_train_llama.py", "yafsdp_llama.py"])
def test_an_example_started_without_torchrun_says_how_to_run_it(example):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "fsdp_bridge", "examples", example)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    # The script's own words are its last line, alone; what comes before is what installed
    # libraries print while they import (torchao, when present, names its CUDA kernels).
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (
        f"{example}: run it under torchrun, one process per rank, e.g. torchrun "
        f"--nproc_per_node 2 {os.path.join(ROOT, 'fsdp_bridge', 'examples', example)}")
    assert [line for line in lines if "Traceback" in line or example in line] == [lines[-1]]


def test_a_function_that_returns_no_model_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from fsdp_bridge import explain_cli

    monkeypatch.setattr(explain_cli, "_one_rank_world", lambda: None)  # no model to wrap here
    script = tmp_path / "builders.py"
    script.write_text("def settings():\n    return {'hidden': 64}\n\n"
                      "def needs(hidden, layers=2):\n    return hidden\n")
    assert main(["explain", f"{script}:settings"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"fsdp-bridge explain: error: MODEL '{script}:settings': "
                                "settings() returned a dict, not a torch.nn.Module: return the "
                                "model (wrapped by one of fsdp_bridge's front-ends, or not)."]
    # A function bound by other means than a def (read from the file) is checked once imported.
    script.write_text("from functools import partial\n\ndef _build(hidden):\n    return hidden\n\n"
                      "build = lambda hidden: hidden\n")
    assert main(["explain", f"{script}:build"]) == 2
    assert "build() takes arguments (hidden)" in capsys.readouterr().err
