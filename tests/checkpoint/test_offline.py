"""Without ranks: convert-checkpoint, and a process killed while saving (atomic writes)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fsdp_bridge.checkpoint import convert as conv
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.cli import main as cli_main
from tests import models as M

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _digest(path):
    out = {}
    for root, _, files in os.walk(path):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as handle:
                out[os.path.relpath(os.path.join(root, name), path)] = \
                    hashlib.sha256(handle.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory):
    """An FSDP1-style FULL checkpoint: {"model": state dict, "optim": name-keyed state}."""
    model = M.tiny_llama(0)
    optimizer = M.make_adamw(model.parameters())
    M.lm_loss(model, M.global_batches(1, 4)[0]).backward()
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    osd = optimizer.state_dict()
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "optim": {"state": {names[i]: s for i, s in osd["state"].items()},
                       "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                                        for g in osd["param_groups"]]}}
    path = str(tmp_path_factory.mktemp("convert") / "full.pt")
    torch.save(state, path)
    return path, state


def _equal(a, b):
    return not conv._compare(a, b)


def test_torch_dcp_torch_round_trip(full_checkpoint, tmp_path):
    path, state = full_checkpoint
    assert cli_main(["convert-checkpoint", path, str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert os.path.exists(tmp_path / "dcp" / ".metadata")
    assert cli_main(["convert-checkpoint", str(tmp_path / "dcp"), str(tmp_path / "back.pt"),
                     "--to", "torch"]) == 0
    assert _equal(state, torch.load(tmp_path / "back.pt", weights_only=True))


def test_to_safetensors_and_back(full_checkpoint, tmp_path, capsys):
    path, state = full_checkpoint
    assert cli_main(["convert-checkpoint", path, str(tmp_path / "hf"), "--to", "safetensors"]) == 0
    assert "kept the tensors under 'model'" in capsys.readouterr().out
    from safetensors.torch import load_file
    assert _equal(state["model"], load_file(tmp_path / "hf" / "model.safetensors"))
    assert cli_main(["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "m.pt"),
                     "--to", "torch"]) == 0
    assert _equal(state["model"], torch.load(tmp_path / "m.pt", weights_only=True))


def test_refuses_to_overwrite_and_damaged_input(full_checkpoint, tmp_path, capsys):
    path, _ = full_checkpoint
    target = tmp_path / "exists.pt"
    target.write_bytes(b"keep me")
    assert cli_main(["convert-checkpoint", path, str(target), "--to", "torch"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert target.read_bytes() == b"keep me"
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(open(path, "rb").read()[:5000])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        conv.convert(str(damaged), str(tmp_path / "x"), "dcp")
    assert not os.path.exists(tmp_path / "x")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


_CRASH = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    from fsdp_bridge import checkpoint
    from torch.distributed.checkpoint import FileSystemWriter
    path, mode = sys.argv[1], sys.argv[2]
    checkpoint.save({{"w": torch.arange(1000.0), "step": 1}}, path)   # the previous checkpoint
    if mode == "during_write":
        original = FileSystemWriter.write_data
        def write_then_die(self, plan, planner):
            result = original(self, plan, planner)
            result.wait()
            os._exit(17)   # data files written, metadata not, nothing published
        FileSystemWriter.write_data = write_then_die
    else:  # between the two renames of a replacement
        real_rename = os.rename
        def rename_then_die(a, b):
            real_rename(a, b)
            if os.path.abspath(a) == os.path.abspath(path):   # the old one moved aside
                os._exit(17)
        os.rename = rename_then_die
    checkpoint.save({{"w": torch.zeros(1000), "step": 2}}, path)
""")


@pytest.mark.parametrize("mode", ["during_write", "between_renames"])
def test_crash_during_save_leaves_previous_checkpoint(tmp_path, mode):
    path = str(tmp_path / "ckpt")
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(root=ROOT))
    done = subprocess.run([sys.executable, str(script), path, mode], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 17, done.stderr
    from fsdp_bridge import checkpoint
    state = {"w": torch.empty(1000), "step": 0}
    with pytest.warns(UserWarning, match="crashed") if mode == "between_renames" else _nothing():
        checkpoint.load(state, path)
    assert torch.equal(state["w"], torch.arange(1000.0)) and state["step"] == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
