"""Upstream FSDP1, Zeta and TorchAcc examples run with only the import changed, on 2 CPU ranks,
and train (seed_cases.py; one spawned world); so do the repository's examples of each dialect
(examples/), to the losses of one process on the global batch."""

from __future__ import annotations

import pytest
import torch

from tests import models as M
from tests.frontends import seed_cases as C
from tests.world import run_world

FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(C.run_all, 2, str(tmp_path_factory.mktemp("torchacc")))


def test_seed000_fsdp1_snippet_matches_reference(ranks):
    out = ranks[0]["seed000"]
    assert out["units"][-1] == "" and "model.embed_tokens" in out["units"]
    assert "lm_head" in out["units"] and "model.layers.0" in out["units"]
    model = M.tiny_llama()
    losses, _ = M.train_reference(model, M.global_batches(C.STEPS, 8))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(losses), **FP32)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(out["state"][key], value, **FP32)


def test_seed001_zeta_examples_train(ranks):
    out = ranks[0]["seed001"]
    torch.testing.assert_close(torch.tensor(out["basic"]), torch.tensor(out["reference_basic"]),
                               **FP32)
    torch.testing.assert_close(torch.tensor(out["auto"]), torch.tensor(out["reference_auto"]),
                               **FP32)
    assert out["auto_units"] == ("1", "")
    torch.testing.assert_close(torch.tensor(out["shard_grad_op"]),
                               torch.tensor(out["reference_basic"]), **FP32)
    advanced = out["advanced"]
    assert advanced != out["reference_basic"]  # bf16 really ran in low precision
    torch.testing.assert_close(torch.tensor(advanced), torch.tensor(out["reference_basic"]),
                               rtol=2e-2, atol=2e-2)
    assert ranks[1]["seed001"]["basic"] == out["basic"]


def test_seed003_torchacc_trains_and_checkpoints(ranks):
    out = ranks[0]["seed003"]
    assert out["losses"][-1] < out["losses"][0]
    assert out["consolidated_keys"] == out["model_keys"]
    for rank in (0, 1):
        result = ranks[rank]["seed003"]
        for key, value in result["before"].items():
            assert torch.equal(result["after"][key], value), key
    assert torch.isfinite(torch.tensor(out["extra_loss"]))


def test_the_repository_examples_of_each_dialect_train_the_reference_losses(ranks):
    import sys

    if C.EXAMPLES not in sys.path:
        sys.path.insert(0, C.EXAMPLES)
    import common

    model = common.tiny_llama()  # one process on the global batch, the examples' optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = []
    for ids in common.global_batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.append(loss.item())
    assert sorted(ranks[0]["examples"]) == sorted(C.DIALECT_EXAMPLES)
    for name, losses in ranks[0]["examples"].items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), **FP32,
                                   msg=lambda text, name=name: f"{name}: {text}")
