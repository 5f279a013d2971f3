"""Runnable fixtures give the same numbers before and after `migrate --to fsdp2`, on 2 CPU ranks.

- examples/fsdp1_train_llama.py (tiny Llama, wrap policy, MixedPrecision, no_sync accumulation,
  clip_grad_norm_, full state dict) under torchrun, once as FSDP1 and once rewritten;
- runnable/fsdp1_kwargs_model.py (settings in variables and **kwargs: the runtime helpers), both
  variants inside one spawned world.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import torch

from fsdp_bridge.migrate.driver import transform_source
from tests.world import run_world

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp1_train_llama.py"
KWARGS_FIXTURE = pathlib.Path(__file__).parent / "runnable" / "fsdp1_kwargs_model.py"


def _torchrun(script: pathlib.Path, out: pathlib.Path) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
         "--steps", "3", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return re.findall(r"^step \d+ loss [\d.]+$", result.stdout, re.MULTILINE)


def test_llama_example_same_losses_after_fsdp2_rewrite(tmp_path):
    rewritten = tmp_path / "fsdp2_train_llama.py"
    source, sites = transform_source(EXAMPLE.read_text(), "fsdp2")
    assert "FullyShardedDataParallel" not in source and "fully_shard(" in source
    assert {s["rule"] for s in sites} >= {"FB100", "FB102", "FB103", "FB104"}
    rewritten.write_text(source)
    before = _torchrun(EXAMPLE, tmp_path / "fsdp1")
    after = _torchrun(rewritten, tmp_path / "fsdp2")
    assert len(before) == 3 and before == after
    full1 = torch.load(tmp_path / "fsdp1" / "model.pt")
    full2 = torch.load(tmp_path / "fsdp2" / "model.pt")
    assert full1.keys() == full2.keys()
    for key in full1:
        torch.testing.assert_close(full1[key], full2[key])


def _load(path: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _both_variants(rank, world_size, original, rewritten):
    return {name: _load(path).train(rank) for name, path in (("fsdp1", original), ("fsdp2", rewritten))}


def test_runtime_helpers_same_numbers(tmp_path):
    source, sites = transform_source(KWARGS_FIXTURE.read_text(), "fsdp2")
    assert "fsdp1_fully_shard(" in source and "fsdp1_no_sync(" in source
    assert "fsdp1_clip_grad_norm_(" in source and "fsdp1_state_dict_options(" in source
    rewritten = tmp_path / "fsdp2_kwargs_model.py"
    rewritten.write_text(source)
    results = run_world(_both_variants, 2, str(KWARGS_FIXTURE), str(rewritten))
    for rank_result in results:
        losses1, state1 = rank_result["fsdp1"]
        losses2, state2 = rank_result["fsdp2"]
        assert [loss for loss, _ in losses1] == [loss for loss, _ in losses2]
        for (_, norm1), (_, norm2) in zip(losses1, losses2):  # reduced in another order: ~1 ulp
            torch.testing.assert_close(norm1, norm2, rtol=1.3e-6, atol=1e-5)
        assert state1.keys() == state2.keys()
        for key in state1:
            assert abs(state1[key] - state2[key]) < 1e-5, key
