"""The held-in front-end table (heldin_cases.py): every case ends in a clear error, a named
warning, the Plan asked for, or numbers equal to native torch / the single-process reference.

Tolerances for numerics: fp32, rtol 1e-5 / atol 1e-6 (as the other parity tests)."""

from __future__ import annotations

import collections
import re
import warnings

import pytest
import torch

from fsdp_bridge.translation import FsdpBridgeWarning
from tests import models as M
from tests.frontends import heldin_cases as H
from tests.native_torch import skip_native
from tests.world import run_world

TOL = dict(rtol=1e-5, atol=1e-6)


def test_the_table_covers_five_frontends_with_at_least_sixty_cases():
    assert len(H.CASES) >= 60
    assert len({case.name for case in H.CASES}) == len(H.CASES), "duplicate case names"
    by_frontend = collections.Counter(case.frontend for case in H.CASES)
    assert set(by_frontend) == {"FSDP1", "FSDP2", "YaFSDP", "Zeta", "TorchAcc"}, by_frontend
    assert set(H.IN_WORLD) == set(H.WORLD_CASES), "every world case has a row, and back"
    assert {case.kind for case in H.CASES} == {"error", "warning", "plan", "native",
                                               "reference"}


def _named_warnings(call):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in record if issubclass(w.category, FsdpBridgeWarning)]


@pytest.mark.parametrize("case", H.IN_PROCESS, ids=lambda case: case.name)
def test_in_process_case(case):
    if case.kind == "error":
        argument, value, accepted = case.expect
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
                case.run()
        message = str(info.value)
        assert f"{argument}=" in message or not argument, message
        assert value in message, message
        assert accepted in message, message
        assert re.search(r"\.\s+\S", message), f"no fix given: {message}"
    elif case.kind == "warning":
        _, messages = _named_warnings(case.run)
        assert len(messages) == len(case.expect), messages
        for name, message in zip(case.expect, messages):
            assert name in message and "ignored" in message, message
    else:
        plan, messages = _named_warnings(case.run)
        assert messages == [], messages
        assert case.expect(plan), plan


# -- the spawned world ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    return run_world(H.run_world_cases, 2)


def _result(world, name):
    for rank, results in enumerate(world):
        value = results[name]
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"{name} failed on rank {rank}:\n{value['error']}")
    skip_native(world[0][name])
    return world[0][name]


def _reference(micro_steps=1):
    losses, _ = M.train_reference(M.tiny_llama(), H._batches(), micro_steps=micro_steps)
    return losses


def _close(actual, expected, what):
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), **TOL,
                               msg=lambda m: f"{what}: {m}")


def test_nested_inner_wrapper_refuses_root_only_methods_like_native(world):
    result = _result(world, "fsdp1 nested inner clip_grad_norm_ / no_sync vs native")
    assert result["native"]["errors"] == [("RuntimeError", True)] * 2, result
    assert result["ours"]["errors"] == result["native"]["errors"], result
    _close([result["ours"]["root_norm"]], [result["native"]["root_norm"]], "root norm")


def test_limit_all_gathers_false_warns_and_trains_like_native(world):
    result = _result(world, "fsdp1 limit_all_gathers=False trains like native")
    assert result["ours"]["warned"] and not result["native"]["warned"], result
    _close(result["ours"]["losses"], result["native"]["losses"], "losses")


def test_share_comm_ctx_trains_like_native(world):
    result = _result(world, "fsdp2 share_comm_ctx of fully_shard modules trains like native")
    _close(result["ours"]["losses"], result["native"]["losses"], "losses")


def test_yafsdp_declared_accumulation_equals_reference(world):
    result = _result(world, "yafsdp accumulation of 2 stepping every 2 = reference")
    _close(result["ours"], _reference(micro_steps=2), "losses")


def test_yafsdp_step_inside_the_cycle_is_refused_on_every_rank(world):
    name = "yafsdp stepping every micro-step refused on every rank"
    _result(world, name)
    for results in world:
        message = results[name]["ours"]
        assert message is not None and "gradient_accumulation_steps=2" in message, message
        assert "micro-step 1 of 2" in message, message


def test_zeta_blocks_train_like_reference(world):
    result = _result(world, "zeta auto_wrap with the model's block trains like the reference")
    assert result["units"] == 4  # three decoder layers and the root
    _close(result["ours"], _reference(), "losses")


def test_torchacc_lazy_and_buckets_warn_and_train_like_reference(world):
    result = _result(world, "torchacc backend='lazy' + buckets train like the reference")
    assert result["warned"] == ["backend='lazy'", "dataloader.buckets"], result
    _close(result["ours"], _reference(), "losses")
