"""The checkpoint functions' arguments are checked first (no process group needed, nothing
written): a wrong one raises an error naming the function, the argument, the value received,
what is accepted and the fix, instead of a TypeError from deep inside torch or os."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fsdp_bridge import checkpoint

MODEL = nn.Linear(2, 2)
OPTIMIZER = torch.optim.SGD(MODEL.parameters(), lr=0.1)

CASES = [  # (call, exception, what the message must name, in order)
    (lambda p: checkpoint.save_state(None, MODEL), TypeError,
     ["save_state", "path=None", "a str or os.PathLike", "Pass the checkpoint directory"]),
    (lambda p: checkpoint.save_state(MODEL, p), TypeError,
     ["save_state", "path=Linear", "a str or os.PathLike", "swapped"]),
    (lambda p: checkpoint.load_state(p, "model"), TypeError,
     ["load_state", "model='model'", "nn.Module", "Pass the model"]),
    (lambda p: checkpoint.save_state(p, MODEL, "adam"), TypeError,
     ["save_state", "optimizers='adam'", "torch.optim.Optimizer", "e.g."]),
    (lambda p: checkpoint.save_state(p, MODEL, [OPTIMIZER, MODEL]), TypeError,
     ["save_state", "optimizers=", "a list or tuple of them", "e.g."]),
    (lambda p: checkpoint.save_state(p, MODEL, OPTIMIZER, extra={"model": 1}), ValueError,
     ["save_state", "extra=", "keys other than ('model', 'optim')", "Rename ['model']"]),
    (lambda p: checkpoint.save_state(p, MODEL, extra=[1]), TypeError,
     ["save_state", "extra=[1]", "None or a dict", "e.g."]),
    (lambda p: checkpoint.save_state(p, MODEL, overwrite="yes"), TypeError,
     ["save_state", "overwrite='yes'", "True or False", "Pass overwrite=True"]),
    (lambda p: checkpoint.load_state(p, MODEL, strict=1), TypeError,
     ["load_state", "strict=1", "True or False", "Pass strict=True"]),
    (lambda p: checkpoint.save(None, p), TypeError,
     ["save", "state_dict=None", "a dict", "e.g. save("]),
    (lambda p: checkpoint.load({}, None), TypeError,
     ["load", "path=None", "a str or os.PathLike", "load(state_dict, path)"]),
    (lambda p: checkpoint.CheckpointManager(None), TypeError,
     ["CheckpointManager", "root=None", "a str or os.PathLike", "root='ckpt'"]),
    (lambda p: checkpoint.CheckpointManager(p).load_latest(None), TypeError,
     ["CheckpointManager.load_latest", "model=None", "nn.Module", "Pass the model"]),
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_a_wrong_argument_is_named_with_the_fix(tmp_path, index):
    call, exception, named = CASES[index]
    with pytest.raises(exception) as info:
        call(str(tmp_path / "ckpt"))
    message = str(info.value)
    assert message.startswith("fsdp_bridge.checkpoint."), message
    positions = [message.find(text) for text in named]
    assert -1 not in positions and positions == sorted(positions), (named, message)
    assert re.search(r"\.\s+\S", message), f"no fix given: {message}"
    assert not (tmp_path / "ckpt").exists(), "nothing is written"
