"""`save` on two ranks: every rank must pass the same path, and a problem found on one rank
(a value that does not pickle, a target that must not be replaced) fails every rank with a
clear error instead of a hang or a partial checkpoint. One spawned world for all cases."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint import user_files
from tests.world import run_world


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def _cases(rank, world, directory):
    import warnings

    from fsdp_bridge import checkpoint
    from fsdp_bridge.checkpoint import atomic

    warnings.simplefilter("ignore")
    state = {"w": torch.full((4,), float(rank))}
    out = {}
    # A path built from the rank: each rank would write its shard to a different place.
    out["rank_path"] = _error_of(lambda: checkpoint.save(
        state, os.path.join(directory, f"ckpt_rank{rank}")))
    out["rank_path_written"] = sorted(n for n in os.listdir(directory) if "ckpt_rank" in n)
    # A lambda on rank 1 only.
    extra = {"fn": (lambda x: x)} if rank == 1 else {"fn": "identity"}
    out["lambda"] = _error_of(lambda: checkpoint.save({"w": state["w"], "extra": extra},
                                                      os.path.join(directory, "lam")))
    # A user's directory as the target (rank 0 checks it; both must raise).
    out["outputs"] = _error_of(lambda: checkpoint.save(state, os.path.join(directory,
                                                                            "outputs")))
    # And a good save, loaded back.
    good = os.path.join(directory, "good")
    checkpoint.save({"w": torch.arange(4.0) + rank}, good)
    loaded = {"w": torch.zeros(4)}
    checkpoint.load(loaded, good)
    out["good"] = loaded["w"].tolist()
    out["leftovers"] = [atomic.leftovers(os.path.join(directory, name))
                        for name in ("lam", "outputs", "good", "ckpt_rank0", "ckpt_rank1")]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("safety_world")
    before = user_files.make(directory / "outputs")
    results = run_world(_cases, 2, str(directory))
    return results, user_files.unchanged(directory / "outputs", before), directory


def test_ranks_must_agree_on_the_path(results):
    ranks, _, _ = results
    for out in ranks:
        assert "ranks disagree on the checkpoint path" in out["rank_path"], out["rank_path"]
        assert "rank 0: " in out["rank_path"] and "ckpt_rank1" in out["rank_path"]
        assert out["rank_path_written"] == []


def test_a_value_that_does_not_pickle_on_one_rank_fails_every_rank(results):
    ranks, _, directory = results
    assert "state_dict['extra']['fn'] is a function" in ranks[1]["lambda"]
    assert "failed on rank 1" in ranks[0]["lambda"] and "<lambda>" in ranks[0]["lambda"]
    assert not os.path.exists(directory / "lam")


def test_a_target_refused_on_rank_0_fails_every_rank_and_keeps_the_files(results):
    ranks, untouched, _ = results
    assert "not a checkpoint written by fsdp-bridge" in ranks[0]["outputs"]
    assert "failed on rank 0" in ranks[1]["outputs"]
    assert untouched


def test_a_good_save_after_failures_loads_and_leaves_nothing_behind(results):
    ranks, _, _ = results
    # Replicated plain tensors: DCP keeps rank 0's (the coordinator's) value.
    assert ranks[0]["good"] == ranks[1]["good"] == [0.0, 1.0, 2.0, 3.0]
    assert all(not any(found) for found in (out["leftovers"] for out in ranks))
